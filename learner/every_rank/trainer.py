"""One training step on a step batch: advantages -> mini-batches -> micro-batches -> fused
logprobs -> loss -> AdamW, on one rank or several (Accelerate; DDP syncs the gradients).

Logprobs come from `tidal.kernels.logprobs` on the final hidden states and the LM-head
weight (fp32 accumulation), so [tokens x vocab] logits are never materialized. Every rank is
given the same step batch and trains on its share; aggregation weights and advantage
statistics use counts summed over all ranks, so N ranks make the same update as one.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from tidal.broker.schema import RolloutGroup
from tidal.config import LearnerConfig, LossConfig, LossType, LrScaling, LrSchedule, compute_dtype
from tidal.kernels import logprobs as fused_logprobs
from tidal.kernels import sampler_floor
from tidal.learner.every_rank import lora, sharding, state_files
from tidal.learner.every_rank.batch import (
    MicroBatch,
    Row,
    aggregation_weights,
    assign_groups,
    build_rows,
    collate,
    computed_positions,
    group_advantages,
    micro_batches,
)
from tidal.learner.every_rank.loss import LossInputs, policy_loss, ratios_of


def load_policy(
    model_path: str, param_dtype: str, attention: str = "sdpa", compute_dtype: str | None = None, empty: bool = False
):
    """The policy with its parameters in `param_dtype` (the master weights the optimizer updates; under
    learner.lora the frozen base's: `policy_dtype`), computing in `compute_dtype` (default: `param_dtype`).
    `empty`: built without weights, its parameters on the meta device (a sharded learner loads each rank's
    shard afterwards, `sharding.load_pretrained`); its buffers (rotary frequencies) are real, and tied
    weights tied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    implementation = attention_implementation(attention, compute_dtype or param_dtype)
    dtype = getattr(torch, param_dtype)
    if not empty:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=implementation)
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        policy = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_path), dtype=dtype, attn_implementation=implementation
        )
    policy.tie_weights()  # built empty, the head is not yet the embedding's parameter
    return policy


def policy_dtype(cfg: LearnerConfig) -> str:
    """The dtype the policy is loaded in: the master weights' (learner.param_dtype); under learner.lora the
    frozen base's, the compute dtype: it is never updated, so it needs no fp32 master copy."""
    return compute_dtype(cfg) if cfg.lora.enabled else cfg.param_dtype


def attention_implementation(attention: str, compute_dtype: str = "bfloat16") -> str:
    """learner.attention, with auto resolved: flash-attn's varlen kernels on CUDA where installed and
    the compute is in half precision (flash-attn has no fp32 kernels), else sdpa."""
    if attention != "auto":
        return attention
    import importlib.util

    half = compute_dtype in ("bfloat16", "float16")
    return (
        "flash_attention_2" if half and torch.cuda.is_available() and importlib.util.find_spec("flash_attn") else "sdpa"
    )


def decoder_layers(policy) -> torch.nn.ModuleList:
    """The policy's stack of decoder layers, each one FSDP unit when the learner shards it."""
    layers = getattr(getattr(policy, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(
            f"learner.fsdp.enabled: {type(policy).__name__} has no decoder layer list at `model.layers` to shard"
        )
    return layers


def micro_batch_layout(packing: str, policy) -> str:
    """learner.packing resolved: auto packs where the attention runs variable-length sequences
    (flash-attn) and elsewhere leaves each step to pick between padded and shared (`Trainer.step`)."""
    attention = getattr(policy.config, "_attn_implementation", "")
    if packing == "shared" and attention == "flash_attention_2":
        raise ValueError(
            "learner.packing = shared needs attention that takes a mask; flash_attention_2 does "
            "not: use learner.attention = sdpa or learner.packing = packed"
        )
    if packing != "auto":
        return packing
    return "packed" if attention == "flash_attention_2" else "auto"


# The learner's logprob of a sampled token its own sampler would not keep (top-k / top-p): probability 0.
# Far below any behaviour logprob (validation's floor is about -116), so its ratio exp(this - behaviour)
# is exactly 0 in float32, and finite everywhere a loss or a metric uses it.
OUTSIDE_SUPPORT_LOGPROB = -1.0e4


@dataclass
class TokenSample:
    """One step's trained tokens as the learner saw them at step start: every token's lag (as
    counts per lag) and a bounded random subset of (behaviour, learner) logprob pairs (rank 0's figures)."""

    lag_counts: np.ndarray  # int64 [max lag + 1]: tokens per lag
    behavior: np.ndarray  # float32 [k]
    learner: np.ndarray  # float32 [k]


@dataclass(frozen=True)
class Sampler:
    """The actors' sampler, which the learner scores: softmax(logits / temperature), cut to the top_k most
    likely tokens (0: all) and then to the nucleus holding top_p of their mass (1.0: all), renormalised."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    sampler: Sampler,
    backend: str,
    served_dtype: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob, entropy) [tokens] of `targets` under `sampler` on the LM head `weight` [V, D] and `hidden`
    [tokens, D], outside any autocast of the body, so mixed precision never rounds a logprob. By default in
    the weights' own dtype (fp32 master weights: the fp32 head); with `served_dtype` (model.head = served)
    from the weights and hidden states rounded to the dtype the actors serve, their products summed in
    fp32: what an actor computes with its head in fp32. A truncating sampler's logprob is over the tokens
    it keeps from the learner's own logits, as the actor's is over those it kept from its logits; a target
    it would not keep gets OUTSIDE_SUPPORT_LOGPROB, and no gradient."""
    with torch.autocast(hidden.device.type, enabled=False):
        if served_dtype is not None:
            served = getattr(torch, served_dtype)
            hidden, weight = hidden.to(served).float(), weight.to(served).float()
        hidden = hidden.to(weight.dtype)
        if not sampler.truncates:
            return fused_logprobs(hidden, weight, targets, sampler.temperature, backend=backend)
        floor, inside = sampler_floor(
            hidden.detach(), weight.detach(), targets, sampler.temperature, sampler.top_k, sampler.top_p
        )
        logp, entropy = fused_logprobs(hidden, weight, targets, sampler.temperature, backend=backend, floor=floor)
        return torch.where(inside, logp, OUTSIDE_SUPPORT_LOGPROB), entropy


class LogprobHead(torch.nn.Module):
    """The LM head as a module of its own whose forward is `head_logprobs`: a sharded learner makes it
    an FSDP unit (its own precision), whose weight is gathered around exactly this forward. It holds
    the policy's head parameter itself, so its name (lm_head.weight) stays the model's."""

    def __init__(self, weight: torch.nn.Parameter, sampler: Sampler, backend: str, served_dtype: str | None):
        super().__init__()
        self.weight = weight
        self.sampler, self.backend, self.served_dtype = sampler, backend, served_dtype

    def forward(self, hidden, targets) -> tuple[torch.Tensor, torch.Tensor]:
        return head_logprobs(hidden, self.weight, targets, self.sampler, self.backend, self.served_dtype)


class PolicyLogprobs(torch.nn.Module):
    """The policy, with a forward that returns (logprob [tokens], entropy [tokens]) of completion tokens.

    Accelerate wraps this module (DDP on several ranks): the forward that builds the loss runs
    through the wrapper, so every parameter it touches, the LM head included, has its gradient synced.
    `head`: model.head (fp32 or served); `served_dtype`: model.dtype, what the actors serve. `temperature`:
    the sampler's, or the whole Sampler (top-k, top-p).
    """

    def __init__(
        self, policy, temperature: float | Sampler, backend: str, head: str = "fp32", served_dtype: str | None = None
    ):
        super().__init__()
        self.policy = policy
        self.sampler = temperature if isinstance(temperature, Sampler) else Sampler(float(temperature))
        self.backend = backend
        self.served_dtype = served_dtype if head == "served" else None

    def separate_head(self) -> LogprobHead | None:
        """Make an untied LM head a module of its own (the policy's lm_head); None where it is tied to
        the embedding, whose unit it then shares."""
        head = self.policy.lm_head
        if head.weight is self.policy.get_input_embeddings().weight:
            return None
        self.policy.lm_head = LogprobHead(head.weight, self.sampler, self.backend, self.served_dtype)
        return self.policy.lm_head

    def forward(
        self, input_ids, attention_mask, predict_at, targets, position_ids=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # packed rows come without an attention mask: the position ids restarting at 0 separate them
        hidden = self.policy.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # [B, L, D]; a cache would hide packing
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, predict_at)  # [tokens, D]
        if isinstance(self.policy.lm_head, LogprobHead):
            return self.policy.lm_head(hidden, targets)
        return head_logprobs(hidden, self.policy.lm_head.weight, targets, self.sampler, self.backend, self.served_dtype)


def effective_lr(cfg: LearnerConfig) -> float:
    """optim.lr, times sqrt(B / B_ref) under lr_scaling=sqrt, with B = learner.groups_per_step."""
    optim = cfg.optim
    if optim.lr_scaling is LrScaling.sqrt:
        return optim.lr * math.sqrt(cfg.groups_per_step / optim.ref_groups_per_step)
    return optim.lr


def lr_factor(cfg: LearnerConfig, step: int) -> float:
    """The multiple of the peak lr at optimizer step `step` (0-based): a linear warmup over
    optim.warmup_steps, then constant or decaying to optim.min_lr_ratio at learner.max_steps."""
    optim = cfg.optim
    warmup = max(optim.warmup_steps, 0)
    if step < warmup:
        return (step + 1) / warmup
    if optim.schedule is LrSchedule.constant:
        return 1.0
    done = min(1.0, (step - warmup) / max(cfg.max_steps - warmup, 1))  # 0 at the peak, 1 at the last step
    decay = 0.5 * (1.0 + math.cos(math.pi * done)) if optim.schedule is LrSchedule.cosine else 1.0 - done
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * decay


def allocate_state(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state made now, as its first step makes it (AdamW: zero moments, step 0), so its
    memory is taken while the learner starts rather than at the first step, when engines sharing the
    GPU (actor.colocate) would have taken theirs: a step with zero gradients and a zero learning rate
    moves no weight, and its step count is set back to 0."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
    optimizer.zero_grad(set_to_none=True)


class Trainer:
    def __init__(
        self,
        cfg: LearnerConfig,
        model,
        accelerator,
        temperature: float | Sampler,
        head: str = "fp32",
        served_dtype: str | None = None,
        model_path: str | None = None,
    ):
        """`temperature`: the actors' sampler (a Sampler), or its temperature alone (no top-k / top-p).
        `model_path`: where an empty (meta-device) `model`'s weights are, each rank loading its shard.
        Under learner.lora the model is frozen and given its adapter here, before it is sharded."""
        self.cfg = cfg
        self.accelerator = accelerator
        self.lora = cfg.lora if cfg.lora.enabled else None
        if self.lora is not None:  # the base stays in the dtype it was loaded in (policy_dtype), an fp32 head fp32
            lora.attach(model, self.lora, cfg.param_dtype, "float32" if head == "fp32" else None)
        module = PolicyLogprobs(model, temperature, cfg.kernel_backend, head, served_dtype)
        self.sharded = cfg.fsdp.enabled
        if self.sharded:
            module = sharding.shard(
                module,
                decoder_layers(model),
                module.separate_head(),
                cfg.fsdp,
                accelerator.device,
                cfg.mixed_precision,
                head_dtype=sharding.head_dtype(head),
            )
            if model_path is not None:
                sharding.load_pretrained(
                    module, model_path, accelerator.device, offload=sharding.offloaded(cfg.fsdp, accelerator.device)
                )
        if self.lora is not None:
            lora.initialize(module, cfg.seed)
        trained = [p for p in module.parameters() if p.requires_grad]  # under learner.lora the adapter alone
        optim = torch.optim.AdamW(
            trained,
            lr=effective_lr(cfg),
            betas=tuple(cfg.optim.betas),
            eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay,
        )
        allocate_state(optim)
        # Not passed to accelerator.prepare: Accelerate's scheduler wrapper advances once per rank
        # per step, which would make the schedule depend on the number of ranks.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: lr_factor(cfg, s))
        # A sharded module is not given to Accelerate (on CPU it would wrap it in DDP): FSDP's mixed
        # precision casts its parameters per unit (no autocast, whose cache would keep a half-precision copy
        # of every gathered layer), and FSDP reduces its gradients itself.
        self.model, self.optimizer = (module, optim) if self.sharded else accelerator.prepare(module, optim)
        self.num_updates = cfg.loss.epochs_per_step * cfg.loss.minibatches_per_step
        self.layout = micro_batch_layout(cfg.packing, model)
        self.step_layout = "padded" if self.layout == "auto" else self.layout  # this step's micro-batch layout
        self.last_tokens: TokenSample | None = None  # the latest step's lags and logprob pairs, for the figures

    def export_state(self, dtype: str) -> dict[str, torch.Tensor]:
        """The policy's whole state dict in `dtype`, in host memory, on the main rank ({} on the others);
        under learner.lora the adapter merged into the base (the model's own names), and the adapter alone
        beside it under PEFT's names (base_model.model.…). Sharded, it is gathered one tensor at a time:
        every rank must call this at the same point."""
        # a LoRA run merges in fp32 what it gathers in the tensors' own dtypes, and rounds only the sum
        _, tensors = self._tensors(None if self.lora is not None else dtype)
        if not self.accelerator.is_main_process:
            for _ in tensors:  # the gathers are collectives
                pass
            return {}

        def on_host(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", getattr(torch, dtype))

        if self.lora is None:
            return {name: on_host(t) for name, t in tensors}
        return lora.merged_and_adapter(tensors, self.lora.scaling, on_host)

    def weights(self, dtype: str | None):
        """(entries [(name, dtype, shape)], (name, tensor) pairs): the tensors a weight push copies, on the
        main rank; sharded, each is gathered in `dtype` as it is asked for, and every rank must iterate
        them at the same point. The policy's tensors, a tied one under each of its names (a worker
        reloading its layers one by one needs the LM head's own); under learner.lora the adapter's alone,
        under PEFT's names."""
        if self.lora is None:
            return self._tensors(dtype)
        entries, tensors = self._tensors(dtype, lora.is_adapter)
        return (
            [(lora.peft_name(name), d, shape) for name, d, shape in entries],
            ((lora.peft_name(name), t) for name, t in tensors),
        )

    def _tensors(self, dtype: str | None, select=None):
        """`weights`' (entries, pairs) of the policy's tensors under the module's names (those `select`
        keeps, by name; None: all)."""
        if self.sharded:
            return sharding.gathered_weights(self.model, dtype, select)
        state = self.policy.state_dict() if self.accelerator.is_main_process else {}
        state = {k: v for k, v in state.items() if select is None or select(k)}
        return [(name, t.dtype, tuple(t.shape)) for name, t in state.items()], iter(state.items())

    def save_state(self, directory) -> dict:
        """Collective: the policy and AdamW's state written into `directory`, every rank its own part
        (state_files.save); returns the rest, as JSON values, for the main rank to keep."""
        rest = state_files.save(self.accelerator.unwrap_model(self.model), self._optimizer, directory)
        return rest | {"scheduler": self.scheduler.state_dict()}

    def load_state(self, directory, rest: dict) -> None:
        """Collective: what `save_state` wrote (`rest` as it returned it), every rank reading its part."""
        state_files.load(self.accelerator.unwrap_model(self.model), self._optimizer, directory, rest)
        self.scheduler.load_state_dict(rest["scheduler"])

    @property
    def _optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate wraps it on one rank or DDP

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.policy.parameters())

    @property
    def policy(self):
        return self.accelerator.unwrap_model(self.model).policy

    def step(
        self,
        groups: list[RolloutGroup],
        token_masks: list[list[np.ndarray]],
        version: int,
        *,
        local_batch: bool = False,
    ) -> dict[str, float]:
        """One step (epochs x mini-batches optimizer updates); the metrics describe the batch as seen at
        step start (version `version`). Every rank passes the same step batch and trains on its share;
        with local_batch=True each rank passes its own groups instead."""
        start = time.perf_counter()
        minibatches = self._build_minibatches(groups, token_masks, local_batch)
        if self.layout == "auto":  # whichever layout computes fewer positions for this step's rows
            self.step_layout = min(
                ("padded", "shared"),
                key=lambda layout: sum(
                    computed_positions(rows, self.cfg.micro_batch_tokens, layout) for rows in minibatches
                ),
            )
        self.model.train()
        stats = _StepStats(version, self.cfg.loss)
        for rows in minibatches:
            stats.add_rows(rows)
        if self.num_updates > 1:  # later updates run on moved weights: take the step-start view first
            self._step_start_pass(minibatches, stats)
        lr = self.scheduler.get_last_lr()[0]
        grad_norms = [self._update(rows, stats) for _ in range(self.cfg.loss.epochs_per_step) for rows in minibatches]
        self.scheduler.step()
        elapsed = time.perf_counter() - start
        summary = stats.summary(self._all_sum, self._all_max, self.num_updates)
        self.last_tokens = stats.token_sample()
        return summary | {
            "learner/grad_norm": float(np.mean(grad_norms)),
            "optim/lr": float(lr),
            "learner/num_updates": float(self.num_updates),
            "timing/train_step_s": elapsed,
            "learner/tokens_per_s": summary["learner/computed_tokens"] / elapsed,
            "learner/shared_prompt_layout": float(self.step_layout == "shared"),
        }

    def _build_minibatches(self, groups, token_masks, local_batch: bool) -> list[list[Row]]:
        """This rank's rows of each mini-batch, with advantages over the step batch and aggregation
        weights over each mini-batch, both counted over every rank."""
        world, rank = (1, 0) if local_batch else (self.accelerator.num_processes, self.accelerator.process_index)
        plan = assign_groups(groups, self.cfg.loss.minibatches_per_step, world, rank)
        # Every rank must take part in every update (DDP syncs each one): all ranks check, then all raise.
        fewest = self._all_reduce([min(len(part) for part in plan)], "MIN")[0]
        if fewest < 1:
            raise ValueError(
                f"a rank has no group in some mini-batch: {len(groups)} groups on rank "
                f"{self.accelerator.process_index} for learner.loss.minibatches_per_step="
                f"{len(plan)} x {self.accelerator.num_processes} rank(s); raise learner.groups_per_step"
            )
        mine = sorted(i for part in plan for i in part)
        advantages = dict(
            zip(mine, group_advantages([groups[i] for i in mine], self.cfg.advantage_norm, self._all_sum))
        )
        out = []
        for part in plan:
            masks = [token_masks[i] for i in part]
            weights = aggregation_weights(masks, self.cfg.loss.aggregation, self._all_sum)
            out.append(build_rows([groups[i] for i in part], masks, [advantages[i] for i in part], weights))
        return out

    @torch.no_grad()
    def _step_start_pass(self, minibatches: list[list[Row]], stats: _StepStats) -> None:
        """Logprobs of the step-start (proximal) policy for every row, and the step-start metrics."""
        # Unsharded, the unwrapped module runs no collectives, so ranks may run different numbers of
        # micro-batches; sharded, every forward gathers parameters, so they are evened out.
        module = self.accelerator.unwrap_model(self.model)
        # the same compute dtype as the updates' forward passes: the unsharded module's Accelerate autocast
        # (its forward is wrapped; unwrapped, it is asked for), the sharded one's FSDP mixed precision
        with contextlib.nullcontext() if self.sharded else self.accelerator.autocast():
            for rows_mb, real in self._even([mb for rows in minibatches for mb in self._micro_batches(rows)]):
                mb = collate(rows_mb, self.step_layout).to(self.accelerator.device)
                logp, entropy = module(mb.input_ids, mb.attention_mask, mb.predict_at, mb.targets, mb.position_ids)
                if not real:
                    continue
                stats.add_step_start(mb, logp, entropy)
                stats.num_forward_only_tokens += mb.input_ids.numel()
                per_row = logp.float().cpu().numpy()
                index = mb.sample_index.cpu().numpy()
                for i, row in enumerate(rows_mb):
                    row.prox_logprobs = per_row[index == i]

    def _update(self, rows: list[Row], stats: _StepStats) -> float:
        """Forward and backward over the micro-batches of one mini-batch, then one optimizer update."""
        batches = self._even(self._micro_batches(rows))
        for i, (rows_mb, real) in enumerate(batches):
            mb = collate(rows_mb, self.step_layout).to(self.accelerator.device)
            # DDP all-reduces once, on the last micro-batch; the others accumulate gradients locally.
            # FSDP reduce-scatters every micro-batch into the gradient shards.
            sync = self.sharded or i == len(batches) - 1
            with contextlib.nullcontext() if sync else self.accelerator.no_sync(self.model):
                logp, entropy = self.model(mb.input_ids, mb.attention_mask, mb.predict_at, mb.targets, mb.position_ids)
                loss, extra = policy_loss(self._loss_inputs(mb, logp), self.cfg.loss)
                # The weights already average over every rank's tokens; the mean over ranks of DDP and
                # FSDP would divide the summed gradient again, so scale it back up.
                self.accelerator.backward(loss * (self.accelerator.num_processes if real else 0.0))
            if not real:
                continue
            if self.num_updates == 1:
                stats.add_step_start(mb, logp.detach(), entropy.detach())
            stats.add_update(mb, float(loss.detach()), extra["clipped"])
        return self._optimizer_step()

    def _micro_batches(self, rows: list[Row]) -> list[list[Row]]:
        return micro_batches(rows, self.cfg.micro_batch_tokens, self.step_layout)

    def _even(self, batches: list[list[Row]]) -> list[tuple[list[Row], bool]]:
        """(micro-batch, real) pairs. Sharded, every forward and backward is a collective, so a rank
        with fewer micro-batches than another repeats its last one, weightless, until they match."""
        extra = int(self._all_max([len(batches)])[0]) - len(batches) if self.sharded else 0
        return [(b, True) for b in batches] + [(batches[-1], False)] * extra

    def _loss_inputs(self, mb: MicroBatch, logp: torch.Tensor) -> LossInputs:
        prox = mb.prox_logprobs
        if prox is None and self.cfg.loss.type is LossType.ppo:
            prox = logp.detach()  # a single update starts from the step-start weights: these are the proximal logprobs
        return LossInputs(
            logp,
            mb.behavior_logprobs,
            mb.advantages,
            mb.weights.float(),
            prox_logprobs=prox,
            sample_index=mb.sample_index,
            token_mask=mb.token_mask,
        )

    def _optimizer_step(self) -> float:
        max_norm = self.cfg.optim.max_grad_norm
        if self.sharded:
            grad_norm = sharding.clip_grad_norm(self.model.parameters(), max_norm)
        elif max_norm > 0:
            grad_norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm))
        else:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            grad_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        if not math.isfinite(grad_norm):
            raise FloatingPointError(f"gradient norm is {grad_norm}: refusing to step (check learner.optim.lr)")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _all_sum(self, values) -> np.ndarray:
        return self._all_reduce(values, "SUM")

    def _all_max(self, values) -> np.ndarray:
        return self._all_reduce(values, "MAX")

    def _all_reduce(self, values, op: str) -> np.ndarray:
        """float64 vector reduced over every rank (a copy on one rank)."""
        values = np.asarray(values, dtype=np.float64)
        if self.accelerator.num_processes == 1:
            return values.copy()
        tensor = torch.from_numpy(values.copy()).to(self.accelerator.device)
        torch.distributed.all_reduce(tensor, op=getattr(torch.distributed.ReduceOp, op))
        return tensor.cpu().numpy()


class _StepStats:
    """Per-rank sums of the step's off-policy statistics (docs/metrics.md), reduced over all ranks
    into metrics at the end."""

    SUMS = (
        "tokens",
        "rho",
        "rho_sq",
        "kl",
        "entropy",
        "lag",
        "clipped",
        "clip_tokens",
        "loss",
        "computed",
        "real",
        "fresh",
        "samples",
        "adv",
        "adv_sq",
        "outside",
        "token_masked",
        "sequence_masked_tokens",
        "sequences",
        "sequences_masked",
        "seq_ratio",
        "fresh_log_rho",
    )
    # minima are kept as maxima of their negatives
    MAXES = ("rho_max", "lag_max", "fresh_max", "neg_rho_min", "seq_ratio_max", "neg_seq_ratio_min")

    PAIRS_PER_MICRO_BATCH = 64  # (behaviour, learner) logprob pairs kept for the run's figures

    def __init__(self, version: int, loss: LossConfig):
        self.version, self.loss = version, loss
        self.sums = dict.fromkeys(self.SUMS, 0.0)
        self.maxes = dict.fromkeys(self.MAXES, -math.inf)
        self.num_forward_only_tokens = 0
        self.lag_counts = np.zeros(1, dtype=np.int64)
        self.pairs: list[np.ndarray] = []  # float32 [2, k]: behaviour, learner
        self.rng = np.random.default_rng(version)

    def add_step_start(self, mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor) -> None:
        """Token statistics under the step-start weights (unmasked tokens only)."""
        keep = mb.token_mask
        log_rho = (logp - mb.behavior_logprobs).double()[keep]
        rho = log_rho.exp()
        lag = (self.version - mb.versions)[keep].double()
        s = self.sums
        s["tokens"] += rho.numel()
        s["rho"] += float(rho.sum())
        s["rho_sq"] += float(rho.square().sum())
        # k3 estimator of KL(behavior || learner) under behavior samples: E[rho - 1 - log rho]
        # (over the tokens the learner's sampler keeps: one it would not has an infinite term)
        inside = (logp > OUTSIDE_SUPPORT_LOGPROB)[keep]
        s["kl"] += float((rho - 1 - log_rho)[inside].sum())
        s["entropy"] += float(entropy.double()[keep].sum())
        s["lag"] += float(lag.sum())
        # Tokens of samples produced entirely at the current version: learner and actor ran the
        # same weights over the whole sequence, so their logprobs must agree (a token the learner's
        # sampler would not keep is counted as outside the support instead).
        fresh_samples = _fresh_samples(mb, self.version) & (logp > OUTSIDE_SUPPORT_LOGPROB)
        s["fresh_log_rho"] += float((logp - mb.behavior_logprobs).double()[fresh_samples].sum())
        fresh = (logp - mb.behavior_logprobs).abs()[fresh_samples]
        s["fresh"] += fresh.numel()
        for key, values in (("rho_max", rho), ("lag_max", lag), ("fresh_max", fresh), ("neg_rho_min", -rho)):
            if values.numel():
                self.maxes[key] = max(self.maxes[key], float(values.max()))
        self._add_levels(mb, logp)
        self._sample_tokens(lag, mb.behavior_logprobs[keep], logp[keep])

    def _add_levels(self, mb: MicroBatch, logp: torch.Tensor) -> None:
        """The masks' verdicts and each sample's geometric-mean ratio, as the loss forms them."""
        keep, s = mb.token_mask, self.sums
        ratios = ratios_of(logp, mb.behavior_logprobs, mb.sample_index, keep, self.loss)
        s["outside"] += int((logp <= OUTSIDE_SUPPORT_LOGPROB)[keep].sum())
        s["token_masked"] += int((~ratios.token_kept)[keep].sum())
        s["sequence_masked_tokens"] += int((~ratios.sequence_kept)[keep].sum())
        num_rows = int(mb.sample_index.max()) + 1 if mb.sample_index.numel() else 0
        trained = torch.zeros(num_rows, dtype=torch.bool, device=keep.device).index_put_(
            (mb.sample_index[keep],), torch.ones_like(keep[keep])
        )  # [rows] with a trained token
        per_row = torch.zeros(num_rows, dtype=torch.float64, device=keep.device)
        per_row[mb.sample_index[keep]] = ratios.log_geometric[keep].double()  # every token of a row holds the same
        masked = torch.zeros(num_rows, dtype=torch.bool, device=keep.device)
        masked[mb.sample_index[keep]] = ~ratios.sequence_kept[keep]
        geometric = per_row[trained].exp()
        s["sequences"] += int(trained.sum())
        s["sequences_masked"] += int(masked[trained].sum())
        s["seq_ratio"] += float(geometric.sum())
        if geometric.numel():
            self.maxes["seq_ratio_max"] = max(self.maxes["seq_ratio_max"], float(geometric.max()))
            self.maxes["neg_seq_ratio_min"] = max(self.maxes["neg_seq_ratio_min"], float(-geometric.min()))

    def _sample_tokens(self, lag: torch.Tensor, behavior: torch.Tensor, learner: torch.Tensor) -> None:
        """This rank's share for the figures: every token's lag, and a few logprob pairs."""
        counts = np.bincount(lag.long().cpu().numpy(), minlength=self.lag_counts.size)
        counts[: self.lag_counts.size] += self.lag_counts
        self.lag_counts = counts
        pick = self.rng.permutation(lag.numel())[: self.PAIRS_PER_MICRO_BATCH]
        both = torch.stack([behavior.float(), learner.float()])[:, torch.from_numpy(pick).to(lag.device)]
        self.pairs.append(both.cpu().numpy())

    def token_sample(self) -> TokenSample:
        pairs = np.concatenate(self.pairs, axis=1) if self.pairs else np.zeros((2, 0), dtype=np.float32)
        return TokenSample(self.lag_counts, pairs[0], pairs[1])

    def add_rows(self, rows: list[Row]) -> None:
        advantages = np.array([r.advantage for r in rows])
        self.sums["samples"] += advantages.size
        self.sums["adv"] += float(advantages.sum())
        self.sums["adv_sq"] += float(np.square(advantages).sum())

    def add_update(self, mb: MicroBatch, loss: float, clipped: torch.Tensor) -> None:
        keep = mb.token_mask
        self.sums["clipped"] += float(clipped[keep].sum())
        self.sums["clip_tokens"] += int(keep.sum())
        self.sums["loss"] += loss
        self.sums["computed"] += mb.input_ids.numel()
        self.sums["real"] += mb.num_real_tokens

    def summary(self, all_sum, all_max, num_updates: int) -> dict[str, float]:
        s = dict(zip(self.SUMS, all_sum([self.sums[k] for k in self.SUMS])))
        m = dict(zip(self.MAXES, all_max([self.maxes[k] for k in self.MAXES])))
        n = max(s["tokens"], 1.0)
        adv_mean = s["adv"] / max(s["samples"], 1.0)
        out = {
            "learner/loss": s["loss"] / num_updates,  # each update's loss is a weighted mean: average them
            "learner/entropy": s["entropy"] / n,
            "learner/num_tokens": s["tokens"],
            "learner/num_samples": s["samples"],
            "learner/computed_tokens": s["computed"],
            "learner/forward_only_tokens": float(all_sum([self.num_forward_only_tokens])[0]),
            "learner/packing_efficiency": s["real"] / max(s["computed"], 1.0),
            "learner/advantage_std": math.sqrt(max(s["adv_sq"] / max(s["samples"], 1.0) - adv_mean**2, 0.0)),
            "offpolicy/rho_mean": s["rho"] / n,
            "offpolicy/rho_max": m["rho_max"] if s["tokens"] else 0.0,
            "offpolicy/rho_min": -m["neg_rho_min"] if s["tokens"] else 0.0,
            "offpolicy/outside_support_frac": s["outside"] / n,
            "offpolicy/token_masked_frac": s["token_masked"] / n,
            "offpolicy/sequence_masked_token_frac": s["sequence_masked_tokens"] / n,
            "offpolicy/sequence_masked_frac": s["sequences_masked"] / max(s["sequences"], 1.0),
            "offpolicy/seq_ratio_mean": s["seq_ratio"] / max(s["sequences"], 1.0),
            "offpolicy/seq_ratio_min": -m["neg_seq_ratio_min"] if s["sequences"] else 0.0,
            "offpolicy/seq_ratio_max": m["seq_ratio_max"] if s["sequences"] else 0.0,
            "offpolicy/clipped_frac": s["clipped"] / max(s["clip_tokens"], 1.0),
            "offpolicy/ess": s["rho"] ** 2 / (n * s["rho_sq"]) if s["rho_sq"] else 0.0,
            "offpolicy/mismatch_kl": s["kl"] / n,
            "offpolicy/lag_mean": s["lag"] / n,
            "offpolicy/lag_max": m["lag_max"] if s["tokens"] else 0.0,
        }
        if s["fresh"]:
            out["offpolicy/fresh_logprob_max_abs_diff"] = max(m["fresh_max"], 0.0)
            out["offpolicy/fresh_tokens"] = s["fresh"]
            # the geometric-mean ratio over lag-0 tokens: 1 where learner and actor score alike
            out["offpolicy/fresh_ratio"] = math.exp(min(max(s["fresh_log_rho"] / s["fresh"], -50.0), 50.0))
        return {k: float(v) for k, v in out.items()}


def _fresh_samples(mb: MicroBatch, version: int) -> torch.Tensor:
    """bool [tokens]: unmasked tokens of samples whose every token was produced at `version`."""
    num_rows = int(mb.sample_index.max()) + 1 if mb.sample_index.numel() else 0  # a micro-batch may hold no token
    stale = torch.zeros(num_rows, dtype=torch.bool, device=mb.versions.device)
    stale.index_put_((mb.sample_index,), mb.versions != version, accumulate=True)
    return ~stale[mb.sample_index] & mb.token_mask
