"""learner.* and the sections that shape what it trains on: staleness.*, curriculum.*, eval.*
and checkpoint.*. The learner's closed sets (losses, aggregation, schedules, numerics) live here,
and compute_dtype, the dtype its forward and backward compute in."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tidal.config.base import Dtype, Section, _require, opt


class LossType(enum.Enum):
    cispo = "cispo"
    tis = "tis"
    ppo = "ppo"
    gspo = "gspo"


class RatioLevel(enum.Enum):
    token = "token"
    sequence = "sequence"


class RatioMode(enum.Enum):
    truncate = "truncate"
    mask = "mask"


class Aggregation(enum.Enum):
    prompt_mean = "prompt_mean"
    token_mean = "token_mean"
    sample_mean = "sample_mean"


class LrScaling(enum.Enum):
    none = "none"
    sqrt = "sqrt"


class LrSchedule(enum.Enum):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"


class AdvantageNorm(enum.Enum):
    batch = "batch"
    group = "group"
    none = "none"


class OnViolation(enum.Enum):
    drop_group = "drop_group"
    mask_tokens = "mask_tokens"
    keep = "keep"


# StrEnum: code outside the config reads it as its word (why: tidal/config/base.py)
class KernelBackend(enum.StrEnum):
    auto = "auto"
    torch = "torch"
    naive = "naive"
    triton = "triton"


class MixedPrecision(enum.StrEnum):
    no = "no"
    bf16 = "bf16"
    fp16 = "fp16"


class Attention(enum.StrEnum):
    auto = "auto"
    sdpa = "sdpa"
    flash_attention_2 = "flash_attention_2"


class Packing(enum.StrEnum):
    auto = "auto"
    packed = "packed"
    padded = "padded"
    shared = "shared"


@dataclass(frozen=True)
class StalenessConfig(Section):
    """Bound on how old (in optimizer steps) a trained token's policy may be."""

    max_lag: int = opt(8, "k; 0 = synchronous")
    on_violation: OnViolation = opt(
        OnViolation.drop_group,
        "tokens older than k: drop_group (the whole group) | mask_tokens (out of the loss) | keep (train anyway)",
    )

    def check(self) -> None:
        _require(self.max_lag >= 0, "staleness.max_lag", self.max_lag, "must be >= 0")


@dataclass(frozen=True)
class CurriculumConfig(Section):
    """No-positive-resampling: the coordinator stops dispatching prompts the policy solves."""

    enabled: bool = opt(True, "track each training prompt's pass rate and retire solved prompts")
    retire_pass_rate: float = opt(
        0.9, "retire a prompt once this fraction of its samples pass (reward >= task.pass_threshold)"
    )
    min_samples: int = opt(8, "a prompt is judged once this many of its samples arrived since its last judgement")

    def check(self) -> None:
        _require(
            0 < self.retire_pass_rate <= 1,
            "curriculum.retire_pass_rate",
            self.retire_pass_rate,
            "must be in (0, 1]; set curriculum.enabled=false to keep every prompt",
        )
        _require(self.min_samples >= 1, "curriculum.min_samples", self.min_samples, "must be >= 1")


@dataclass(frozen=True)
class LossConfig(Section):
    """The policy-gradient loss; each type reads only its own keys."""

    type: LossType = opt(LossType.cispo, "the loss; each reads only the keys below named after it")
    eps_max: float = opt(4.0, "cispo: cap on the token ratio rho = pi_theta / pi_behavior")
    tis_cap: float = opt(2.0, "tis: truncation c of the token ratio, clamp(rho, 0, c)")
    clip_eps: float = opt(0.2, "ppo: the ratio to the proximal policy is clipped to [1 - eps, 1 + eps]")
    prox_cap: float = opt(2.0, "ppo: cap c on the behavior correction pi_prox / pi_behavior")
    gspo_clip_low: float = opt(3e-4, "gspo: the sequence ratio is clipped below at 1 - this")
    gspo_clip_high: float = opt(4e-4, "gspo: the sequence ratio is clipped above at 1 + this")
    ratio_level: RatioLevel = opt(
        RatioLevel.token,
        "the behaviour ratio that weighs cispo's and tis' terms and ppo's "
        "behaviour weight: each token's own, or its sample's (the product "
        "of its token ratios); gspo forms its own",
    )
    ratio_mode: RatioMode = opt(
        RatioMode.truncate,
        "above its cap (eps_max, tis_cap, prox_cap) the ratio is cut to "
        "the cap (truncate: TIS) or its term dropped (mask: MIS)",
    )
    token_mask: tuple[float, float] = opt(
        (0.0, float("inf")),
        "IcePop: a token whose ratio pi_theta / pi_behaviour "
        "leaves [low, high] is left out of the loss; [0, inf]: "
        "none",
    )
    sequence_mask: tuple[float, float] = opt(
        (0.0, float("inf")),
        "a sample whose geometric-mean token ratio leaves [low, high] is left out of the loss; [0, inf]: none",
    )
    minibatches_per_step: int = opt(1, "the step batch is split into this many mini-batches, one optimizer update each")
    epochs_per_step: int = opt(1, "passes over those mini-batches (updates per step = epochs x mini-batches)")
    aggregation: Aggregation = opt(Aggregation.prompt_mean, "how token losses are averaged")

    def check(self) -> None:
        """Every type's keys, whichever learner.loss.type picks (the presets set them all)."""
        for key in ("eps_max", "tis_cap", "prox_cap", "gspo_clip_high"):
            _require(getattr(self, key) > 0, f"learner.loss.{key}", getattr(self, key), "must be > 0")
        for key in ("clip_eps", "gspo_clip_low"):
            _require(0 < getattr(self, key) < 1, f"learner.loss.{key}", getattr(self, key), "must be in (0, 1)")
        _require(self.epochs_per_step >= 1, "learner.loss.epochs_per_step", self.epochs_per_step, "must be >= 1")
        for key in ("token_mask", "sequence_mask"):
            low, high = getattr(self, key)
            _require(
                0 <= low < 1 < high,
                f"learner.loss.{key}",
                [low, high],
                "a band [low, high] around 1: 0 <= low < 1 < high ([0, .inf] masks nothing)",
            )
        _require(
            self.type is not LossType.gspo
            or (self.ratio_level, self.ratio_mode) == (RatioLevel.token, RatioMode.truncate),
            "learner.loss.ratio_level",
            self.ratio_level.value,
            "gspo forms its own sequence ratio and clips it: leave ratio_level = token and ratio_mode = truncate "
            "(token_mask and sequence_mask apply to it)",
        )


@dataclass(frozen=True)
class OptimConfig(Section):
    """AdamW and its learning-rate schedule."""

    lr: float = opt(1e-6, "AdamW learning rate (after warmup); for a pretrained model of 0.5B+ (presets set their own)")
    betas: tuple[float, float] = opt((0.9, 0.99), "AdamW betas")
    eps: float = opt(1e-8, "AdamW epsilon")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    warmup_steps: int = opt(0, "linear warmup steps")
    schedule: LrSchedule = opt(
        LrSchedule.constant,
        "after warmup: constant, or a cosine / linear decay that reaches lr * min_lr_ratio at learner.max_steps",
    )
    min_lr_ratio: float = opt(0.0, "the decayed schedules' floor, as a fraction of the peak lr")
    max_grad_norm: float = opt(1.0, "clip; 0 disables")
    lr_scaling: LrScaling = opt(
        LrScaling.none, "sqrt: lr = optim.lr * sqrt(learner.groups_per_step / ref_groups_per_step)"
    )
    ref_groups_per_step: int = opt(
        0, "B_ref, the groups per step at which optim.lr was tuned (lr_scaling=sqrt needs it)"
    )

    def check(self) -> None:
        _require(self.lr > 0, "learner.optim.lr", self.lr, "must be > 0")
        _require(
            0.0 <= self.min_lr_ratio <= 1.0,
            "learner.optim.min_lr_ratio",
            self.min_lr_ratio,
            "a fraction of the peak lr, in [0, 1]",
        )
        _require(
            self.lr_scaling is LrScaling.none or self.ref_groups_per_step >= 1,
            "learner.optim.ref_groups_per_step",
            self.ref_groups_per_step,
            "lr_scaling=sqrt needs the groups per step at which optim.lr was tuned (>= 1)",
        )


@dataclass(frozen=True)
class FsdpConfig(Section):
    """The policy sharded over the learner's ranks (torch FSDP2): parameters, gradients and AdamW state
    each live on one rank, so a model too large for one device trains on several."""

    enabled: bool = opt(False, "shard each decoder layer and the rest of the model; off = every rank holds it all")
    reshard_after_forward: bool = opt(
        True, "free gathered layers after forward (less memory, gathered again in backward)"
    )
    activation_checkpointing: bool = opt(False, "recompute each decoder layer's activations in the backward pass")
    cpu_offload: bool = opt(False, "keep sharded parameters, gradients and AdamW state in host memory (GPU only)")
    replicate_over_nodes: bool = opt(
        True,
        "with learner.nodes > 1: shard within each machine and replicate across "
        "machines (HSDP), so the layers' gathers stay on the machine's own links "
        "and only the gradients cross between machines",
    )


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank sizes vLLM runs
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
UNTARGETABLE = ("lm_head", "embed_tokens")  # the LM head and the embedding (Llama/Qwen names)


def served_lora_rank(rank: int) -> int:
    """The actors' max_lora_rank for an adapter of `rank`: the smallest size vLLM offers that holds it."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


@dataclass(frozen=True)
class LoraConfig(Section):
    """A LoRA adapter trained on the frozen policy (peft): each weight push carries the adapter alone,
    which the actors' engines serve over their base model (vLLM's LoRA)."""

    rank: int = opt(0, "the adapter's rank r; 0 = no adapter: every parameter is trained and pushed")
    alpha: float = opt(32.0, "the update is (alpha / rank) x B A")
    dropout: float = opt(0.0, "dropout on the adapter's input while training (the actors serve without it)")
    target_modules: tuple[str, ...] = opt(
        LORA_TARGETS, "the linear layers that get an adapter, by their name in the model (every layer of that name)"
    )
    layers: tuple[int, ...] = opt(
        (),
        "the decoder layers (by index) whose target modules get an adapter; the rest "
        "stay frozen as they are; empty = every layer",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def served_rank(self) -> int:
        """The actors' max_lora_rank for this adapter (served_lora_rank)."""
        return served_lora_rank(self.rank)

    def check(self) -> None:
        _require(self.rank >= 0, "learner.lora.rank", self.rank, "must be >= 0 (0 = no adapter)")
        if not self.enabled:
            return
        _require(
            self.rank <= VLLM_LORA_RANKS[-1],
            "learner.lora.rank",
            self.rank,
            f"vLLM serves adapters of rank {VLLM_LORA_RANKS[-1]} at most",
        )
        _require(self.alpha > 0, "learner.lora.alpha", self.alpha, "must be > 0")
        _require(0 <= self.dropout < 1, "learner.lora.dropout", self.dropout, "must be in [0, 1)")
        _require(
            bool(self.target_modules),
            "learner.lora.target_modules",
            self.target_modules,
            "name at least one linear layer (e.g. q_proj, v_proj)",
        )
        _require(all(i >= 0 for i in self.layers), "learner.lora.layers", self.layers, "layer indices are >= 0")
        _require(
            not self.untargetable(),
            "learner.lora.target_modules",
            self.target_modules,
            f"{', '.join(self.untargetable())}: the LM head and the embedding take no adapter (the learner's "
            "fused logprob head reads the head's weight as it is, and the actors serve adapters on the decoder "
            "layers' linear layers only)",
        )

    def untargetable(self) -> list[str]:
        """The target names that would reach the LM head or the embedding."""
        return [t for t in self.target_modules if t.rsplit(".", 1)[-1] in UNTARGETABLE]

    @property
    def scaling(self) -> float:
        """What B A is multiplied by: alpha / rank."""
        return self.alpha / self.rank

    def targets(self, path: str) -> bool:
        """Whether the linear layer at `path` (inside a decoder layer: self_attn.q_proj) gets an adapter, as
        peft matches it: its path is a target, or ends in `.<target>`."""
        return any(_names(path, t) for t in self.target_modules)

    def num_params(self, linears: list[tuple[int, str, int, int]]) -> int:
        """The adapter's parameters: r x (in + out) of each targeted linear layer. `linears`: (decoder layer
        index, path inside it, in features, out features) of the model's linear layers."""
        chosen = set(self.layers)
        return sum(
            self.rank * (n_in + n_out)
            for layer, path, n_in, n_out in linears
            if (not chosen or layer in chosen) and self.targets(path)
        )

    def check_model(self, layer_linears: list[str], num_layers: int) -> None:
        """The targets and layers against a model's: `layer_linears`, the paths of the linear layers inside
        its decoder layers (self_attn.q_proj, mlp.down_proj, ...), and its number of decoder layers.
        ConfigError naming the targets it lacks and the linear layers it has."""
        missing = [t for t in self.target_modules if not any(_names(n, t) for n in layer_linears)]
        has = ", ".join(dict.fromkeys(n.rsplit(".", 1)[-1] for n in layer_linears))
        _require(
            not missing,
            "learner.lora.target_modules",
            self.target_modules,
            f"the model's decoder layers have no linear layer {', '.join(missing)}; they have: {has}",
        )
        _require(
            all(i < num_layers for i in self.layers),
            "learner.lora.layers",
            self.layers,
            f"the model has {num_layers} decoder layers (indices 0 to {num_layers - 1})",
        )


def _names(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)


@dataclass(frozen=True)
class LearnerConfig(Section):
    """The training loop: step batches, loss, optimizer, weight publishing."""

    groups_per_step: int = opt(16, "prompt groups in one optimizer step")
    max_steps: int = opt(100, "optimizer steps of the run")
    num_ranks: int = opt(
        1,
        "learner processes in all; `tidal run` / `tidal learner` start them with torchrun (rank 0 talks to the actors)",
    )
    nodes: int = opt(1, "machines the ranks span, learner.num_ranks / nodes on each (one `tidal learner` per machine)")
    node_rank: int = opt(
        0, "this machine's place among learner.nodes (a StatefulSet pod's ordinal); node 0 holds rank 0"
    )
    master_addr: str = opt("", "node 0's address, where the ranks meet; empty = this machine (learner.nodes = 1)")
    master_port: int = opt(29500, "node 0's port for the ranks' rendezvous (tidal run picks a free one on one machine)")
    gpus: int = opt(
        -1,
        "GPUs of the learner, one per rank (`tidal run` sets CUDA_VISIBLE_DEVICES); -1 = "
        "learner.num_ranks where the machine has GPUs, none where it has not; 0 = none (train on CPU)",
    )
    micro_batch_tokens: int = opt(8192, "padded tokens (rows x longest row) of one forward/backward micro-batch")
    advantage_norm: AdvantageNorm = opt(AdvantageNorm.batch, "how group-centred advantages are scaled")
    zero_variance_filter: bool = opt(True, "drop groups whose rewards are all equal")
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    kernel_backend: KernelBackend = opt(KernelBackend.auto, "logprob kernel")
    param_dtype: Dtype = opt(
        Dtype.float32, "master weights and AdamW state; keep float32: in bfloat16 updates below its resolution vanish"
    )
    mixed_precision: MixedPrecision = opt(
        MixedPrecision.no,
        "forward/backward compute through Accelerate's autocast: no (in param_dtype), bf16 or fp16; the LM head stays "
        "fp32",
    )
    attention: Attention = opt(
        Attention.auto, "auto: flash_attention_2 on CUDA where flash-attn is installed, sdpa elsewhere"
    )
    packing: Packing = opt(
        Packing.auto,
        "micro-batches packed end to end without padding (variable-length attention), "
        "padded per micro-batch, or shared: a prompt group's prompt computed once "
        "with all its completions after it (not with flash-attn); auto: packed under "
        "flash_attention_2, otherwise padded or shared, whichever computes less each "
        "step",
    )
    torch_threads: int = opt(
        0,
        "intra-op threads of each learner rank; 0 = 1, or with fsdp.cpu_offload (AdamW, the "
        "gradient norm and the clip run on the host) the cores the rank owns: its CPU "
        "affinity shared among the node's ranks",
    )
    rollout_timeout_s: float = opt(600.0, "no rollout for this long means the actors are gone: the learner fails")
    refusal_patience_steps: int = opt(
        5,
        "the run stops when the learner refused most of the last this many steps' "
        "worth of rollout groups (a reward outside task.reward_range, ...); 0 = never",
    )
    dist_timeout_s: float = opt(
        7200.0,
        "the learner ranks' process group timeout: a rank waits this long in a "
        "collective while rank 0 is busy elsewhere (waiting for rollouts, the final "
        "evaluation, writing a checkpoint) before the group gives up",
    )
    health_file: str = opt("", "touched while the loop makes progress, for liveness probes; empty = off")
    seed: int = opt(0, "torch seed")

    def check(self) -> None:
        _require(self.groups_per_step >= 1, "learner.groups_per_step", self.groups_per_step, "must be >= 1")
        _require(self.max_steps >= 1, "learner.max_steps", self.max_steps, "must be >= 1")
        _require(
            self.refusal_patience_steps >= 0,
            "learner.refusal_patience_steps",
            self.refusal_patience_steps,
            "must be >= 0",
        )
        _require(self.num_ranks >= 1, "learner.num_ranks", self.num_ranks, "must be >= 1")
        _require(self.torch_threads >= 0, "learner.torch_threads", self.torch_threads, "must be >= 0 (0: chosen)")
        minibatches = self.loss.minibatches_per_step
        _require(
            self.groups_per_step >= self.num_ranks * minibatches,
            "learner.groups_per_step",
            self.groups_per_step,
            f"every rank needs a group in every mini-batch: at least learner.num_ranks ({self.num_ranks}) x "
            f"learner.loss.minibatches_per_step ({minibatches})",
        )
        _require(
            1 <= minibatches <= self.groups_per_step,
            "learner.loss.minibatches_per_step",
            minibatches,
            f"must be in [1, learner.groups_per_step = {self.groups_per_step}]",
        )
        _require(self.micro_batch_tokens >= 1, "learner.micro_batch_tokens", self.micro_batch_tokens, "must be >= 1")
        _require(
            self.gpus in (-1, 0, self.num_ranks),
            "learner.gpus",
            self.gpus,
            f"one GPU per rank: -1 (auto), 0 (CPU) or learner.num_ranks = {self.num_ranks}",
        )
        _require(
            self.dist_timeout_s >= self.rollout_timeout_s,
            "learner.dist_timeout_s",
            self.dist_timeout_s,
            f"must be >= learner.rollout_timeout_s = {self.rollout_timeout_s}: the other ranks wait in a "
            "collective while rank 0 waits for rollouts",
        )
        self.check_placement()
        self.check_numerics()
        self.loss.check()
        self.optim.check()
        self.lora.check()

    def check_placement(self) -> None:
        """The ranks over machines, and sharding over the ranks."""
        _require(
            self.nodes >= 1 and self.num_ranks % self.nodes == 0,
            "learner.nodes",
            self.nodes,
            f"must be >= 1 and divide learner.num_ranks = {self.num_ranks} (the same number of ranks on each machine)",
        )
        _require(
            0 <= self.node_rank < self.nodes,
            "learner.node_rank",
            self.node_rank,
            f"must be in [0, learner.nodes = {self.nodes})",
        )
        _require(
            self.nodes == 1 or self.master_addr,
            "learner.master_addr",
            self.master_addr,
            "the learner spans several machines (learner.nodes > 1): name node 0's address",
        )
        _require(
            not self.fsdp.enabled or self.num_ranks >= 2,
            "learner.fsdp.enabled",
            self.fsdp.enabled,
            "sharding needs learner.num_ranks >= 2 (one rank holds the whole model anyway)",
        )

    def check_numerics(self) -> None:
        """Precision, attention and the micro-batch layout that go together."""
        _require(
            not self.fsdp.enabled or self.mixed_precision != MixedPrecision.fp16,
            "learner.mixed_precision",
            self.mixed_precision,
            "a sharded learner (learner.fsdp.enabled) computes in bf16 or the parameters' dtype, not fp16",
        )
        flash = self.attention == Attention.flash_attention_2
        _require(
            not flash or compute_dtype(self) != Dtype.float32,
            "learner.attention",
            self.attention,
            "flash-attn computes in bf16 or fp16 only: set learner.mixed_precision=bf16 or learner.attention=sdpa",
        )
        # the same rule as the trainer's (learner/every_rank/trainer.py), which also sees attention=auto resolved to
        # flash-attn
        _require(
            not flash or self.packing != Packing.shared,
            "learner.packing",
            self.packing,
            "shared needs attention that takes a mask; flash_attention_2 does not: use learner.attention=sdpa "
            "or learner.packing=packed",
        )


@dataclass(frozen=True)
class EvalConfig(Section):
    """Evaluation on the held-out prompts."""

    every: int = opt(
        10,
        "optimizer steps between evaluations (0 = only at start and end); one due while another is "
        "under way runs on the version announced when that one ends",
    )
    n: int = opt(4, "samples per held-out prompt (mean@n pass rate)")
    temperature: float = opt(1.0, "eval sampling temperature")


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """The learner's checkpoints in run_dir, the state a run resumes from."""

    every: int = opt(0, "optimizer steps between checkpoints (0 = only at the end)")
    keep: int = opt(2, "checkpoints kept on disk")


def compute_dtype(cfg: LearnerConfig) -> str:
    """The dtype the learner's forward and backward compute in: learner.mixed_precision's, else the
    master weights'."""
    return {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.mixed_precision, cfg.param_dtype)
