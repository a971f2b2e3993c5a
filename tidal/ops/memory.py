"""Each GPU's and each host's memory for a run, from the model's config.json alone (built on the
meta device: exact parameter counts, no weights), so a layout that cannot fit is refused before
anything starts: `tidal config check` prints the plan, `tidal run` checks it on its own GPUs.

    config.json ──► ModelShape ─┐
    RunConfig ──────────────────┼──► plan() ──► Plan: one Budget per device kind, each a list of Terms
    Cluster (GPU, host sizes) ──┘
        learner GPU                  parameters, gradients, AdamW state (learner.lora: a frozen base, and
                                     the adapter's), gathered units, activations, logprob kernel, nccl
                                     send buffers, CUDA context, fragmentation
        actor GPU, vLLM's share      weights, one max_model_len sequence's KV cache, activations, LoRA slot
        actor GPU, outside the share CUDA context and NCCL, nccl receive buffers
        learner host, node 0         weight payloads kept, the file channel's copy and files,
                                     offloaded state, a checkpoint being written, processes
        actor host                   weights staged in /dev/shm (tcp), processes
    Plan.check() ──► ConfigError naming the budget, its total, its largest term and the keys that change it

Every estimate errs on the large side: terms that peak at different moments of a step are added.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.broker.weights import TAG_SCRATCH_BYTES
from tidal.config import ConfigError, KernelBackend, ModelConfig, RunConfig, TaskConfig, compute_dtype

GiB = 1024**3
MiB = 1024**2


def itemsize(dtype: str) -> int:
    """The bytes of one element of a dtype named in the config (float32, bfloat16, ...), as torch has it."""
    import torch  # only when a plan is made: the launcher imports this module and needs torch for nothing else

    return getattr(torch, str(dtype)).itemsize


CUDA_CONTEXT_BYTES = 2 * GiB  # one process's CUDA context, cuBLAS workspaces and NCCL's own buffers
FRAGMENTATION = 0.10  # the caching allocator's slack over what the learner's tensors take
HOST_PROCESS_BYTES = 4 * GiB  # resident memory of one process with torch and CUDA loaded
CUDA_GRAPH_BYTES = 1 * GiB  # vLLM's captured CUDA graphs (actor.enforce_eager false)
ENGINE_BATCHED_TOKENS = 8192  # vLLM's max_num_batched_tokens where engine_kwargs leaves it unset
CHECKPOINT_FILE_FACTOR = 1.05  # a safetensors checkpoint's size over its tensors' bytes
STATE_KEYS = ("learner.num_ranks", "learner.fsdp.enabled", "learner.fsdp.cpu_offload")


# ---- the model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a model: exact parameter counts and the widths activations scale with."""

    name: str
    num_params: int  # every parameter once (a tied LM head counted with the embedding)
    num_layers: int  # decoder layers
    layer_params: int  # the largest decoder layer's parameters
    embed_params: int  # the input embedding
    head_params: int  # the LM head's own parameters; 0 when it is tied to the embedding
    largest_tensor_params: int  # the largest single tensor (an embedding, or one MoE layer's fused experts)
    active_params: int  # parameters a token passes through: all but the experts it is not routed to
    hidden_size: int  # the residual stream's width
    mlp_width: int  # the MLP width a token passes through (an MoE: its routed experts' together)
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (the KV cache's)
    head_dim: int  # width of one head
    vocab_size: int  # rows of the LM head
    max_position_embeddings: int  # the context vLLM serves when actor.vllm.max_model_len is 0
    num_experts: int = 0  # routed experts per MoE layer; 0 for a dense model
    experts_per_token: int = 0  # experts each token is routed to
    qk_norm: bool = False  # RMSNorms on q and k (Qwen3)
    # (decoder layer index, path inside it, in features, out features) of every linear layer of the decoder
    # layers: what a LoRA adapter can target, and its size
    linears: tuple[tuple[int, str, int, int], ...] = ()

    @property
    def layer_linears(self) -> list[str]:
        """The paths of the linear layers inside the decoder layers (self_attn.q_proj, ...), each once."""
        return list(dict.fromkeys(path for _, path, _, _ in self.linears))

    @property
    def tied(self) -> bool:
        return self.head_params == 0

    @property
    def payload_params(self) -> int:
        """Parameters a weight version carries: a tied LM head travels under both of its names."""
        return self.num_params + (self.embed_params if self.tied else 0)

    @classmethod
    def from_config(cls, source: str | Path | dict) -> ModelShape:
        """Count a model's parameters from its config.json (a file, its folder, or the parsed dict) by
        building it on the meta device: no memory, no weights, no download."""
        import json

        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        if isinstance(source, dict):
            raw, name, where = dict(source), str(source.get("_name_or_path", "model")), "the model config"
        else:
            path = Path(source).expanduser()
            path = path / "config.json" if path.is_dir() else path
            raw, name, where = json.loads(path.read_text()), path.parent.name, str(path)
        model_type = raw.pop("model_type", "")
        try:
            config = AutoConfig.for_model(model_type, **raw)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except (ValueError, KeyError) as err:  # no model_type, or one transformers cannot build
            raise ConfigError(
                f"{where}: model_type {model_type!r} is not a causal LM transformers can build ({type(err).__name__})"
            ) from None
        return cls._counted(name, model, config.get_text_config())

    @classmethod
    def _counted(cls, name: str, model, text) -> ModelShape:
        """The shape of a model built on the meta device, `text` its (text) config."""
        params = dict(model.named_parameters())  # a tied tensor once
        layers = decoder_layers(model)
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        experts = getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0) or 0
        per_token = getattr(text, "num_experts_per_tok", 0) or 0
        routed = sum(p.numel() for n, p in params.items() if ".experts." in n)
        idle = routed - routed * per_token // experts if experts else 0
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        return cls(
            name=name,
            num_params=sum(p.numel() for p in params.values()),
            num_layers=len(layers),
            layer_params=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
            embed_params=embed.numel(),
            head_params=0 if head is embed else head.numel(),
            largest_tensor_params=max(p.numel() for p in params.values()),
            active_params=sum(p.numel() for p in params.values()) - idle,
            hidden_size=text.hidden_size,
            mlp_width=mlp_width(layers, text.hidden_size, per_token, experts),
            num_heads=num_heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=text.vocab_size,
            max_position_embeddings=text.max_position_embeddings,
            num_experts=experts,
            experts_per_token=per_token,
            qk_norm=any("q_norm" in n for n, _ in layers[0].named_parameters()),
            linears=linear_layers(layers),
        )


def decoder_layers(model):
    """The model's decoder layers: its longest ModuleList named `layers`."""
    import torch

    found = [m for n, m in model.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no `layers` list of decoder layers to size")
    return max(found, key=len)


def linear_layers(layers) -> tuple[tuple[int, str, int, int], ...]:
    """(layer index, path inside the layer, in features, out features) of each decoder layer's nn.Linear."""
    import torch

    return tuple(
        (i, name, m.in_features, m.out_features)
        for i, layer in enumerate(layers)
        for name, m in layer.named_modules()
        if isinstance(m, torch.nn.Linear)
    )


def mlp_width(layers, hidden_size: int, experts_per_token: int, num_experts: int) -> int:
    """The widest MLP a token passes through, from the parameter count of each layer's gated MLP
    (gate, up and down: 3 x hidden x width), a routed expert's counted for the experts a token uses."""
    widest = 0
    for layer in layers:
        count = 0.0
        for name, p in layer.named_parameters():
            if "attn" in name or p.dim() < 2:
                continue
            share = experts_per_token / num_experts if ".experts." in f".{name}" and num_experts else 1.0
            count += p.numel() * share
        widest = max(widest, round(count / (3 * hidden_size)))
    return widest


# ---- the machines and the plan ---------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """The machines a plan is for, every node alike."""

    gpu_bytes: int  # one GPU's memory
    gpus_per_node: int = 8  # GPUs a node: whether the actors share node 0 with the learner, their host share
    host_bytes: int = 2048 * GiB  # one node's host memory


@dataclass(frozen=True)
class Term:
    """One thing that takes memory, with the config keys that change it."""

    name: str  # what it is, as the plan and its errors print it
    nbytes: int  # its size on one device of its budget
    keys: tuple[str, ...] = ()  # the config keys that change it, the most useful first
    shm: bool = False  # lives in /dev/shm (counts against a pod's memory-backed /dev/shm volume too)


@dataclass(frozen=True)
class Budget:
    """One device kind's memory: what is in it, against what it holds."""

    device: str  # the device kind: learner GPU, actor GPU, vLLM's share, ...
    terms: tuple[Term, ...]  # what it holds at its peak
    capacity_bytes: int  # what it can hold
    keys: tuple[str, ...] = ()  # the config keys that change its capacity

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.terms)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes

    @property
    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.nbytes)


@dataclass(frozen=True)
class Plan:
    """Every budget of a run on a cluster; `settings` holds the value of every key a term names."""

    model: ModelShape
    cluster: Cluster
    budgets: tuple[Budget, ...]
    settings: dict[str, Any] = field(default_factory=dict)

    def budget(self, device: str) -> Budget:
        return next(b for b in self.budgets if b.device == device)

    def check(self) -> None:
        """Raise ConfigError for the first budget over its capacity, naming its largest term and
        the keys (with their values) that change it."""
        over = [b for b in self.budgets if not b.fits]
        if not over:
            return
        worst, term = over[0], over[0].largest
        keys = tuple(dict.fromkeys((*term.keys, *worst.keys)))
        changes = ", ".join(f"{k} = {_shown(self.settings.get(k))}" for k in keys) or "no key (a fixed allowance)"
        also = f"; also over: {', '.join(b.device for b in over[1:])}" if len(over) > 1 else ""
        raise ConfigError(
            f"memory plan: {self.model.name} does not fit the {worst.device}: {gib(worst.total_bytes)} of "
            f"{gib(worst.capacity_bytes)}; its largest term, {term.name} at {gib(term.nbytes)}, changes with "
            f"{changes}{also}"
        )

    def table(self) -> str:
        """The plan as text: each budget's total against its capacity, then its terms, largest first."""
        c = self.cluster
        lines = [
            f"memory plan: {self.model.name} ({self.model.num_params / 1e9:.2f} B parameters) on "
            f"{gib(c.gpu_bytes)} GPUs, {c.gpus_per_node} a node, {gib(c.host_bytes)} of host memory a node"
        ]
        for b in self.budgets:
            verdict = "fits" if b.fits else "DOES NOT FIT"
            lines.append(f"  {b.device:<36} {gib(b.total_bytes):>11} of {gib(b.capacity_bytes):>11}  {verdict}")
            for t in sorted(b.terms, key=lambda t: -t.nbytes):
                lines.append(f"    {t.name:<62} {gib(t.nbytes):>11}  {', '.join(t.keys)}".rstrip())
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The plan as plain data (bytes), for bench/memory_plans.py and tools."""
        return {
            "model": self.model.name,
            "num_params": self.model.num_params,
            "gpu_bytes": self.cluster.gpu_bytes,
            "gpus_per_node": self.cluster.gpus_per_node,
            "host_bytes": self.cluster.host_bytes,
            "budgets": [
                {
                    "device": b.device,
                    "total_bytes": b.total_bytes,
                    "capacity_bytes": b.capacity_bytes,
                    "fits": b.fits,
                    "terms": {t.name: t.nbytes for t in b.terms},
                }
                for b in self.budgets
            ],
        }


def gib(nbytes: float) -> str:
    """Bytes as the plan prints them."""
    return f"{nbytes / GiB:.1f} GiB"


def setting(cfg: RunConfig, key: str) -> Any:
    """The value of a dotted config key (a missing engine_kwargs entry is None)."""
    value: Any = cfg
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
    return value


# ---- the learner's GPU ------------------------------------------------------------------------------


def shard_count(cfg: RunConfig) -> int:
    """Over how many ranks parameters, gradients and AdamW state are split: every rank (FSDP), one
    node's ranks (HSDP: sharded within a node, replicated across nodes), or none (one copy a rank)."""
    lc = cfg.learner
    if not lc.fsdp.enabled:
        return 1
    per_node = lc.num_ranks // lc.nodes
    hsdp = lc.fsdp.replicate_over_nodes and lc.nodes > 1 and per_node > 1
    return per_node if hsdp else lc.num_ranks


def adapter_params(cfg: RunConfig, shape: ModelShape) -> int:
    """A LoRA adapter's parameters (learner.lora): r x (in + out) of each targeted linear layer; 0 without."""
    lora = cfg.learner.lora
    return lora.num_params(list(shape.linears)) if lora.enabled else 0


def trained_params(cfg: RunConfig, shape: ModelShape) -> int:
    """The parameters AdamW updates: a LoRA adapter's, else every one."""
    return adapter_params(cfg, shape) if cfg.learner.lora.enabled else shape.num_params


def frozen_base_bytes(cfg: RunConfig, shape: ModelShape) -> int:
    """Under learner.lora, the frozen base on one rank: in the compute dtype, but the LM head (the embedding,
    tied) in fp32 under model.head = fp32; no gradients, no AdamW state. 0 without an adapter."""
    if not cfg.learner.lora.enabled:
        return 0
    head = (shape.head_params or shape.embed_params) if cfg.model.head == "fp32" else 0
    return ((shape.num_params - head) * itemsize(compute_dtype(cfg.learner)) + head * 4) // shard_count(cfg)


LORA_KEYS = ("learner.lora.rank", "learner.lora.target_modules", "learner.lora.layers")


def state_terms(cfg: RunConfig, shape: ModelShape) -> list[Term]:
    """Master parameters, gradients and AdamW's two moments, each in learner.param_dtype, split over
    the ranks that shard them: of every parameter, or under learner.lora of the adapter's, beside the
    frozen base."""
    lc, n = cfg.learner, shard_count(cfg)
    each = trained_params(cfg, shape) * itemsize(lc.param_dtype) // n
    part = f", 1/{n} a rank" if n > 1 else ""
    keys = (*STATE_KEYS, "learner.param_dtype")
    if not lc.lora.enabled:
        return [
            Term(f"parameters ({lc.param_dtype}{part})", each, keys),
            Term(f"gradients ({lc.param_dtype}{part})", each, keys),
            Term(f"AdamW state (2 x {lc.param_dtype}{part})", 2 * each, keys),
        ]
    adapter = f"{adapter_params(cfg, shape):,} adapter parameters, {lc.param_dtype}{part}"
    return [
        Term(
            f"frozen base ({compute_dtype(lc)}, no gradients or AdamW state{part})",
            frozen_base_bytes(cfg, shape),
            (*STATE_KEYS, "learner.mixed_precision", "model.head"),
        ),
        Term(f"LoRA parameters ({adapter})", each, LORA_KEYS + keys),
        Term(f"LoRA gradients ({adapter})", each, LORA_KEYS + keys),
        Term(f"LoRA AdamW state (2 x {adapter})", 2 * each, LORA_KEYS + keys),
    ]


def state_bytes(cfg: RunConfig, shape: ModelShape) -> int:
    """One rank's parameters, gradients and AdamW's two moments (learner.param_dtype), sharded or whole
    (under learner.lora: the adapter's, and the frozen base)."""
    trained = 4 * trained_params(cfg, shape) * itemsize(cfg.learner.param_dtype) // shard_count(cfg)
    return trained + frozen_base_bytes(cfg, shape)


def adamw_bytes(cfg: RunConfig, shape: ModelShape) -> int:
    """One rank's AdamW moments (2 x learner.param_dtype of what it trains)."""
    return 2 * trained_params(cfg, shape) * itemsize(cfg.learner.param_dtype) // shard_count(cfg)


def gathered_terms(cfg: RunConfig, shape: ModelShape) -> list[Term]:
    """FSDP2 gathers each unit unsharded in the compute dtype just before it runs: the current decoder
    layer and the prefetched next (every layer, from forward to backward, without
    reshard_after_forward) with their unsharded gradients; the LM head, its own unit, in fp32 for
    model.head fp32; the embedding in the root unit, kept gathered through the step."""
    fsdp, item = cfg.learner.fsdp, itemsize(compute_dtype(cfg.learner))
    held = 2 if fsdp.reshard_after_forward else shape.num_layers
    head_item = 4 if cfg.model.head == "fp32" else item
    head = shape.head_params or shape.embed_params
    keys = ("learner.mixed_precision", "learner.fsdp.reshard_after_forward")
    if cfg.learner.lora.enabled:  # a frozen base gathers no gradients (the adapter's are counted with its state)
        terms = [
            Term(f"gathered decoder layers ({held})", held * shape.layer_params * item, keys),
            Term("gathered LM head", head * head_item, ("model.head",)),
        ]
    else:
        terms = [
            Term(f"gathered decoder layers ({held} + gradients of 2)", (held + 2) * shape.layer_params * item, keys),
            Term("gathered LM head, with its gradient", 2 * head * head_item, ("model.head",)),
        ]
    if not shape.tied:
        terms.append(Term("gathered embedding", shape.embed_params * item, ("learner.mixed_precision",)))
    return terms


def unsharded_terms(cfg: RunConfig, shape: ModelShape) -> list[Term]:
    """Without FSDP: autocast keeps a compute-dtype copy of every weight it used until the backward has
    run (the LM head stays in its own dtype), and DDP a gradient bucket copy on several ranks."""
    lc, terms = cfg.learner, []
    compute = compute_dtype(lc)
    if compute != lc.param_dtype:  # under learner.lora, of the adapter alone: the base is held in `compute`
        copies = (trained_params(cfg, shape) - (0 if lc.lora.enabled else shape.head_params)) * itemsize(compute)
        terms.append(Term(f"autocast weight copies ({compute})", copies, ("learner.mixed_precision",)))
    if lc.num_ranks > 1:
        terms.append(
            Term(
                "DDP gradient buckets", trained_params(cfg, shape) * itemsize(lc.param_dtype), ("learner.fsdp.enabled",)
            )
        )
    return terms


def layer_activation_bytes(shape: ModelShape, itemsize: int) -> int:
    """Bytes one decoder layer keeps for its backward pass, per token, without checkpointing.

    In the compute dtype: the layer's input and both norms' outputs (3 x hidden); q, k, v, the
    rotated q and k and the attention output ((3 heads + 3 kv heads) x head_dim: flash and SDPA
    attention keep no tokens x tokens scores); the MLP's gate, up, activated gate and their product
    (4 x the width a token passes through), and for an MoE each token's copies to and from its
    experts (2 x experts_per_token x hidden). In fp32: each RMSNorm's input and normalized output
    (2 norms x 2 x hidden, and q/k norms where the model has them) and the router's logits. An upper
    estimate: the backward frees some of these early, but all are alive when it reaches the layer."""
    s = shape
    attention = (3 * s.num_heads + 3 * s.num_kv_heads) * s.head_dim
    routing = 2 * s.experts_per_token * s.hidden_size
    compute = 3 * s.hidden_size + attention + 4 * s.mlp_width + routing
    fp32 = 4 * s.hidden_size + (2 * (s.num_heads + s.num_kv_heads) * s.head_dim if s.qk_norm else 0) + s.num_experts
    return compute * itemsize + fp32 * 4


def activation_terms(cfg: RunConfig, shape: ModelShape) -> list[Term]:
    """One micro-batch's activations: every layer's, or with activation checkpointing (FSDP only) each
    layer's input plus one layer's whole set while it is recomputed; and the logprob kernel's working
    set as the kernels state it (tidal.kernels.working_set_bytes: tiles of logits, the fp32 gradients it
    accumulates; with a trained half-precision LM head, Triton's fp32 [V, D] accumulator)."""
    from tidal.kernels import auto_backend, working_set_bytes  # torch with them: only when a plan is made

    lc, tokens = cfg.learner, cfg.learner.micro_batch_tokens
    item = itemsize(compute_dtype(cfg.learner))
    one_layer = tokens * layer_activation_bytes(shape, item)
    if lc.fsdp.enabled and lc.fsdp.activation_checkpointing:
        keys = ("learner.micro_batch_tokens",)
        terms = [
            Term(
                f"layer inputs kept ({shape.num_layers} layers, checkpointing)",
                shape.num_layers * tokens * shape.hidden_size * item,
                keys,
            ),
            Term("one layer's activations, recomputed", one_layer, keys),
        ]
    else:
        keys = (
            "learner.micro_batch_tokens",
            "learner.fsdp.activation_checkpointing" if lc.fsdp.enabled else "learner.fsdp.enabled",
        )
        terms = [Term(f"activations ({shape.num_layers} layers, no checkpointing)", shape.num_layers * one_layer, keys)]
    backend = lc.kernel_backend if lc.kernel_backend != KernelBackend.auto else auto_backend(True, item < 4)
    held = working_set_bytes(
        backend, tokens, shape.hidden_size, shape.vocab_size, item, weight_grad=not lc.lora.enabled
    )
    terms.append(
        Term(
            f"logprob kernel ({backend} backend's working set)",
            held,
            ("learner.micro_batch_tokens", "learner.kernel_backend"),
        )
    )
    return terms


def _shown(value) -> str:
    """A setting as a user writes it: a choice by its word (not its enum's repr), anything else as repr."""
    import enum

    return value.value if isinstance(value, enum.Enum) else repr(value)


def transfer_buffer_bytes(cfg: RunConfig, shape: ModelShape) -> int:
    """One side's packed nccl chunks in flight: 2 streams, each a bucket plus the largest tensor
    (a tensor is never split across buckets)."""
    largest = shape.largest_tensor_params * itemsize(cfg.model.dtype)
    return 2 * (cfg.weights.bucket_mib * MiB + largest)


def learner_gpu_terms(cfg: RunConfig, shape: ModelShape) -> list[Term]:
    """Every term of one learner GPU (rank 0's, the fullest) before fragmentation and the CUDA context."""
    offloaded = cfg.learner.fsdp.enabled and cfg.learner.fsdp.cpu_offload
    terms = [] if offloaded else state_terms(cfg, shape)
    terms += gathered_terms(cfg, shape) if cfg.learner.fsdp.enabled else unsharded_terms(cfg, shape)
    terms += activation_terms(cfg, shape)
    if cfg.weights.transport == "nccl":  # each send slot's two chunk buffers, made once
        sends = cfg.weights.max_sends
        terms.append(
            Term(
                f"nccl send buffers ({sends} sends x 2 chunks)",
                sends * transfer_buffer_bytes(cfg, shape),
                ("weights.bucket_mib", "weights.max_sends", "weights.transport"),
            )
        )
        # a version's tags are computed beside the tensors as they are packed, each cast to the wire's dtype first
        largest = shape.largest_tensor_params * itemsize(cfg.model.dtype)
        terms.append(
            Term(
                "nccl tensor tags (the largest tensor cast, and scratch)",
                largest + TAG_SCRATCH_BYTES,
                ("weights.transport",),
            )
        )
    return terms


def learner_gpu_budget(cfg: RunConfig, shape: ModelShape, cluster: Cluster) -> Budget:
    """The learner's terms, the allocator's fragmentation over them, the CUDA context, and with
    actor.colocate the share the engines on the same GPU take."""
    terms = learner_gpu_terms(cfg, shape)
    slack = int(FRAGMENTATION * sum(t.nbytes for t in terms))
    terms.append(Term(f"allocator fragmentation ({FRAGMENTATION:.0%})", slack))
    terms.append(Term("CUDA context and NCCL", CUDA_CONTEXT_BYTES))
    if cfg.actor.colocate:
        engines = colocated_engines(cfg)
        share = int(engines * cfg.actor.vllm.gpu_memory_utilization * cluster.gpu_bytes)
        terms += [
            Term(
                f"vLLM's share of {engines} colocated engine(s)",
                share,
                ("actor.vllm.gpu_memory_utilization", "actor.replicas"),
            ),
            Term("colocated engines' CUDA contexts", engines * CUDA_CONTEXT_BYTES, ("actor.replicas",)),
        ]
    return Budget("learner GPU", tuple(terms), cluster.gpu_bytes)


def colocated_engines(cfg: RunConfig) -> int:
    """Engines (one per actor GPU) that share one learner GPU with actor.colocate (round-robin)."""
    per_actor, learner_gpus = actor_gpus(cfg), cfg.learner.num_ranks // cfg.learner.nodes
    return math.ceil(cfg.actor.replicas * per_actor / max(learner_gpus, per_actor))


# ---- the actors' GPUs -------------------------------------------------------------------------------


def actor_gpus(cfg: RunConfig) -> int:
    """GPUs of one actor: actor.gpus_per_replica, its engine's tensor-parallel size where that is -1."""
    ac = cfg.actor
    return ac.vllm.tensor_parallel_size if ac.gpus_per_replica < 0 else ac.gpus_per_replica


def kv_bytes_per_token(cfg: RunConfig, shape: ModelShape) -> int:
    """One token's KV cache on one tensor-parallel rank: keys and values of every layer (kv heads
    split over the ranks, repeated where there are fewer than ranks)."""
    vc = cfg.actor.vllm
    item = 1 if str(vc.engine_kwargs.get("kv_cache_dtype", "auto")).startswith("fp8") else itemsize(cfg.model.dtype)
    heads = math.ceil(shape.num_kv_heads / vc.tensor_parallel_size)
    return 2 * shape.num_layers * heads * shape.head_dim * item


def engine_terms(cfg: RunConfig, shape: ModelShape) -> list[Term]:
    """What vLLM's share must hold on each GPU of an engine beyond the rest of its KV cache: the weights,
    one max_model_len sequence's KV cache (the engine refuses to start without it), one forward over
    max_num_batched_tokens (hidden states, q/k/v and the MLP width; nothing kept between layers), the
    sampler's fp32 logits (and logprobs) over actor.max_inflight sequences, and CUDA graphs."""
    ac, vc, item = cfg.actor, cfg.actor.vllm, itemsize(cfg.model.dtype)
    tp, s = vc.tensor_parallel_size, shape
    max_len = vc.max_model_len or s.max_position_embeddings
    tokens = vc.engine_kwargs.get("max_num_batched_tokens") or ENGINE_BATCHED_TOKENS
    width = 4 * s.hidden_size + ((s.num_heads + 2 * s.num_kv_heads) * s.head_dim + 2 * s.mlp_width) // tp
    part = f", 1/{tp} a GPU" if tp > 1 else ""
    terms = [
        Term(
            f"weights ({cfg.model.dtype}{part})",
            s.num_params * item // tp,
            ("actor.vllm.tensor_parallel_size", "model.dtype"),
        ),
        Term(
            f"KV cache of one {max_len}-token sequence",
            max_len * kv_bytes_per_token(cfg, shape),
            ("actor.vllm.max_model_len", "actor.vllm.tensor_parallel_size"),
        ),
        Term(
            f"activations ({tokens} batched tokens)",
            tokens * width * item,
            ("actor.vllm.engine_kwargs.max_num_batched_tokens",),
        ),
        Term(
            f"sampler logits ({ac.max_inflight} sequences, fp32)",
            ac.max_inflight * s.vocab_size * 4 * 2,
            ("actor.max_inflight",),
        ),
    ]
    if not ac.enforce_eager:
        terms.append(Term("CUDA graphs", CUDA_GRAPH_BYTES, ("actor.enforce_eager",)))
    if cfg.learner.lora.enabled:
        terms.append(lora_slot_term(cfg, shape))
    return terms


def lora_slot_term(cfg: RunConfig, shape: ModelShape) -> Term:
    """vLLM's one LoRA slot: A and B buffers of its max_lora_rank (the smallest size vLLM offers that holds
    learner.lora.rank) on every decoder linear layer it can adapt, targeted or not, in model.dtype."""
    from dataclasses import replace

    rank = cfg.learner.lora.served_rank
    every = replace(cfg.learner.lora, rank=rank, target_modules=tuple(shape.layer_linears), layers=())
    tp = cfg.actor.vllm.tensor_parallel_size
    return Term(
        f"LoRA slot (max_lora_rank {rank}, every linear layer)",
        every.num_params(list(shape.linears)) * itemsize(cfg.model.dtype) // tp,
        ("learner.lora.rank", "model.dtype"),
    )


def actor_gpu_budgets(cfg: RunConfig, shape: ModelShape, cluster: Cluster) -> list[Budget]:
    """vLLM's share (gpu_memory_utilization of the GPU) and, unless colocated, the rest of the GPU:
    the engine's CUDA context and NCCL, and the nccl channel's receive buffers."""
    util = cfg.actor.vllm.gpu_memory_utilization
    keys = ("actor.vllm.gpu_memory_utilization",)
    share = Budget("actor GPU, vLLM's share", tuple(engine_terms(cfg, shape)), int(util * cluster.gpu_bytes), keys)
    if cfg.actor.colocate:
        return [share]
    outside = [Term("CUDA context and NCCL", CUDA_CONTEXT_BYTES, keys)]
    if cfg.weights.transport == "nccl":
        outside.append(
            Term(
                "nccl receive buffers (2 streams)",
                transfer_buffer_bytes(cfg, shape),
                (*keys, "weights.bucket_mib", "weights.transport"),
            )
        )
        outside.append(
            Term("nccl tensor tags' scratch (2 streams)", 2 * TAG_SCRATCH_BYTES, (*keys, "weights.transport"))
        )
    return [
        share,
        Budget("actor GPU, outside vLLM's share", tuple(outside), cluster.gpu_bytes - share.capacity_bytes, keys),
    ]


def kv_cache_tokens(plan_: Plan, cfg: RunConfig) -> int:
    """Tokens of KV cache an engine has room for: its share less the weights and the activations."""
    share = plan_.budget("actor GPU, vLLM's share")
    room = share.capacity_bytes - sum(t.nbytes for t in share.terms if not t.name.startswith("KV cache"))
    return max(room, 0) // kv_bytes_per_token(cfg, plan_.model)


# ---- host memory ------------------------------------------------------------------------------------


def payload_bytes(cfg: RunConfig, shape: ModelShape) -> int:
    """One weight version as it travels: every tensor (a tied head under both names) in model.dtype;
    under learner.lora the adapter's alone."""
    params = adapter_params(cfg, shape) if cfg.learner.lora.enabled else shape.payload_params
    return params * itemsize(cfg.model.dtype)


def in_shm(directory: str) -> bool:
    """Whether weights.dir is memory: /dev/shm, the default."""
    return not directory or directory.startswith("/dev/shm")


def learner_host_terms(cfg: RunConfig, shape: ModelShape) -> list[Term]:
    """Host memory of the learner on node 0 (a pod's, on Kubernetes): the packed payloads of the newest
    max(weights.keep, 2) versions and of those retired while still being sent; for the file channel
    its serialized copy and the files it keeps in /dev/shm; with cpu_offload the node's shards of
    parameters, gradients and AdamW state; a checkpoint being written (each rank writes its own part,
    rank 0 alone when nothing is sharded: its AdamW state, the larger of its two files, staged in host
    memory and serialized, 2 copies); and one process a rank."""
    lc, w, payload = cfg.learner, cfg.weights, payload_bytes(cfg, shape)
    keep = max(w.keep, 2)
    # a version no longer served lives on while it is being sent: on the collective channels each of
    # weights.max_sends transfers holds one for its whole length, on tcp a bucket's send holds it briefly
    sending = w.max_sends if w.transport in ("nccl", "gloo") else 1 if w.transport == "tcp" else 0
    terms = [
        Term(f"weight payloads kept ({keep} x {cfg.model.dtype})", keep * payload, ("weights.keep", "model.dtype"))
    ]
    if sending:
        terms.append(
            Term(
                f"weight payloads retired while still sent ({sending})",
                sending * payload,
                ("weights.max_sends", "weights.transport"),
            )
        )
    if w.transport == "file":
        terms.append(Term("file channel's serialized copy", payload, ("weights.transport",)))
        if in_shm(w.dir):
            terms.append(
                Term(f"weight files in /dev/shm ({keep})", keep * payload, ("weights.dir", "weights.keep"), shm=True)
            )
    ranks = lc.num_ranks // lc.nodes
    if lc.fsdp.enabled and lc.fsdp.cpu_offload:
        terms.append(
            Term(f"offloaded parameters, gradients, AdamW ({ranks} ranks)", ranks * state_bytes(cfg, shape), STATE_KEYS)
        )
    writers = ranks if shard_count(cfg) > 1 else 1
    terms.append(
        Term(
            "checkpoint being written (AdamW state, staged and serialized)",
            writers * 2 * adamw_bytes(cfg, shape),
            ("learner.fsdp.enabled", "learner.num_ranks"),
        )
    )
    terms.append(Term(f"learner processes ({ranks})", ranks * HOST_PROCESS_BYTES, ("learner.num_ranks",)))
    return terms


def actor_host_terms(cfg: RunConfig, shape: ModelShape) -> list[Term]:
    """Host memory of one actor (a pod's): a whole version staged in /dev/shm for the tcp and file
    channels (the file channel checks a copy of its own, so a rewrite after the check loads nothing),
    and the actor's process, vLLM's engine core and its workers."""
    terms = []
    if cfg.weights.transport in ("tcp", "file"):
        terms.append(
            Term(
                f"weights staged in /dev/shm ({cfg.weights.transport})",
                payload_bytes(cfg, shape),
                ("weights.transport",),
                shm=True,
            )
        )
    processes = 1 + cfg.actor.vllm.tensor_parallel_size
    terms.append(
        Term(f"actor processes ({processes})", processes * HOST_PROCESS_BYTES, ("actor.vllm.tensor_parallel_size",))
    )
    return terms


def hf_cache_bytes(shape: ModelShape) -> int:
    """Disk a pod's Hugging Face cache needs for the checkpoint: bf16 safetensors and their index."""
    return int(shape.num_params * 2 * CHECKPOINT_FILE_FACTOR)


def one_machine(cfg: RunConfig, cluster: Cluster) -> bool:
    """Whether the actors run on the learner's node 0: a one-node learner, with room for every actor's GPUs."""
    lc = cfg.learner
    used = lc.num_ranks + (0 if cfg.actor.colocate else cfg.actor.replicas * actor_gpus(cfg))
    return lc.nodes == 1 and used <= cluster.gpus_per_node


def host_budgets(cfg: RunConfig, shape: ModelShape, cluster: Cluster) -> list[Budget]:
    """Node 0 holds the learner's host memory, and the actors' where they share the machine; an actor
    on nodes of its own gets the part of a node its GPUs are of the node's."""
    learner, actor = learner_host_terms(cfg, shape), actor_host_terms(cfg, shape)
    if one_machine(cfg, cluster):
        each = sum(t.nbytes for t in actor)
        learner.append(
            Term(
                f"actors' host memory ({cfg.actor.replicas})",
                cfg.actor.replicas * each,
                ("actor.replicas", "weights.transport"),
            )
        )
        return [Budget("learner host, node 0", tuple(learner), cluster.host_bytes)]
    actor_share = cluster.host_bytes * max(actor_gpus(cfg), 1) // cluster.gpus_per_node
    return [
        Budget("learner host, node 0", tuple(learner), cluster.host_bytes),
        Budget("actor host", tuple(actor), actor_share),
    ]


def plan(cfg: RunConfig, shape: ModelShape, cluster: Cluster) -> Plan:
    """Every budget of `cfg` for `shape` on `cluster`: GPUs where the learner (learner.gpus) and the
    actors (actor.gpus_per_replica) have them, host memory always."""
    budgets = []
    if cfg.learner.gpus != 0:
        budgets.append(learner_gpu_budget(cfg, shape, cluster))
    if actor_gpus(cfg) != 0:
        budgets += actor_gpu_budgets(cfg, shape, cluster)
    budgets += host_budgets(cfg, shape, cluster)
    keys = {k for b in budgets for k in b.keys} | {k for b in budgets for t in b.terms for k in t.keys}
    return Plan(shape, cluster, tuple(budgets), {k: setting(cfg, k) for k in sorted(keys)})


# ---- where the plan runs: `tidal config check`, `tidal run` -------------------------------------------


def find_model_config(model: ModelConfig, task: TaskConfig) -> Path | None:
    """The model's config.json where it is already on this machine (a folder, the Hugging Face cache,
    the built tiny model), None where it is not: nothing is downloaded."""
    from tidal.models import HUB_ID

    if model.path and not Path(model.path).expanduser().exists() and HUB_ID.match(model.path):
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model.path, "config.json", revision=model.revision or None)
        return Path(found) if isinstance(found, str) else None
    if model.path:
        path = Path(model.path).expanduser() / "config.json"
    else:
        from tidal.tiny import cached_model_path

        path = cached_model_path(model, task) / "config.json"
    return path if path.is_file() else None


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def visible_gpu_bytes() -> int | None:
    """The memory of the first GPU this process sees, None without one."""
    from tidal.ops.placement import visible_gpus

    if not visible_gpus():
        return None
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def check_lines(
    cfg: RunConfig,
    gpu_gib: float | None = None,
    gpus_per_node: int | None = None,
    host_gib: float | None = None,
    model_config: str | None = None,
) -> list[str]:
    """`tidal config check`'s plan: printed when a GPU size is known (--gpu-gib, else the visible GPUs')
    and the model's config.json is here (--model-config, else model.path); one line saying why not
    otherwise. Raises ConfigError when the plan does not fit."""
    gpu_bytes = int(gpu_gib * GiB) if gpu_gib else visible_gpu_bytes()
    if gpu_bytes is None:
        return ["memory plan: skipped, no GPU is visible (give --gpu-gib to plan for one)"]
    source = Path(model_config) if model_config else find_model_config(cfg.model, cfg.task)
    if source is None:
        return [
            f"memory plan: skipped, model.path = {cfg.model.path or '(the tiny model)'!r} has no config.json on "
            "this machine and nothing is downloaded (give --model-config PATH)"
        ]
    if gpus_per_node is None:
        from tidal.ops.placement import visible_gpus

        gpus_per_node = len(visible_gpus()) or 8
    host = int(host_gib * GiB) if host_gib else host_memory_bytes()
    result = plan(cfg, ModelShape.from_config(source), Cluster(gpu_bytes, gpus_per_node, host))
    result.check()
    return result.table().splitlines()


def check_gpus(cfg: RunConfig, gpus: list[str]) -> Plan | None:
    """`tidal run`'s memory check on this machine's GPUs, before anything starts: raises
    PlacementError (one line) when the plan does not fit; None without GPUs or a local config.json."""
    from tidal.ops.placement import PlacementError

    source = find_model_config(cfg.model, cfg.task) if gpus else None
    if source is None:
        return None
    import torch

    cluster = Cluster(torch.cuda.get_device_properties(0).total_memory, len(gpus), host_memory_bytes())
    result = plan(cfg, ModelShape.from_config(source), cluster)
    try:
        result.check()
    except ConfigError as err:
        raise PlacementError(str(err)) from None
    return result
