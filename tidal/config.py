"""The one typed config tree of tidal: dataclasses, YAML presets in configs/, key=value overrides.

Each component is built from its own sub-config (`cfg.actor`, `cfg.learner`, ...), never the
whole tree. Unknown keys and wrong types fail at load time with one line naming the key.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A config that cannot run: the message names the key and the value."""


DTYPES = ("float32", "bfloat16", "float16")
HEADS = ("fp32", "served")


class LossType(enum.Enum):
    cispo = "cispo"
    tis = "tis"
    ppo = "ppo"
    gspo = "gspo"


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


class BrokerType(enum.Enum):
    zmq = "zmq"
    redis = "redis"


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start of the tiny model, so RL starts from a non-zero pass rate."""

    max_steps: int = 2000  # upper bound on SFT steps
    target_greedy_pass_rate: float = 0.9  # stop once greedy decoding solves this fraction of val prompts
    # ... at this many checks in a row: one pass can be a lucky jump (0.52 -> 0.93 in 25 steps) that
    # leaves the model short of what RL needs
    stable_checks: int = 1
    format_noise: float = 0.0  # fraction of SFT answers followed by stray characters before <eos>
    check_every: int = 25  # SFT steps between pass-rate checks
    batch_size: int = 256  # sequences per SFT step
    lr: float = 3e-3  # AdamW learning rate
    seed: int = 0  # init and data-order seed


@dataclass(frozen=True)
class TinyModelConfig:
    """A small Qwen2 built locally (no download) with a character-level tokenizer."""

    hidden_size: int = 128  # model width
    num_layers: int = 4  # decoder layers
    num_heads: int = 4  # attention heads (head_dim = hidden_size / num_heads; 32 or 64 on CPU)
    num_kv_heads: int = 2  # key/value heads (grouped-query attention)
    intermediate_size: int = 512  # MLP width
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights the actors serve and the learner trains."""

    # a Hugging Face model folder, or a Hub id (org/name) fetched into the Hugging Face cache (HF_HUB_OFFLINE=1:
    # the cache only); empty builds (or reuses) the tiny model
    path: str = ""
    revision: str = ""  # Hub ids: a branch, tag or commit; empty = main
    cache_dir: str = "~/.cache/tidal/models"  # where built tiny models are kept, keyed by config
    dtype: str = "float32"  # what the actors serve (and weights travel in): float32 | bfloat16 | float16
    # the LM head's numerics, alike on both sides: fp32 = the learner computes logits from its fp32 master
    # head weights; served = from the head weights in model.dtype, its hidden states rounded to model.dtype,
    # products summed in fp32, which is what the actors compute. Either way an actor serving bfloat16 or
    # float16 computes its head in fp32 (vLLM's head_dtype) instead of rounding its logits to model.dtype
    head: str = "fp32"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass(frozen=True)
class TaskConfig:
    """The task: prompts for the coordinator, the reward for the actors."""

    # built-in (arithmetic, math), installed (entry-point group tidal.tasks) or an import path (my_pkg.my_task)
    name: str = "arithmetic"
    kwargs: dict[str, Any] = field(default_factory=dict)  # options of the task itself, e.g. {tolerance: 0.01}
    max_operand: int = 99  # arithmetic: operands are drawn from 0..max_operand
    num_val: int = 256  # held-out prompts for evaluation (never trained on); math: at most this many
    seed: int = 0  # split seed
    # training prompts: a JSON Lines (.jsonl, .json) or Parquet file, a folder of them, or a Hub dataset id
    data_path: str = ""
    data_config: str = ""  # Hub datasets: the configuration (subset) name; empty = the default
    data_split: str = "train"  # folders and Hub datasets: the split of data_path to train on
    val_path: str = ""  # held-out prompts (num_val drawn by seed), read like data_path; empty = split off data_path
    val_split: str = "test"  # folders and Hub datasets: the split of val_path
    # the column holding each prompt: a string, or chat messages [{role, content}, ...] (TRL's conversational format)
    prompt_field: str = "problem"
    answer_field: str = "answer"  # the column holding the gold answer, e.g. "\\frac{1}{2}" or "12"
    # string prompts: the text; {<prompt_field>} is replaced by the prompt, {{ and }} are literal braces
    prompt_template: str = "{problem}\nPut the final answer in \\boxed{{}}."
    # apply the tokenizer's chat template (a string prompt becomes one user message; chat messages always get it)
    chat_template: bool = False
    system_prompt: str = ""  # with a chat template: a system message first, unless the prompt's messages have one
    reward_range: tuple[float, float] = (-10.0, 10.0)  # rollouts with a reward outside it are rejected, counted
    # a sample passes when its reward is at least this: pass rates (rollout/, eval/), the curriculum and the
    # scaling fits count passes by it, whatever the reward's scale (partial credit, summed components)
    pass_threshold: float = 1.0
    # reward functions, each an import path (my_pkg.rewards:accuracy or my_pkg.rewards.accuracy) or a name in the
    # entry-point group tidal.rewards, called with prompt, completion, completion_ids and every column of the row;
    # the sample's reward is their weighted sum (instead of the task's own reward)
    reward_funcs: list[str] = field(default_factory=list)
    reward_weights: list[float] = field(default_factory=list)  # one per reward function; empty = all 1.0
    # the reward function (by name) whose value says whether a sample passed, compared with pass_threshold: the
    # accuracy of accuracy + 0.2 x format, so a format bonus is no pass; empty = the weighted sum (the reward)
    pass_on: str = ""
    # a remote reward (an http:// or https:// URL in reward_funcs): each POST of a batch waits this long
    remote_timeout_s: float = 30.0
    remote_retries: int = 2  # more tries of a remote reward's failed POST (error status, timeout, refused)


@dataclass(frozen=True)
class InterruptConfig:
    """ScaleRL forced interruptions: a sample still going at its thinking budget (drawn uniformly per
    sample from [min_tokens, max_tokens]) gets `text` appended and `answer_tokens` more to answer."""

    enabled: bool = False  # interrupt training samples that reach their thinking budget
    min_tokens: int = 0  # smallest thinking budget (tokens); required (>= 1) when enabled
    max_tokens: int = 0  # largest thinking budget (tokens); required (>= min_tokens) when enabled
    text: str = "\n\nOkay, time is up. Let me give my final answer now.\n\n"  # injected; never trained on
    answer_tokens: int = 0  # budget after the interruption (tokens); required (>= 1) when enabled
    eval: bool = False  # interrupt eval groups too (pass rate under the same thinking budget)


@dataclass(frozen=True)
class OverlongConfig:
    """DAPO overlong penalty on training rewards, the alternative to interruptions: a completion of L
    tokens gets min(0, (sampling.max_tokens - buffer_tokens - L) / buffer_tokens) added to its reward."""

    enabled: bool = False  # shape the rewards of training samples (eval rewards never)
    buffer_tokens: int = 0  # L_cache: the penalty falls from 0 to -1 over these last tokens; required when enabled


@dataclass(frozen=True)
class SamplingConfig:
    """How actors sample each prompt group (travels inside every PromptGroup)."""

    n: int = 8  # samples per prompt
    temperature: float = 1.0  # behavior temperature; the learner uses the same one
    top_p: float = 1.0  # nucleus sampling (1.0 keeps the exact behavior policy)
    max_tokens: int = 1024  # completion token budget (interruption text and answer included)
    interrupt: InterruptConfig = field(default_factory=InterruptConfig)  # forced interruptions
    overlong: OverlongConfig = field(default_factory=OverlongConfig)  # overlong reward penalty


@dataclass(frozen=True)
class EnvConfig:
    """Episodes of several turns (tasks that define an Environment): their budgets and tool calls.
    An episode's tokens, the environment's and tools' included, stay within sampling.max_tokens."""

    max_turns: int = 8  # model turns per episode (one that calls tools counts); the environment may set fewer
    step_timeout_s: float = 60.0  # an environment's start or step that takes longer fails its episode (reward 0)
    tool_parser: str = "hermes"  # vLLM's tool-call parser for the model's format (hermes, pythonic, llama3_json, ...)
    max_tool_calls: int = 4  # tool calls run per model turn; more are answered with an error
    tool_timeout_s: float = 10.0  # a tool call that takes longer is answered with an error
    tool_output_chars: int = 2000  # a tool's output beyond this is cut, and the model told how much was cut
    kwargs: dict[str, Any] = field(default_factory=dict)  # options of the task's environment (its self.kwargs)


@dataclass(frozen=True)
class VllmConfig:
    """Settings of each actor's vLLM engine (vLLM's AsyncEngineArgs)."""

    gpu_memory_utilization: float = 0.9  # fraction of each GPU's memory the engine may take (weights + KV cache)
    tensor_parallel_size: int = 1  # GPUs one engine shards the model over
    max_model_len: int = 0  # longest prompt + completion the engine accepts; 0 = the model's own
    # vLLM's CPU backend only: "packed" re-lays each linear layer's weight out for its GEMM kernel
    # (faster generation; every weight update re-packs them all), "plain" keeps the weights as
    # loaded (an update is copies in place, a shorter pause; generation somewhat slower)
    cpu_linear: str = "packed"
    # any other AsyncEngineArgs field, e.g. {enable_chunked_prefill: true, swap_space: 8}
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


CPU_LINEAR_LAYOUTS = ("packed", "plain")

# engine arguments tidal sets itself: its correctness depends on them
TIDAL_ENGINE_ARGS = ("model", "dtype", "seed", "logprobs_mode", "worker_extension_cls", "enable_prefix_caching",
                     "max_num_seqs", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len",
                     "enforce_eager", "weight_transfer_config")


@dataclass(frozen=True)
class ActorConfig:
    """One vLLM engine per actor process."""

    replicas: int = 1  # actor processes the launcher starts
    index: int = 0  # this actor's number: its sampling seed is actor.seed + index; the launcher sets it
    id: str = ""  # this actor's id, unique among live actors; empty = actor-<index>
    max_inflight: int = 256  # samples the engine generates at once (its max_num_seqs; samples, not groups)
    # samples the actor takes beyond actor.max_inflight, waiting in the engine's queue to start once a running
    # one finishes: a group holds its slots until its longest sample is done, so without a queue a
    # long-tailed batch leaves the engine below max_inflight (the long task's actor generated 0.8x the
    # tokens/s of vLLM fed every request at once; with as many queued, 0.99x). -1: as many as max_inflight
    max_queued: int = -1
    kv_cache_gib: float = 1.0  # CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)
    enforce_eager: bool = True  # skip graph capture (CPU and debugging)
    cpu_cores: str = ""  # cores for the engine's OpenMP threads, e.g. "1" or "0-1"; empty = auto
    heartbeat_s: float = 1.0  # seconds between heartbeats to the learner
    seed: int = 0  # sampling seed (offset by actor.index)
    max_restarts: int = 5  # the launcher restarts a dead actor this many times (per actor) before giving up
    restart_backoff_s: float = 1.0  # first restart delay; doubles per restart of the same actor, up to 30 s
    health_file: str = ""  # touched every heartbeat, for liveness probes (`tidal health FILE`); empty = off
    # GPUs of each actor (`tidal run` sets CUDA_VISIBLE_DEVICES); -1 = actor.vllm.tensor_parallel_size where the
    # machine has GPUs, none where it has not; 0 = none
    gpus_per_replica: int = -1
    # share the learner's GPUs instead of taking GPUs of their own (one machine, too few GPUs): give the engines
    # a memory share that leaves the learner room (actor.vllm.gpu_memory_utilization)
    colocate: bool = False
    vllm: VllmConfig = field(default_factory=VllmConfig)


@dataclass(frozen=True)
class ZmqConfig:
    """ZeroMQ endpoints; ports 0 are chosen free by the launcher."""

    host: str = "127.0.0.1"  # address the learner binds and actors connect to
    control_port: int = 0  # ROUTER: hello, heartbeats, work requests, prompt grants
    rollout_port: int = 0  # PULL: rollout groups from actors
    weights_port: int = 0  # PUB: weight announcements
    # rollouts the learner holds unread per actor connection (messages); beyond it they wait in the actor
    rollout_hwm: int = 64
    # and in bytes: fewer rollouts are held when rollout_hwm frames of broker.max_message_bytes would be more
    # than this (the socket counts frames, so its mark is this / broker.max_message_bytes, at least 1)
    rollout_buffer_bytes: int = 512 * 1024 * 1024
    # control messages (hellos, heartbeats, work requests; each at most broker.max_control_bytes) the learner
    # holds unread per connection; its I/O thread reads them as they come
    control_hwm: int = 16
    # CURVE encryption and authentication (each actor's id bound to its key): auto | on | off. `tidal run` always
    # turns it on (with keys of its own in run_dir/keys when keys_dir is empty) and refuses off. A role started on
    # its own: auto = on when keys_dir is named or broker.zmq.host is beyond loopback; off = anyone who reaches
    # the ports is trusted as any actor (tests, and one-machine setups that accept that)
    curve: str = "auto"
    keys_dir: str = ""  # CURVE keys, made by `tidal keys DIR --actors ...`; a role started alone with CURVE on needs it


@dataclass(frozen=True)
class RedisConfig:
    """Redis Streams: durable, at-least-once, multi-node. Secrets never live in the config:
    the password comes from the environment variable named by `password_env`."""

    url: str = "redis://127.0.0.1:6379/0"  # redis:// or rediss:// (TLS); may carry a user name
    username: str = ""  # ACL user (overrides the URL's); e.g. one for actors, one for the learner
    password_env: str = "TIDAL_REDIS_PASSWORD"  # environment variable holding the password (unset = none)
    ca_file: str = ""  # TLS: CA bundle to verify the server (rediss:// URLs)
    prefix: str = "tidal"  # stream keys are <prefix>:<run name>:{prompts,rollouts,weights,heartbeats,dead}
    claim_idle_ms: int = 60_000  # a prompt pending this long at a silent actor is taken over by another
    max_deliveries: int = 3  # entries delivered more often go to the dead-letter stream
    block_ms: int = 250  # longest blocking read
    reconnect_timeout_s: float = 120.0  # give up (fail loudly) when Redis stays away this long
    embedded: bool = False  # `tidal run` starts a local redis-server (AOF on) in the run directory
    embedded_port: int = 0  # port of the embedded server; 0 = a free one


@dataclass(frozen=True)
class BrokerConfig:
    """Transport between the learner and the actors."""

    type: BrokerType = BrokerType.zmq  # zmq (embedded, no server) | redis (durable, multi-node)
    max_message_bytes: int = 64 * 1024 * 1024  # frames above this are rejected and counted
    max_control_bytes: int = 4 * 1024 * 1024  # hellos, heartbeats and work requests above this are refused
    max_actors: int = 1024  # live actor ids at once; hellos beyond are refused
    actor_timeout_s: float = 10.0  # an actor silent this long counts as gone (zmq: its groups are re-dispatched)
    zmq: ZmqConfig = field(default_factory=ZmqConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)


@dataclass(frozen=True)
class WeightsConfig:
    """The weight channel: how each new policy version reaches the actors."""

    dir: str = ""  # where weight files are written; empty = a folder of this run's own in /dev/shm
    keep: int = 3  # weight files kept; older ones are deleted (at least 2: an actor may still be reading one)
    # file: a safetensors file per version in weights.dir; tcp: each actor pulls every version from the
    # learner's memory; nccl (GPU) | gloo (CPU): each vLLM worker receives every version by broadcast
    transport: str = "file"
    # the network channels (tcp, nccl, gloo):
    tcp_host: str = "127.0.0.1"  # the interface the learner serves weights on (0.0.0.0: every interface)
    tcp_port: int = 0  # the learner's port for weights (control, for nccl/gloo); 0 = any free port (announced)
    tcp_advertise: str = ""  # the host actors dial; empty = tcp_host (this machine's name when it is 0.0.0.0)
    bucket_mib: int = 64  # a version is checked (and over the network sent) in byte ranges of this size
    tcp_timeout_s: float = 30.0  # an actor gives up on a learner that sends nothing for this long
    tcp_prefetch: bool = True  # tcp: fetch a version before pausing the engine, not in it (nccl, gloo: every
    # version is received in the pause, each piece loaded as it lands)
    max_sends: int = 2  # nccl, gloo: versions the learner sends at once (to that many actors); nccl holds
    # 2 GPU buffers of a bucket plus the largest tensor for each
    # connections the learner's weight port serves at once, a thread each (tcp: fetches in flight; gloo, nccl:
    # one per joined actor for the whole run, plus its workers' brief rendezvous ones); more are told to retry
    max_connections: int = 256


@dataclass(frozen=True)
class StalenessConfig:
    """Bound on how old (in optimizer steps) a trained token's policy may be."""

    max_lag: int = 8  # k; 0 = synchronous
    # tokens older than k: drop_group (the whole group) | mask_tokens (out of the loss) | keep (train anyway)
    on_violation: OnViolation = OnViolation.drop_group


@dataclass(frozen=True)
class CurriculumConfig:
    """No-positive-resampling: the coordinator stops dispatching prompts the policy solves."""

    enabled: bool = True  # track each training prompt's pass rate and retire solved prompts
    # retire a prompt once this fraction of its samples pass (reward >= task.pass_threshold)
    retire_pass_rate: float = 0.9
    min_samples: int = 8  # a prompt is judged once this many of its samples arrived since its last judgement


@dataclass(frozen=True)
class LossConfig:
    """The policy-gradient loss; each type reads only its own keys."""

    type: LossType = LossType.cispo  # cispo | tis | ppo | gspo
    eps_max: float = 4.0  # cispo: cap on the token ratio rho = pi_theta / pi_behavior
    tis_cap: float = 2.0  # tis: truncation c of the token ratio, clamp(rho, 0, c)
    clip_eps: float = 0.2  # ppo: the ratio to the proximal policy is clipped to [1 - eps, 1 + eps]
    prox_cap: float = 2.0  # ppo: cap c on the behavior correction pi_prox / pi_behavior
    gspo_clip_low: float = 3e-4  # gspo: the sequence ratio is clipped below at 1 - this
    gspo_clip_high: float = 4e-4  # gspo: the sequence ratio is clipped above at 1 + this
    minibatches_per_step: int = 1  # the step batch is split into this many mini-batches, one optimizer update each
    epochs_per_step: int = 1  # passes over those mini-batches (updates per step = epochs x mini-batches)
    aggregation: Aggregation = Aggregation.prompt_mean  # how token losses are averaged


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6  # AdamW learning rate (after warmup); for a pretrained model of 0.5B+ (presets set their own)
    betas: tuple[float, float] = (0.9, 0.99)  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 0  # linear warmup steps
    # after warmup: constant, or a cosine / linear decay that reaches lr * min_lr_ratio at learner.max_steps
    schedule: LrSchedule = LrSchedule.constant
    min_lr_ratio: float = 0.0  # the decayed schedules' floor, as a fraction of the peak lr
    max_grad_norm: float = 1.0  # clip; 0 disables
    lr_scaling: LrScaling = LrScaling.none  # sqrt: lr = optim.lr * sqrt(learner.groups_per_step / ref_groups_per_step)
    ref_groups_per_step: int = 0  # B_ref, the groups per step at which optim.lr was tuned (lr_scaling=sqrt needs it)


@dataclass(frozen=True)
class FsdpConfig:
    """The policy sharded over the learner's ranks (torch FSDP2): parameters, gradients and AdamW state
    each live on one rank, so a model too large for one device trains on several."""

    enabled: bool = False  # shard each decoder layer and the rest of the model; off = every rank holds it all
    reshard_after_forward: bool = True  # free gathered layers after forward (less memory, gathered again in backward)
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in the backward pass
    cpu_offload: bool = False  # keep sharded parameters, gradients and AdamW state in host memory (GPU only)
    # with learner.nodes > 1: shard within each machine and replicate across machines (HSDP), so the layers'
    # gathers stay on the machine's own links and only the gradients cross between machines
    replicate_over_nodes: bool = True


@dataclass(frozen=True)
class LearnerConfig:
    """The training loop: step batches, loss, optimizer, weight publishing."""

    groups_per_step: int = 16  # prompt groups in one optimizer step
    max_steps: int = 100  # optimizer steps of the run
    num_ranks: int = 1  # learner processes in all; `tidal run` / `tidal learner` start them with torchrun (rank 0
    # talks to the actors)
    nodes: int = 1  # machines the ranks span, learner.num_ranks / nodes on each (one `tidal learner` per machine)
    node_rank: int = 0  # this machine's place among learner.nodes (a StatefulSet pod's ordinal); node 0 holds rank 0
    master_addr: str = ""  # node 0's address, where the ranks meet; empty = this machine (learner.nodes = 1)
    master_port: int = 29500  # node 0's port for the ranks' rendezvous (tidal run picks a free one on one machine)
    # GPUs of the learner, one per rank (`tidal run` sets CUDA_VISIBLE_DEVICES); -1 = learner.num_ranks where the
    # machine has GPUs, none where it has not; 0 = none (train on CPU)
    gpus: int = -1
    micro_batch_tokens: int = 8192  # padded tokens (rows x longest row) of one forward/backward micro-batch
    advantage_norm: AdvantageNorm = AdvantageNorm.batch  # how group-centred advantages are scaled
    zero_variance_filter: bool = True  # drop groups whose rewards are all equal
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    kernel_backend: str = "auto"  # logprob kernel: auto | torch | naive | triton
    # master weights and AdamW state; keep float32: in bfloat16 updates below its resolution vanish
    param_dtype: str = "float32"  # float32 | bfloat16 | float16
    # forward/backward compute through Accelerate's autocast: no (param_dtype) | bf16 | fp16; the LM head stays fp32
    mixed_precision: str = "no"
    # auto: flash_attention_2 on CUDA where flash-attn is installed, sdpa elsewhere
    attention: str = "auto"  # auto | sdpa | flash_attention_2
    # micro-batches packed end to end without padding (variable-length attention), padded per micro-batch, or
    # shared: a prompt group's prompt computed once with all its completions after it (not with flash-attn);
    # auto: packed under flash_attention_2, otherwise padded or shared, whichever computes less each step
    packing: str = "auto"  # auto | packed | padded | shared
    torch_threads: int = 1  # intra-op threads of the learner
    rollout_timeout_s: float = 600.0  # no rollout for this long means the actors are gone: the learner fails
    # the learner ranks' process group timeout: a rank waits this long in a collective while rank 0 is busy
    # elsewhere (waiting for rollouts, the final evaluation, writing a checkpoint) before the group gives up
    dist_timeout_s: float = 7200.0
    health_file: str = ""  # touched while the loop makes progress, for liveness probes; empty = off
    seed: int = 0  # torch seed


@dataclass(frozen=True)
class EvalConfig:
    every: int = 10  # optimizer steps between evaluations (0 = only at start and end)
    n: int = 4  # samples per held-out prompt (mean@n pass rate)
    temperature: float = 1.0  # eval sampling temperature


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # optimizer steps between checkpoints (0 = only at the end)
    keep: int = 2  # checkpoints kept on disk


@dataclass(frozen=True)
class TrackingConfig:
    # MLflow tracking URI; empty = $MLFLOW_TRACKING_URI, else sqlite:///<run_dir>/mlflow.db
    uri: str = ""
    experiment: str = ""  # MLflow experiment name; empty = $MLFLOW_EXPERIMENT_NAME, else "tidal"
    parent_run_id: str = ""  # the MLflow run this run is a child of (tidal sweep sets it)
    # CPU, memory, disk, network and (where nvidia-ml-py finds GPUs) GPU metrics every this many
    # seconds, as system/* metrics of the learner's run; 0 = none
    system_metrics_interval_s: float = 10.0
    eval_completions: int = 64  # sample completions logged as a table at every evaluation; 0 = none
    log_model: bool = False  # also log the final exported model folder (run_dir/model) to MLflow, as artifacts
    # one line in the learner's log every this many steps (step, reward, pass rate, loss, lag, tokens/s over
    # the recent window, time per step), so `kubectl logs -f` shows progress; 0 = none
    log_every_steps: int = 1
    # a table of sampled training rollouts (prompt, completion, reward and its components, advantage, versions,
    # lag) in MLflow every this many steps; 0 = none
    rollout_table_every: int = 25
    rollout_table_rows: int = 16  # rollouts in each such table


@dataclass(frozen=True)
class RunConfig:
    """The whole run. Components receive only their own part."""

    name: str = "tidal"  # run name (MLflow run name, weight dir name)
    run_dir: str = ""  # output folder; empty = runs/<name>-<timestamp>
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def _one_line(err: OmegaConfBaseException) -> str:
    """OmegaConf errors span several lines with a 'full_key' entry; keep the key and the reason."""
    key = getattr(err, "full_key", None) or getattr(err, "key", None)
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    return f"config key '{key}': {reason}" if key else f"config: {reason}"


def load_config(path: str | Path | list | tuple | None = None,
                overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Schema <- YAML presets or files, in order (each after the `base` it names) <- key=value
    overrides, validated; raises ConfigError naming the key or the file."""
    paths = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not key=value")
    try:
        merged = OmegaConf.structured(RunConfig)
        for layer in paths:
            merged = OmegaConf.merge(merged, *map(yaml_words, layers_of(preset_path(layer))))
        merged = OmegaConf.merge(merged, yaml_words(OmegaConf.from_dotlist(list(overrides))))
        cfg: RunConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_one_line(err)) from None
    validate(cfg)
    return cfg


def layers_of(path: Path, seen: tuple[Path, ...] = ()) -> list:
    """A YAML file's layers: those of the config its `base` key names (a preset's name, or a file
    relative to this one), then its own keys. An overlay holds only what it changes."""
    if path.resolve() in seen:
        chain = " -> ".join(str(p) for p in (*seen, path.resolve()))
        raise ConfigError(f"config {path}: `base` goes round in a circle ({chain})")
    node = read_yaml(path)
    base = node.pop("base", None) if isinstance(node, DictConfig) else None
    if base is None:
        return [node]
    if not isinstance(base, str):
        raise ConfigError(f"config {path}: `base` must name one config, got {base!r}")
    nearby = path.parent / base
    return [*layers_of(nearby if nearby.is_file() else preset_path(base), (*seen, path.resolve())), node]


def read_yaml(path: Path):
    """A YAML file as OmegaConf nodes; a syntax error is one line naming the file and the line."""
    import yaml

    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (UTF-8)") from None


def presets() -> dict[str, Path]:
    """The presets shipped inside the package, by name: tiny, math, scalerl, loo/tiny-loo-sync, ..."""
    from importlib.resources import files

    root = Path(str(files("tidal.presets")))
    return {str(p.relative_to(root).with_suffix("")): p for p in sorted(root.rglob("*.yaml"))}


def preset_path(name_or_path: str | Path) -> Path:
    """A YAML file, or the name of a shipped preset (`tiny` for tiny.yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = presets()
    name = str(name_or_path).removesuffix(".yaml")
    if name in shipped:
        return shipped[name]
    raise ConfigError(f"config {str(name_or_path)!r}: no such file, and not a preset ({', '.join(shipped)})")


def resolve(cfg: RunConfig, *, model_path: str | None = None, redis_url: str | None = None,
            actor: bool = False) -> RunConfig:
    """The one place a loaded config changes: a new frozen config with what every process of a run
    must agree on filled in. Resolving a resolved config changes nothing but what is passed.

    - run_dir: absolute; runs/<name>-<time> when empty
    - model.path: `model_path` when given (the caller found or built the model)
    - weights.dir: the weight channel's own folder for this run when empty
    - broker.redis.url: `redis_url` when given (an embedded redis-server's)
    - actor.id, in an actor's own process (`actor=True`): actor-<actor.index> when empty
    """
    import time

    from tidal.broker.weights import default_dir  # the channel owns its folder rule; the config records it

    run_dir = Path(cfg.run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    broker = cfg.broker if redis_url is None else replace(cfg.broker, redis=replace(cfg.broker.redis, url=redis_url))
    actor_cfg = replace(cfg.actor, id=cfg.actor.id or f"actor-{cfg.actor.index}") if actor else cfg.actor
    return replace(
        cfg, run_dir=str(run_dir), broker=broker, actor=actor_cfg,
        model=cfg.model if model_path is None else replace(cfg.model, path=model_path),
        weights=replace(cfg.weights, dir=cfg.weights.dir or default_dir(cfg.name, run_dir)))


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flatten(cfg: RunConfig) -> dict[str, str]:
    """Dotted keys -> values as strings, for MLflow params."""
    out: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, name + ".")
            else:
                out[name] = redact_uri(str(value)) if key.endswith(("url", "uri")) else str(value)

    walk(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True), "")
    return out


REDACTED = "***"
# query parameters that carry a credential: tokens, passwords, keys, signatures (SAS `sig`), auth
SECRET_PARAM = re.compile(r"token|pass|pwd|secret|key|auth|credential|signature|^sig$|session", re.IGNORECASE)


def redact_uri(uri: str) -> str:
    """`uri` fit for logs, params and artifacts: a password (or a user part without one, which may be
    a token) becomes ***, and so does every query value whose name says it is a credential. The rest
    is kept character for character (sqlite:////abs/path stays as it is)."""
    try:
        parts = urlsplit(uri)
    except ValueError:  # not a URI at all: nothing of it is shown
        return REDACTED
    out = uri
    if "@" in parts.netloc:
        userinfo, host = parts.netloc.rsplit("@", 1)
        user, has_password, _ = userinfo.partition(":")
        netloc = f"{user}:{REDACTED}@{host}" if has_password else f"{REDACTED}@{host}"
        out = out.replace(f"//{parts.netloc}", f"//{netloc}", 1)
    if parts.query:
        fields = [_redact_field(field) for field in parts.query.split("&")]
        out = out.replace(f"?{parts.query}", "?" + "&".join(fields), 1)
    return out


def _redact_field(field: str) -> str:
    name, has_value, _ = field.partition("=")
    return f"{name}={REDACTED}" if has_value and SECRET_PARAM.search(unquote(name)) else field



def redacted_config(cfg: RunConfig) -> RunConfig:
    """The config as it may be shown: the URIs that can carry credentials redacted."""
    redis = replace(cfg.broker.redis, url=redact_uri(cfg.broker.redis.url))
    return replace(cfg, tracking=replace(cfg.tracking, uri=redact_uri(cfg.tracking.uri)),
                   broker=replace(cfg.broker, redis=redis))


# ---- cross-field rules, each a named check -------------------------------------------------

def _require(ok: bool, key: str, value, why: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' = {value!r}: {why}")


def check_model(cfg: RunConfig) -> None:
    tiny = cfg.model.tiny
    _require(tiny.hidden_size % tiny.num_heads == 0, "model.tiny.num_heads", tiny.num_heads,
             "must divide model.tiny.hidden_size")
    head_dim = tiny.hidden_size // max(tiny.num_heads, 1)
    _require(head_dim in (32, 64, 128), "model.tiny.num_heads", tiny.num_heads,
             f"head_dim {head_dim} is not 32, 64 or 128 (vLLM's CPU attention rejects others)")
    _require(tiny.num_heads % tiny.num_kv_heads == 0, "model.tiny.num_kv_heads", tiny.num_kv_heads,
             "must divide model.tiny.num_heads")
    _require(cfg.model.dtype in DTYPES, "model.dtype", cfg.model.dtype, f"expected one of {', '.join(DTYPES)}")
    _require(cfg.model.head in HEADS, "model.head", cfg.model.head, f"expected {' or '.join(HEADS)}")
    _require(not cfg.model.revision or bool(cfg.model.path), "model.revision", cfg.model.revision,
             "names a version of a Hub model: set model.path to its id (org/name)")


def check_sampling(cfg: RunConfig) -> None:
    s = cfg.sampling
    _require(s.n >= 2, "sampling.n", s.n, "group-relative advantages need at least 2 samples")
    _require(s.temperature > 0, "sampling.temperature", s.temperature, "must be > 0")
    _require(0 < s.top_p <= 1, "sampling.top_p", s.top_p, "must be in (0, 1]")
    _require(s.max_tokens >= 1, "sampling.max_tokens", s.max_tokens, "must be >= 1")
    _require(cfg.actor.max_inflight >= s.n, "actor.max_inflight", cfg.actor.max_inflight,
             f"must hold at least one group (sampling.n = {s.n})")
    _require(cfg.actor.max_queued >= -1, "actor.max_queued", cfg.actor.max_queued,
             "must be >= 0, or -1 for as many as actor.max_inflight")


def check_env(cfg: RunConfig) -> None:
    e = cfg.env
    # each turn after the first adds one span of injected tokens, and a sample carries at most 1024
    _require(1 <= e.max_turns <= 1000, "env.max_turns", e.max_turns, "must be in [1, 1000]")
    _require(e.max_tool_calls >= 0, "env.max_tool_calls", e.max_tool_calls, "must be >= 0")
    for key in ("step_timeout_s", "tool_timeout_s"):
        _require(getattr(e, key) > 0, f"env.{key}", getattr(e, key), "must be > 0")
    _require(e.tool_output_chars >= 1, "env.tool_output_chars", e.tool_output_chars, "must be >= 1")


def check_length_control(cfg: RunConfig) -> None:
    s, it, ol = cfg.sampling, cfg.sampling.interrupt, cfg.sampling.overlong
    _require(not (it.enabled and ol.enabled), "sampling.overlong.enabled", ol.enabled,
             "interruptions and the overlong penalty are alternatives: enable one of them")
    if it.enabled:
        _require(it.min_tokens >= 1, "sampling.interrupt.min_tokens", it.min_tokens, "must be >= 1")
        _require(it.max_tokens >= it.min_tokens, "sampling.interrupt.max_tokens", it.max_tokens,
                 f"must be >= sampling.interrupt.min_tokens = {it.min_tokens}")
        _require(it.answer_tokens >= 1, "sampling.interrupt.answer_tokens", it.answer_tokens, "must be >= 1")
        _require(bool(it.text), "sampling.interrupt.text", it.text, "must not be empty")
        # the text's token count is known once tokenized: the learner checks the exact sum then
        _require(it.max_tokens + it.answer_tokens < s.max_tokens, "sampling.interrupt.max_tokens", it.max_tokens,
                 f"+ answer_tokens {it.answer_tokens} + the text's tokens must fit sampling.max_tokens {s.max_tokens}")
    if ol.enabled:
        _require(1 <= ol.buffer_tokens < s.max_tokens, "sampling.overlong.buffer_tokens", ol.buffer_tokens,
                 f"must be in [1, sampling.max_tokens = {s.max_tokens})")


def check_learner(cfg: RunConfig) -> None:
    lc = cfg.learner
    _require(lc.groups_per_step >= 1, "learner.groups_per_step", lc.groups_per_step, "must be >= 1")
    _require(lc.max_steps >= 1, "learner.max_steps", lc.max_steps, "must be >= 1")
    _require(lc.num_ranks >= 1, "learner.num_ranks", lc.num_ranks, "must be >= 1")
    _require(lc.groups_per_step >= lc.num_ranks * lc.loss.minibatches_per_step, "learner.groups_per_step",
             lc.groups_per_step, f"every rank needs a group in every mini-batch: at least learner.num_ranks "
             f"({lc.num_ranks}) x learner.loss.minibatches_per_step ({lc.loss.minibatches_per_step})")
    _require(cfg.staleness.max_lag >= 0, "staleness.max_lag", cfg.staleness.max_lag, "must be >= 0")
    _require(lc.kernel_backend in ("auto", "torch", "naive", "triton"), "learner.kernel_backend",
             lc.kernel_backend, "expected auto, torch, naive or triton")
    _require(lc.micro_batch_tokens >= 1, "learner.micro_batch_tokens", lc.micro_batch_tokens, "must be >= 1")
    _require(lc.param_dtype in DTYPES, "learner.param_dtype", lc.param_dtype, f"expected one of {', '.join(DTYPES)}")
    _require(lc.mixed_precision in ("no", "bf16", "fp16"), "learner.mixed_precision", lc.mixed_precision,
             "expected no, bf16 or fp16")
    _require(lc.attention in ("auto", "sdpa", "flash_attention_2"), "learner.attention", lc.attention,
             "expected auto, sdpa or flash_attention_2")
    _require(lc.packing in ("auto", "packed", "padded", "shared"), "learner.packing", lc.packing,
             "expected auto, packed, padded or shared")
    _require(lc.nodes >= 1 and lc.num_ranks % lc.nodes == 0, "learner.nodes", lc.nodes,
             f"must be >= 1 and divide learner.num_ranks = {lc.num_ranks} (the same number of ranks on each machine)")
    _require(0 <= lc.node_rank < lc.nodes, "learner.node_rank", lc.node_rank,
             f"must be in [0, learner.nodes = {lc.nodes})")
    _require(lc.nodes == 1 or lc.master_addr, "learner.master_addr", lc.master_addr,
             "the learner spans several machines (learner.nodes > 1): name node 0's address")
    _require(not lc.fsdp.enabled or lc.num_ranks >= 2, "learner.fsdp.enabled", lc.fsdp.enabled,
             "sharding needs learner.num_ranks >= 2 (one rank holds the whole model anyway)")
    _require(not lc.fsdp.enabled or lc.mixed_precision != "fp16", "learner.mixed_precision", lc.mixed_precision,
             "a sharded learner (learner.fsdp.enabled) computes in bf16 or the parameters' dtype, not fp16")
    _require(lc.attention != "flash_attention_2" or compute_dtype(lc) != "float32", "learner.attention", lc.attention,
             "flash-attn computes in bf16 or fp16 only: set learner.mixed_precision=bf16 or learner.attention=sdpa")
    _require(lc.dist_timeout_s >= lc.rollout_timeout_s, "learner.dist_timeout_s", lc.dist_timeout_s,
             f"must be >= learner.rollout_timeout_s = {lc.rollout_timeout_s}: the other ranks wait in a collective "
             "while rank 0 waits for rollouts")
    loss, optim = lc.loss, lc.optim
    for key in ("eps_max", "tis_cap", "prox_cap", "gspo_clip_high"):
        _require(getattr(loss, key) > 0, f"learner.loss.{key}", getattr(loss, key), "must be > 0")
    for key in ("clip_eps", "gspo_clip_low"):
        _require(0 < getattr(loss, key) < 1, f"learner.loss.{key}", getattr(loss, key), "must be in (0, 1)")
    _require(loss.epochs_per_step >= 1, "learner.loss.epochs_per_step", loss.epochs_per_step, "must be >= 1")
    _require(1 <= loss.minibatches_per_step <= lc.groups_per_step, "learner.loss.minibatches_per_step",
             loss.minibatches_per_step, f"must be in [1, learner.groups_per_step = {lc.groups_per_step}]")
    _require(optim.lr > 0, "learner.optim.lr", optim.lr, "must be > 0")
    _require(0.0 <= optim.min_lr_ratio <= 1.0, "learner.optim.min_lr_ratio", optim.min_lr_ratio,
             "a fraction of the peak lr, in [0, 1]")
    _require(optim.lr_scaling is LrScaling.none or optim.ref_groups_per_step >= 1, "learner.optim.ref_groups_per_step",
             optim.ref_groups_per_step, "lr_scaling=sqrt needs the groups per step at which optim.lr was tuned (>= 1)")
    _require(cfg.actor.replicas >= 1, "actor.replicas", cfg.actor.replicas, "must be >= 1")
    _require(cfg.actor.index >= 0, "actor.index", cfg.actor.index, "must be >= 0")


def compute_dtype(cfg: LearnerConfig) -> str:
    """The dtype the learner's forward and backward compute in: learner.mixed_precision's, else the
    master weights'."""
    return {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.mixed_precision, cfg.param_dtype)


def check_task(cfg: RunConfig) -> None:
    low, high = cfg.task.reward_range
    _require(low < high, "task.reward_range", list(cfg.task.reward_range), "expected [low, high] with low < high")
    funcs, weights = cfg.task.reward_funcs, cfg.task.reward_weights
    _require(all(isinstance(f, str) and f.strip() for f in funcs), "task.reward_funcs", list(funcs),
             "each an import path (my_pkg.rewards:accuracy) or an entry-point name")
    _require(not weights or len(weights) == len(funcs), "task.reward_weights", list(weights),
             f"one weight per reward function ({len(funcs)} in task.reward_funcs), or none for all 1.0")
    _require(all(abs(w) < float("inf") for w in weights), "task.reward_weights", list(weights),
             "weights must be finite")
    _require(not cfg.task.pass_on or bool(funcs), "task.pass_on", cfg.task.pass_on,
             "names one of task.reward_funcs, and there are none")
    _require(cfg.task.remote_timeout_s > 0, "task.remote_timeout_s", cfg.task.remote_timeout_s, "must be > 0")
    _require(cfg.task.remote_retries >= 0, "task.remote_retries", cfg.task.remote_retries, "must be >= 0")


def check_devices(cfg: RunConfig) -> None:
    lc, ac, vc = cfg.learner, cfg.actor, cfg.actor.vllm
    _require(not (ac.colocate and cfg.weights.transport == "nccl"), "actor.colocate", ac.colocate,
             "actors on the learner's GPUs cannot take weights by nccl (NCCL refuses two ranks of one "
             "communicator on one GPU): use weights.transport=tcp or file")
    _require(lc.gpus in (-1, 0, lc.num_ranks), "learner.gpus", lc.gpus,
             f"one GPU per rank: -1 (auto), 0 (CPU) or learner.num_ranks = {lc.num_ranks}")
    _require(vc.tensor_parallel_size >= 1, "actor.vllm.tensor_parallel_size", vc.tensor_parallel_size, "must be >= 1")
    _require(ac.gpus_per_replica in (-1, 0) or ac.gpus_per_replica >= vc.tensor_parallel_size,
             "actor.gpus_per_replica", ac.gpus_per_replica,
             f"-1 (auto), 0 (CPU) or at least actor.vllm.tensor_parallel_size = {vc.tensor_parallel_size}")
    _require(0 < vc.gpu_memory_utilization <= 1, "actor.vllm.gpu_memory_utilization", vc.gpu_memory_utilization,
             "must be in (0, 1]")
    _require(vc.max_model_len >= 0, "actor.vllm.max_model_len", vc.max_model_len, "must be >= 0 (0 = the model's)")
    _require(vc.cpu_linear in CPU_LINEAR_LAYOUTS, "actor.vllm.cpu_linear", vc.cpu_linear,
             f"expected {' or '.join(CPU_LINEAR_LAYOUTS)}")
    _require(not ac.cpu_cores or re.fullmatch(CORES_PATTERN, ac.cpu_cores) is not None, "actor.cpu_cores",
             ac.cpu_cores, "expected core ids like 1, 0-3 or 0,2-3 (empty: vLLM picks)")
    taken = sorted(set(vc.engine_kwargs) & set(TIDAL_ENGINE_ARGS))
    _require(not taken, "actor.vllm.engine_kwargs", taken,
             "tidal sets these engine arguments itself (use the actor.* / actor.vllm.* keys where there is one)")
    # an engine's data-parallel replicas would each need ranks in its weight group and their own updates
    _require(vc.engine_kwargs.get("data_parallel_size", 1) == 1, "actor.vllm.engine_kwargs.data_parallel_size",
             vc.engine_kwargs.get("data_parallel_size"),
             "an actor runs one engine replica: scale with actor.replicas (each joins and leaves on its own)")


CORES_PATTERN = r"\d+(-\d+)?(,\d+(-\d+)?)*"


def parse_cores(spec: str) -> list[int]:
    """A core list as actor.cpu_cores and taskset write it ("1", "0-3", "0,2-3"), as core ids."""
    cores = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


def check_curriculum(cfg: RunConfig) -> None:
    cur = cfg.curriculum
    _require(0 < cur.retire_pass_rate <= 1, "curriculum.retire_pass_rate", cur.retire_pass_rate,
             "must be in (0, 1]; set curriculum.enabled=false to keep every prompt")
    _require(cur.min_samples >= 1, "curriculum.min_samples", cur.min_samples, "must be >= 1")


def check_broker(cfg: RunConfig) -> None:
    z = cfg.broker.zmq
    _require(z.curve in ("auto", "on", "off"), "broker.zmq.curve", z.curve, "expected auto, on or off")
    # keys_dir is not required here: `tidal run` makes keys of its own, and a role started alone with CURVE on
    # and no keys fails as it builds its transport, naming broker.zmq.keys_dir
    for key in ("max_message_bytes", "max_control_bytes", "max_actors"):
        _require(getattr(cfg.broker, key) >= 1, f"broker.{key}", getattr(cfg.broker, key), "must be >= 1")
    for key in ("rollout_hwm", "control_hwm"):
        _require(getattr(z, key) >= 1, f"broker.zmq.{key}", getattr(z, key), "must be >= 1 (0 would mean no bound)")
    _require(z.rollout_buffer_bytes >= cfg.broker.max_message_bytes, "broker.zmq.rollout_buffer_bytes",
             z.rollout_buffer_bytes, f"must hold a frame of broker.max_message_bytes = {cfg.broker.max_message_bytes}")
    r = cfg.broker.redis
    _require(r.url.startswith(("redis://", "rediss://", "unix://")), "broker.redis.url", redact_uri(r.url),
             "expected redis://, rediss:// (TLS) or unix://")
    _require(not r.ca_file or r.url.startswith("rediss://"), "broker.redis.ca_file", r.ca_file,
             "a CA bundle verifies TLS: use a rediss:// URL")
    _require(r.max_deliveries >= 1, "broker.redis.max_deliveries", r.max_deliveries, "must be >= 1")
    _require(r.claim_idle_ms >= 1, "broker.redis.claim_idle_ms", r.claim_idle_ms, "must be >= 1")


def check_tracking(cfg: RunConfig) -> None:
    t = cfg.tracking
    _require(t.system_metrics_interval_s >= 0, "tracking.system_metrics_interval_s", t.system_metrics_interval_s,
             "must be >= 0 (0 = no system metrics)")
    _require(t.eval_completions >= 0, "tracking.eval_completions", t.eval_completions, "must be >= 0 (0 = no table)")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def curve_on(cfg: ZmqConfig) -> bool:
    """CURVE is on when asked, and by default whenever keys are named or the learner binds beyond
    loopback (`tidal run` writes curve=on for its children)."""
    beyond_loopback = cfg.host not in LOOPBACK and not cfg.host.startswith("127.")
    return cfg.curve == "on" or (cfg.curve == "auto" and (bool(cfg.keys_dir) or beyond_loopback))


# keys whose words YAML 1.1 reads as booleans (on/off, yes/no): given back as the words the schema expects
YAML_BOOLEAN_WORDS = {"broker.zmq.curve": ("off", "on")}


def yaml_words(layer):
    """A config layer with `curve: on` (parsed by YAML as True) given back as the word "on"."""
    if not isinstance(layer, DictConfig):
        return layer
    for key, words in YAML_BOOLEAN_WORDS.items():
        value = OmegaConf.select(layer, key, default=None)
        if isinstance(value, bool):
            OmegaConf.update(layer, key, words[value], merge=False)
    return layer


def validate(cfg: RunConfig) -> None:
    for check in (check_model, check_task, check_sampling, check_env, check_length_control, check_learner,
                  check_devices, check_curriculum, check_broker, check_tracking):
        check(cfg)


# ---- asking the schema: `tidal config explain KEY` --------------------------------------------

def field_help(cls: type) -> dict[str, str]:
    """Each field's help, from the schema's own source: the comment lines just above the field and
    the comment on its line (one source for the code, the docs and `tidal config explain`)."""
    import inspect

    helps, above = {}, []
    for line in inspect.getsource(cls).splitlines()[1:]:
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("#").strip())
            continue
        found = re.match(r"^(\w+): [^=#]+?(?: = .*?)?(?:\s{2}#\s*(.*))?$", text)
        if found and not text.startswith(("def ", "@", '"""')):
            helps[found.group(1)] = " ".join([*above, found.group(2) or ""]).strip()
        above = []
    return helps


def explain(key: str) -> str:
    """What a config key is: its type, default and help; for a section, its keys."""
    import dataclasses
    import typing

    cls, default, parts = RunConfig, RunConfig(), [p for p in key.split(".") if p]
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            known = ", ".join(f.name for f in dataclasses.fields(cls))
            raise ConfigError(f"config key '{'.'.join(parts[:i + 1])}' does not exist; "
                              f"{'.'.join(parts[:i]) or 'the top level'} has: {known}")
        value, hint = getattr(default, part), hints[part]
        if dataclasses.is_dataclass(hint) and i < len(parts) - 1:
            cls, default = hint, value
            continue
        if dataclasses.is_dataclass(hint):
            doc = (hint.__doc__ or "").strip().splitlines()[0] if hint.__doc__ else ""
            rows = [f"  {f.name}: {field_help(hint).get(f.name, '')}" for f in dataclasses.fields(hint)]
            return "\n".join([f"{key}: {doc}", *rows])
        shown = value.value if isinstance(value, enum.Enum) else value
        kind = getattr(hint, "__name__", str(hint).replace("typing.", ""))
        return f"{key} ({kind}, default {shown!r}): {field_help(cls).get(part, '(no help)')}"
    return "the whole run: " + ", ".join(f.name for f in dataclasses.fields(RunConfig))
