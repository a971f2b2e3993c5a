"""The one typed config tree of tidal: dataclasses, YAML presets in configs/, key=value overrides.

Each component is built from its own sub-config (`cfg.actor`, `cfg.learner`, ...), never the
whole tree. The schema documents and checks itself:

    field      opt(default, "help")          the help `tidal config explain` prints
    closed set an Enum                       a value outside it fails as the YAML or override merges
    section    its check()                   its own rules, beside its fields (a choice such as
                                             weights.transport selects which of its keys matter)
    run        RunConfig.check()             every section's, then CROSS_SECTION_RULES

Every mistake fails at load with one line naming the key (load_config); what needs the model or
the task's data read fails at preflight, before any process starts (tidal/preflight.py).
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A config that cannot run: the message names the key and the value."""


def opt(default, help: str):
    """A field of the schema with its help: the one text for the code, the docs and `tidal config
    explain`. An empty list or dict default is made afresh for every config."""
    if isinstance(default, (list, dict)):
        assert not default, "a list or dict default must be empty: every config gets its own"
        return field(default_factory=type(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _require(ok: bool, key: str, value, why: str) -> None:
    if not ok:
        shown = value.value if isinstance(value, enum.Enum) else value
        raise ConfigError(f"config key '{key}' = {shown!r}: {why}")


class Section:
    """A sub-config: `check` raises ConfigError naming the first of its keys that cannot run."""

    def check(self) -> None:
        """Its own rules (none here); a section that holds others checks them too."""


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


# The closed sets below reach code outside this module and libraries (torch, Accelerate, vLLM) as
# words, so they are StrEnums: each member is its word (`cfg.learner.packing == "shared"`, f-strings,
# getattr(torch, dtype) and os.environ all see the string). An enum hashes by its name, so a dict keyed
# by the plain word finds a member only while every name equals its value (tests/unit/test_config_checks.py).

class Dtype(enum.StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class LmHead(enum.StrEnum):
    fp32 = "fp32"
    served = "served"


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


class CpuLinear(enum.StrEnum):
    packed = "packed"
    plain = "plain"


class Curve(enum.StrEnum):
    auto = "auto"
    on = "on"
    off = "off"


class WeightTransport(enum.StrEnum):
    """The weight channels, in the order tidal.broker.weights registers them (one module each)."""

    file = "file"
    tcp = "tcp"
    gloo = "gloo"
    nccl = "nccl"


def choices(kind: type[enum.Enum]) -> list[str]:
    """The words a closed set takes, in order."""
    return [member.value for member in kind]


@dataclass(frozen=True)
class WarmStartConfig(Section):
    """Supervised warm start of the tiny model, so RL starts from a non-zero pass rate."""

    max_steps: int = opt(2000, "upper bound on SFT steps")
    target_greedy_pass_rate: float = opt(0.9, "stop once greedy decoding solves this fraction of val prompts at "
                                              "stable_checks checks in a row")
    stable_checks: int = opt(1, "checks in a row that must reach target_greedy_pass_rate: one pass can be a lucky jump "
                                "(0.52 -> 0.93 in 25 steps) that leaves the model short of what RL needs")
    format_noise: float = opt(0.0, "fraction of SFT answers followed by stray characters before <eos>")
    check_every: int = opt(25, "SFT steps between pass-rate checks")
    batch_size: int = opt(256, "sequences per SFT step")
    lr: float = opt(3e-3, "AdamW learning rate")
    seed: int = opt(0, "init and data-order seed")


@dataclass(frozen=True)
class TinyModelConfig(Section):
    """A small Qwen2 built locally (no download) with a character-level tokenizer."""

    hidden_size: int = opt(128, "model width")
    num_layers: int = opt(4, "decoder layers")
    num_heads: int = opt(4, "attention heads (head_dim = hidden_size / num_heads; 32 or 64 on CPU)")
    num_kv_heads: int = opt(2, "key/value heads (grouped-query attention)")
    intermediate_size: int = opt(512, "MLP width")
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)

    def check(self) -> None:
        _require(self.hidden_size % self.num_heads == 0, "model.tiny.num_heads", self.num_heads,
                 "must divide model.tiny.hidden_size")
        head_dim = self.hidden_size // max(self.num_heads, 1)
        _require(head_dim in (32, 64, 128), "model.tiny.num_heads", self.num_heads,
                 f"head_dim {head_dim} is not 32, 64 or 128 (vLLM's CPU attention rejects others)")
        _require(self.num_heads % self.num_kv_heads == 0, "model.tiny.num_kv_heads", self.num_kv_heads,
                 "must divide model.tiny.num_heads")


@dataclass(frozen=True)
class ModelConfig(Section):
    """Which weights the actors serve and the learner trains."""

    path: str = opt("", "a Hugging Face model folder, or a Hub id (org/name) fetched into the Hugging Face cache "
                        "(HF_HUB_OFFLINE=1: the cache only); empty builds (or reuses) the tiny model")
    revision: str = opt("", "Hub ids: a branch, tag or commit; empty = main")
    cache_dir: str = opt("~/.cache/tidal/models", "where built tiny models are kept, keyed by config")
    dtype: Dtype = opt(Dtype.float32, "what the actors serve (and weights travel in)")
    head: LmHead = opt(LmHead.fp32, "the LM head's numerics, alike on both sides: fp32 = the learner computes logits "
                                    "from its fp32 master head weights; served = from the head weights in model.dtype, "
                                    "its hidden states rounded to model.dtype, products summed in fp32, which is what "
                                    "the actors compute. Either way an actor serving bfloat16 or float16 computes its "
                                    "head in fp32 (vLLM's head_dtype) instead of rounding its logits to model.dtype")
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def check(self) -> None:
        self.tiny.check()
        _require(not self.revision or bool(self.path), "model.revision", self.revision,
                 "names a version of a Hub model: set model.path to its id (org/name)")


@dataclass(frozen=True)
class TaskConfig(Section):
    """The task: prompts for the coordinator, the reward for the actors."""

    name: str = opt("arithmetic", "built-in (arithmetic, math), installed (entry-point group tidal.tasks) or an import "
                                  "path (my_pkg.my_task)")
    kwargs: dict[str, Any] = opt({}, "options of the task itself, e.g. {tolerance: 0.01}")
    max_operand: int = opt(99, "arithmetic: operands are drawn from 0..max_operand")
    num_val: int = opt(256, "held-out prompts for evaluation (never trained on); math: at most this many")
    seed: int = opt(0, "split seed")
    data_path: str = opt("", "training prompts: a JSON Lines (.jsonl, .json) or Parquet file, a folder of them, or a "
                             "Hub dataset id")
    data_config: str = opt("", "Hub datasets: the configuration (subset) name; empty = the default")
    data_split: str = opt("train", "folders and Hub datasets: the split of data_path to train on")
    val_path: str = opt("", "held-out prompts (num_val drawn by seed), read like data_path; empty = split off "
                            "data_path")
    val_split: str = opt("test", "folders and Hub datasets: the split of val_path")
    prompt_field: str = opt("problem", "the column holding each prompt: a string, or chat messages [{role, content}, "
                                       "...] (TRL's conversational format)")
    answer_field: str = opt("answer", 'the column holding the gold answer, e.g. "\\\\frac{1}{2}" or "12"')
    prompt_template: str = opt(
        "{problem}\nPut the final answer in \\boxed{{}}.",
        "string prompts: the text; {<prompt_field>} is replaced by the prompt, {{ and }} are literal braces")
    chat_template: bool = opt(False, "apply the tokenizer's chat template (a string prompt becomes one user message; "
                                     "chat messages always get it)")
    system_prompt: str = opt("", "with a chat template: a system message first, unless the prompt's messages have one")
    reward_range: tuple[float, float] = opt((-10.0, 10.0), "rollouts with a reward outside it are rejected, counted")
    pass_threshold: float = opt(1.0, "a sample passes when its reward is at least this: pass rates (rollout/, eval/), "
                                     "the curriculum and the scaling fits count passes by it, whatever the reward's "
                                     "scale (partial credit, summed components)")
    reward_funcs: list[str] = opt([], "reward functions, each an import path (my_pkg.rewards:accuracy or "
                                      "my_pkg.rewards.accuracy) or a name in the entry-point group tidal.rewards, "
                                      "called with prompt, completion, completion_ids and every column of the row; the "
                                      "sample's reward is their weighted sum (instead of the task's own reward)")
    reward_weights: list[float] = opt([], "one per reward function; empty = all 1.0")
    pass_on: str = opt("", "the reward function (by name) whose value says whether a sample passed, compared with "
                           "pass_threshold: the accuracy of accuracy + 0.2 x format, so a format bonus is no pass; "
                           "empty = the weighted sum (the reward)")
    remote_timeout_s: float = opt(30.0, "a remote reward (an http:// or https:// URL in reward_funcs): each POST of a "
                                        "batch waits this long")
    remote_retries: int = opt(2, "more tries of a remote reward's failed POST (error status, timeout, refused)")

    def check(self) -> None:
        low, high = self.reward_range
        _require(low < high, "task.reward_range", list(self.reward_range), "expected [low, high] with low < high")
        funcs, weights = self.reward_funcs, self.reward_weights
        _require(all(isinstance(f, str) and f.strip() for f in funcs), "task.reward_funcs", list(funcs),
                 "each an import path (my_pkg.rewards:accuracy) or an entry-point name")
        _require(not weights or len(weights) == len(funcs), "task.reward_weights", list(weights),
                 f"one weight per reward function ({len(funcs)} in task.reward_funcs), or none for all 1.0")
        _require(all(abs(w) < float("inf") for w in weights), "task.reward_weights", list(weights),
                 "weights must be finite")
        _require(not self.pass_on or bool(funcs), "task.pass_on", self.pass_on,
                 "names one of task.reward_funcs, and there are none")
        _require(self.remote_timeout_s > 0, "task.remote_timeout_s", self.remote_timeout_s, "must be > 0")
        _require(self.remote_retries >= 0, "task.remote_retries", self.remote_retries, "must be >= 0")


@dataclass(frozen=True)
class InterruptConfig(Section):
    """ScaleRL forced interruptions: a sample still going at its thinking budget (drawn uniformly per
    sample from [min_tokens, max_tokens]) gets `text` appended and `answer_tokens` more to answer."""

    enabled: bool = opt(False, "interrupt training samples that reach their thinking budget")
    min_tokens: int = opt(0, "smallest thinking budget (tokens); required (>= 1) when enabled")
    max_tokens: int = opt(0, "largest thinking budget (tokens); required (>= min_tokens) when enabled")
    text: str = opt("\n\nOkay, time is up. Let me give my final answer now.\n\n", "injected; never trained on")
    answer_tokens: int = opt(0, "budget after the interruption (tokens); required (>= 1) when enabled")
    eval: bool = opt(False, "interrupt eval groups too (pass rate under the same thinking budget)")


@dataclass(frozen=True)
class OverlongConfig(Section):
    """DAPO overlong penalty on training rewards, the alternative to interruptions: a completion of L
    tokens gets min(0, (sampling.max_tokens - buffer_tokens - L) / buffer_tokens) added to its reward."""

    enabled: bool = opt(False, "shape the rewards of training samples (eval rewards never)")
    buffer_tokens: int = opt(0, "L_cache: the penalty falls from 0 to -1 over these last tokens; required when enabled")


@dataclass(frozen=True)
class SamplingConfig(Section):
    """How actors sample each prompt group (travels inside every PromptGroup)."""

    n: int = opt(8, "samples per prompt")
    temperature: float = opt(1.0, "behavior temperature; the learner uses the same one")
    top_p: float = opt(1.0, "nucleus sampling (1.0 keeps the exact behavior policy)")
    max_tokens: int = opt(1024, "completion token budget (interruption text and answer included)")
    interrupt: InterruptConfig = field(default_factory=InterruptConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)

    def check(self) -> None:
        _require(self.n >= 2, "sampling.n", self.n, "group-relative advantages need at least 2 samples")
        _require(self.temperature > 0, "sampling.temperature", self.temperature, "must be > 0")
        _require(0 < self.top_p <= 1, "sampling.top_p", self.top_p, "must be in (0, 1]")
        _require(self.max_tokens >= 1, "sampling.max_tokens", self.max_tokens, "must be >= 1")
        self.check_length_control()

    def check_length_control(self) -> None:
        """Interruptions or the overlong penalty, each enabled one's keys fitting sampling.max_tokens."""
        it, ol = self.interrupt, self.overlong
        _require(not (it.enabled and ol.enabled), "sampling.overlong.enabled", ol.enabled,
                 "interruptions and the overlong penalty are alternatives: enable one of them")
        if it.enabled:
            _require(it.min_tokens >= 1, "sampling.interrupt.min_tokens", it.min_tokens, "must be >= 1")
            _require(it.max_tokens >= it.min_tokens, "sampling.interrupt.max_tokens", it.max_tokens,
                     f"must be >= sampling.interrupt.min_tokens = {it.min_tokens}")
            _require(it.answer_tokens >= 1, "sampling.interrupt.answer_tokens", it.answer_tokens, "must be >= 1")
            _require(bool(it.text), "sampling.interrupt.text", it.text, "must not be empty")
            # the text's token count is known once tokenized: the learner checks the exact sum then
            _require(it.max_tokens + it.answer_tokens < self.max_tokens, "sampling.interrupt.max_tokens",
                     it.max_tokens, f"+ answer_tokens {it.answer_tokens} + the text's tokens must fit "
                     f"sampling.max_tokens {self.max_tokens}")
        if ol.enabled:
            _require(1 <= ol.buffer_tokens < self.max_tokens, "sampling.overlong.buffer_tokens", ol.buffer_tokens,
                     f"must be in [1, sampling.max_tokens = {self.max_tokens})")


@dataclass(frozen=True)
class EnvConfig(Section):
    """Episodes of several turns (tasks that define an Environment): their budgets and tool calls.
    An episode's tokens, the environment's and tools' included, stay within sampling.max_tokens."""

    max_turns: int = opt(8, "model turns per episode (one that calls tools counts); the environment may set fewer")
    step_timeout_s: float = opt(60.0, "an environment's start or step that takes longer fails its episode (reward 0)")
    tool_parser: str = opt("hermes", "vLLM's tool-call parser for the model's format (hermes, pythonic, llama3_json, "
                                     "...)")
    max_tool_calls: int = opt(4, "tool calls run per model turn; more are answered with an error")
    tool_timeout_s: float = opt(10.0, "a tool call that takes longer is answered with an error")
    tool_output_chars: int = opt(2000, "a tool's output beyond this is cut, and the model told how much was cut")
    kwargs: dict[str, Any] = opt({}, "options of the task's environment (its self.kwargs)")

    def check(self) -> None:
        # each turn after the first adds one span of injected tokens, and a sample carries at most 1024
        _require(1 <= self.max_turns <= 1000, "env.max_turns", self.max_turns, "must be in [1, 1000]")
        _require(self.max_tool_calls >= 0, "env.max_tool_calls", self.max_tool_calls, "must be >= 0")
        for key in ("step_timeout_s", "tool_timeout_s"):
            _require(getattr(self, key) > 0, f"env.{key}", getattr(self, key), "must be > 0")
        _require(self.tool_output_chars >= 1, "env.tool_output_chars", self.tool_output_chars, "must be >= 1")


@dataclass(frozen=True)
class VllmConfig(Section):
    """Settings of each actor's vLLM engine (vLLM's AsyncEngineArgs)."""

    gpu_memory_utilization: float = opt(0.9, "fraction of each GPU's memory the engine may take (weights + KV cache)")
    tensor_parallel_size: int = opt(1, "GPUs one engine shards the model over")
    max_model_len: int = opt(0, "longest prompt + completion the engine accepts; 0 = the model's own")
    cpu_linear: CpuLinear = opt(CpuLinear.packed, "vLLM's CPU backend only: \"packed\" re-lays each linear layer's "
                                                  "weight out for its GEMM kernel (faster generation; every weight "
                                                  'update re-packs them all), "plain" keeps the weights as loaded (an '
                                                  "update is copies in place, a shorter pause; generation somewhat "
                                                  "slower)")
    engine_kwargs: dict[str, Any] = opt({}, "any other AsyncEngineArgs field, e.g. {enable_chunked_prefill: true, "
                                            "swap_space: 8}")

    def check(self) -> None:
        _require(self.tensor_parallel_size >= 1, "actor.vllm.tensor_parallel_size", self.tensor_parallel_size,
                 "must be >= 1")
        _require(0 < self.gpu_memory_utilization <= 1, "actor.vllm.gpu_memory_utilization",
                 self.gpu_memory_utilization, "must be in (0, 1]")
        _require(self.max_model_len >= 0, "actor.vllm.max_model_len", self.max_model_len,
                 "must be >= 0 (0 = the model's)")
        taken = sorted(set(self.engine_kwargs) & set(TIDAL_ENGINE_ARGS))
        _require(not taken, "actor.vllm.engine_kwargs", taken,
                 "tidal sets these engine arguments itself (use the actor.* / actor.vllm.* keys where there is one)")
        # an engine's data-parallel replicas would each need ranks in its weight group and their own updates
        _require(self.engine_kwargs.get("data_parallel_size", 1) == 1, "actor.vllm.engine_kwargs.data_parallel_size",
                 self.engine_kwargs.get("data_parallel_size"),
                 "an actor runs one engine replica: scale with actor.replicas (each joins and leaves on its own)")


CPU_LINEAR_LAYOUTS = tuple(choices(CpuLinear))

# engine arguments tidal sets itself: its correctness depends on them
TIDAL_ENGINE_ARGS = ("model", "dtype", "seed", "logprobs_mode", "worker_extension_cls", "enable_prefix_caching",
                     "max_num_seqs", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len",
                     "enforce_eager", "weight_transfer_config")
CORES_PATTERN = r"\d+(-\d+)?(,\d+(-\d+)?)*"


@dataclass(frozen=True)
class ActorConfig(Section):
    """One vLLM engine per actor process."""

    replicas: int = opt(1, "actor processes the launcher starts")
    index: int = opt(0, "this actor's number: its sampling seed is actor.seed + index; the launcher sets it")
    id: str = opt("", "this actor's id, unique among live actors; empty = actor-<index>")
    max_inflight: int = opt(256, "samples the engine generates at once (its max_num_seqs; samples, not groups)")
    max_queued: int = opt(-1, "samples the actor takes beyond actor.max_inflight, waiting in the engine's queue to "
                              "start once a running one finishes: a group holds its slots until its longest sample is "
                              "done, so without a queue a long-tailed batch leaves the engine below max_inflight (the "
                              "long task's actor generated 0.8x the tokens/s of vLLM fed every request at once; with "
                              "as many queued, 0.99x). -1: as many as max_inflight")
    kv_cache_gib: float = opt(1.0, "CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)")
    enforce_eager: bool = opt(True, "skip graph capture (CPU and debugging)")
    cpu_cores: str = opt("", "cores for the engine's OpenMP threads, e.g. \"1\" or \"0-1\"; empty = auto")
    heartbeat_s: float = opt(1.0, "seconds between heartbeats to the learner")
    seed: int = opt(0, "sampling seed (offset by actor.index)")
    max_restarts: int = opt(5, "the launcher restarts a dead actor this many times (per actor) before giving up")
    restart_backoff_s: float = opt(1.0, "first restart delay; doubles per restart of the same actor, up to 30 s")
    health_file: str = opt("", "touched every heartbeat, for liveness probes (`tidal health FILE`); empty = off")
    gpus_per_replica: int = opt(-1, "GPUs of each actor (`tidal run` sets CUDA_VISIBLE_DEVICES); -1 = "
                                    "actor.vllm.tensor_parallel_size where the machine has GPUs, none where it has "
                                    "not; 0 = none")
    colocate: bool = opt(False, "share the learner's GPUs instead of taking GPUs of their own (one machine, too few "
                                "GPUs): give the engines a memory share that leaves the learner room "
                                "(actor.vllm.gpu_memory_utilization)")
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def check(self) -> None:
        _require(self.replicas >= 1, "actor.replicas", self.replicas, "must be >= 1")
        _require(self.index >= 0, "actor.index", self.index, "must be >= 0")
        _require(self.max_queued >= -1, "actor.max_queued", self.max_queued,
                 "must be >= 0, or -1 for as many as actor.max_inflight")
        self.vllm.check()
        tp = self.vllm.tensor_parallel_size
        _require(self.gpus_per_replica in (-1, 0) or self.gpus_per_replica >= tp, "actor.gpus_per_replica",
                 self.gpus_per_replica, f"-1 (auto), 0 (CPU) or at least actor.vllm.tensor_parallel_size = {tp}")
        _require(not self.cpu_cores or re.fullmatch(CORES_PATTERN, self.cpu_cores) is not None, "actor.cpu_cores",
                 self.cpu_cores, "expected core ids like 1, 0-3 or 0,2-3 (empty: vLLM picks)")


@dataclass(frozen=True)
class ZmqConfig(Section):
    """ZeroMQ endpoints; ports 0 are chosen free by the launcher."""

    host: str = opt("127.0.0.1", "address the learner binds and actors connect to")
    control_port: int = opt(0, "ROUTER: hello, heartbeats, work requests, prompt grants")
    rollout_port: int = opt(0, "PULL: rollout groups from actors")
    weights_port: int = opt(0, "PUB: weight announcements")
    rollout_hwm: int = opt(64, "rollouts the learner holds unread per actor connection (messages); beyond it they wait "
                               "in the actor")
    rollout_buffer_bytes: int = opt(512 * 1024 * 1024, "rollout_hwm in bytes: fewer rollouts are held when rollout_hwm "
                                                       "frames of broker.max_message_bytes would be more than this "
                                                       "(the socket counts frames, so its mark is this / "
                                                       "broker.max_message_bytes, at least 1)")
    control_hwm: int = opt(16, "control messages (hellos, heartbeats, work requests; each at most "
                               "broker.max_control_bytes) the learner holds unread per connection; its I/O thread "
                               "reads them as they come")
    curve: Curve = opt(Curve.auto, "CURVE encryption and authentication (each actor's id bound to its key). `tidal "
                                   "run` always turns it on (with keys of its own in run_dir/keys when keys_dir is "
                                   "empty) and refuses off. A role started on its own: auto = on when keys_dir is "
                                   "named or broker.zmq.host is beyond loopback; off = anyone who reaches the ports is "
                                   "trusted as any actor (tests, and one-machine setups that accept that)")
    keys_dir: str = opt("", "CURVE keys, made by `tidal keys DIR --actors ...`; a role started alone with CURVE on "
                            "needs it")

    def check(self) -> None:
        # keys_dir is not required here: `tidal run` makes keys of its own, and a role started alone with CURVE on
        # and no keys fails before it builds anything (tidal.cli), naming broker.zmq.keys_dir
        for key in ("rollout_hwm", "control_hwm"):
            _require(getattr(self, key) >= 1, f"broker.zmq.{key}", getattr(self, key),
                     "must be >= 1 (0 would mean no bound)")


@dataclass(frozen=True)
class RedisConfig(Section):
    """Redis Streams: durable, at-least-once, multi-node. Secrets never live in the config:
    the password comes from the environment variable named by `password_env`."""

    url: str = opt("redis://127.0.0.1:6379/0", "redis:// or rediss:// (TLS); may carry a user name")
    username: str = opt("", "ACL user (overrides the URL's); e.g. one for actors, one for the learner")
    password_env: str = opt("TIDAL_REDIS_PASSWORD", "environment variable holding the password (unset = none)")
    ca_file: str = opt("", "TLS: CA bundle to verify the server (rediss:// URLs)")
    prefix: str = opt("tidal", "stream keys are <prefix>:<run name>:{prompts,rollouts,weights,heartbeats,dead}")
    claim_idle_ms: int = opt(60_000, "a prompt pending this long at a silent actor is taken over by another")
    max_deliveries: int = opt(3, "entries delivered more often go to the dead-letter stream")
    block_ms: int = opt(250, "longest blocking read")
    reconnect_timeout_s: float = opt(120.0, "give up (fail loudly) when Redis stays away this long")
    embedded: bool = opt(False, "`tidal run` starts a local redis-server (AOF on) in the run directory")
    embedded_port: int = opt(0, "port of the embedded server; 0 = a free one")

    def check(self) -> None:
        _require(self.url.startswith(("redis://", "rediss://", "unix://")), "broker.redis.url", redact_uri(self.url),
                 "expected redis://, rediss:// (TLS) or unix://")
        _require(not self.ca_file or self.url.startswith("rediss://"), "broker.redis.ca_file", self.ca_file,
                 "a CA bundle verifies TLS: use a rediss:// URL")
        _require(self.max_deliveries >= 1, "broker.redis.max_deliveries", self.max_deliveries, "must be >= 1")
        _require(self.claim_idle_ms >= 1, "broker.redis.claim_idle_ms", self.claim_idle_ms, "must be >= 1")


@dataclass(frozen=True)
class BrokerConfig(Section):
    """Transport between the learner and the actors."""

    type: BrokerType = opt(BrokerType.zmq, "zmq (embedded, no server) | redis (durable, multi-node)")
    max_message_bytes: int = opt(64 * 1024 * 1024, "frames above this are rejected and counted")
    max_control_bytes: int = opt(4 * 1024 * 1024, "hellos, heartbeats and work requests above this are refused")
    max_actors: int = opt(1024, "live actor ids at once; hellos beyond are refused")
    actor_timeout_s: float = opt(10.0, "an actor silent this long counts as gone (zmq: its groups are re-dispatched)")
    zmq: ZmqConfig = field(default_factory=ZmqConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)

    def check(self) -> None:
        """Both transports' keys, whichever broker.type picks: a bad broker.redis.url fails a zmq run too,
        as it always has (a preset switched to redis must not start failing)."""
        for key in ("max_message_bytes", "max_control_bytes", "max_actors"):
            _require(getattr(self, key) >= 1, f"broker.{key}", getattr(self, key), "must be >= 1")
        self.zmq.check()
        frame = self.max_message_bytes
        _require(self.zmq.rollout_buffer_bytes >= frame, "broker.zmq.rollout_buffer_bytes",
                 self.zmq.rollout_buffer_bytes, f"must hold a frame of broker.max_message_bytes = {frame}")
        self.redis.check()


@dataclass(frozen=True)
class WeightsConfig(Section):
    """The weight channel: how each new policy version reaches the actors."""

    dir: str = opt("", "where weight files are written; empty = a folder of this run's own in /dev/shm")
    keep: int = opt(3, "versions kept (files, or the network channels' buffers); older ones are deleted (fewer than 2 "
                       "count as 2: an actor may still be reading the previous one)")
    transport: WeightTransport = opt(
        WeightTransport.file,
        "file: a safetensors file per version in weights.dir; tcp: each actor pulls every version from the learner's "
        "memory; nccl (GPU) | gloo (CPU): each vLLM worker receives every version by broadcast")
    tcp_host: str = opt("127.0.0.1", "the network channels (tcp, nccl, gloo): the interface the learner serves weights "
                                     "on (0.0.0.0: every interface)")
    tcp_port: int = opt(0, "the learner's port for weights (control, for nccl/gloo); 0 = any free port (announced)")
    tcp_advertise: str = opt("", "the host actors dial; empty = tcp_host (this machine's name when it is 0.0.0.0)")
    bucket_mib: int = opt(64, "a version is checked (and over the network sent) in byte ranges of this size")
    tcp_timeout_s: float = opt(30.0, "an actor gives up on a learner that sends nothing for this long")
    tcp_prefetch: bool = opt(True, "tcp: fetch a version before pausing the engine, not in it (nccl, gloo: every "
                                   "version is received in the pause, each piece loaded as it lands)")
    max_sends: int = opt(2, "nccl, gloo: versions the learner sends at once (to that many actors); nccl holds 2 GPU "
                            "buffers of a bucket plus the largest tensor for each")
    max_connections: int = opt(256, "connections the learner's weight port serves at once, a thread each (tcp: fetches "
                                    "in flight; gloo, nccl: one per joined actor for the whole run, plus its workers' "
                                    "brief rendezvous ones); more are told to retry")

    def check(self) -> None:
        """The transport selects the keys that matter: the network channels' (tcp_*, max_*) only for tcp, gloo
        and nccl. tidal.broker.weights checks again as it builds a channel from a config made in code."""
        _require(self.transport in choices(WeightTransport), "weights.transport", self.transport,
                 f"expected one of {', '.join(choices(WeightTransport))}")
        _require(self.keep >= 1, "weights.keep", self.keep, "must be >= 1 (fewer than 2 count as 2)")
        _require(self.bucket_mib >= 1, "weights.bucket_mib", self.bucket_mib, "must be >= 1")  # every channel's ranges
        if self.transport == WeightTransport.file:
            return
        _require(self.tcp_timeout_s > 0, "weights.tcp_timeout_s", self.tcp_timeout_s, "must be > 0")
        _require(0 <= self.tcp_port < 65536, "weights.tcp_port", self.tcp_port,
                 "must be in 0..65535 (0: any free port)")
        _require(self.max_sends >= 1, "weights.max_sends", self.max_sends, "must be >= 1")
        _require(self.max_connections >= 1, "weights.max_connections", self.max_connections, "must be >= 1")


@dataclass(frozen=True)
class StalenessConfig(Section):
    """Bound on how old (in optimizer steps) a trained token's policy may be."""

    max_lag: int = opt(8, "k; 0 = synchronous")
    on_violation: OnViolation = opt(
        OnViolation.drop_group,
        "tokens older than k: drop_group (the whole group) | mask_tokens (out of the loss) | keep (train anyway)")

    def check(self) -> None:
        _require(self.max_lag >= 0, "staleness.max_lag", self.max_lag, "must be >= 0")


@dataclass(frozen=True)
class CurriculumConfig(Section):
    """No-positive-resampling: the coordinator stops dispatching prompts the policy solves."""

    enabled: bool = opt(True, "track each training prompt's pass rate and retire solved prompts")
    retire_pass_rate: float = opt(0.9, "retire a prompt once this fraction of its samples pass (reward >= "
                                       "task.pass_threshold)")
    min_samples: int = opt(8, "a prompt is judged once this many of its samples arrived since its last judgement")

    def check(self) -> None:
        _require(0 < self.retire_pass_rate <= 1, "curriculum.retire_pass_rate", self.retire_pass_rate,
                 "must be in (0, 1]; set curriculum.enabled=false to keep every prompt")
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


@dataclass(frozen=True)
class OptimConfig(Section):
    """AdamW and its learning-rate schedule."""

    lr: float = opt(1e-6, "AdamW learning rate (after warmup); for a pretrained model of 0.5B+ (presets set their own)")
    betas: tuple[float, float] = opt((0.9, 0.99), "AdamW betas")
    eps: float = opt(1e-8, "AdamW epsilon")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    warmup_steps: int = opt(0, "linear warmup steps")
    schedule: LrSchedule = opt(LrSchedule.constant, "after warmup: constant, or a cosine / linear decay that reaches "
                                                    "lr * min_lr_ratio at learner.max_steps")
    min_lr_ratio: float = opt(0.0, "the decayed schedules' floor, as a fraction of the peak lr")
    max_grad_norm: float = opt(1.0, "clip; 0 disables")
    lr_scaling: LrScaling = opt(LrScaling.none, "sqrt: lr = optim.lr * sqrt(learner.groups_per_step / "
                                                "ref_groups_per_step)")
    ref_groups_per_step: int = opt(0, "B_ref, the groups per step at which optim.lr was tuned (lr_scaling=sqrt needs "
                                      "it)")

    def check(self) -> None:
        _require(self.lr > 0, "learner.optim.lr", self.lr, "must be > 0")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "learner.optim.min_lr_ratio", self.min_lr_ratio,
                 "a fraction of the peak lr, in [0, 1]")
        _require(self.lr_scaling is LrScaling.none or self.ref_groups_per_step >= 1,
                 "learner.optim.ref_groups_per_step", self.ref_groups_per_step,
                 "lr_scaling=sqrt needs the groups per step at which optim.lr was tuned (>= 1)")


@dataclass(frozen=True)
class FsdpConfig(Section):
    """The policy sharded over the learner's ranks (torch FSDP2): parameters, gradients and AdamW state
    each live on one rank, so a model too large for one device trains on several."""

    enabled: bool = opt(False, "shard each decoder layer and the rest of the model; off = every rank holds it all")
    reshard_after_forward: bool = opt(True, "free gathered layers after forward (less memory, gathered again in "
                                            "backward)")
    activation_checkpointing: bool = opt(False, "recompute each decoder layer's activations in the backward pass")
    cpu_offload: bool = opt(False, "keep sharded parameters, gradients and AdamW state in host memory (GPU only)")
    replicate_over_nodes: bool = opt(True, "with learner.nodes > 1: shard within each machine and replicate across "
                                           "machines (HSDP), so the layers' gathers stay on the machine's own links "
                                           "and only the gradients cross between machines")


@dataclass(frozen=True)
class LearnerConfig(Section):
    """The training loop: step batches, loss, optimizer, weight publishing."""

    groups_per_step: int = opt(16, "prompt groups in one optimizer step")
    max_steps: int = opt(100, "optimizer steps of the run")
    num_ranks: int = opt(1, "learner processes in all; `tidal run` / `tidal learner` start them with torchrun (rank 0 "
                            "talks to the actors)")
    nodes: int = opt(1, "machines the ranks span, learner.num_ranks / nodes on each (one `tidal learner` per machine)")
    node_rank: int = opt(0, "this machine's place among learner.nodes (a StatefulSet pod's ordinal); node 0 holds rank "
                            "0")
    master_addr: str = opt("", "node 0's address, where the ranks meet; empty = this machine (learner.nodes = 1)")
    master_port: int = opt(29500, "node 0's port for the ranks' rendezvous (tidal run picks a free one on one machine)")
    gpus: int = opt(-1, "GPUs of the learner, one per rank (`tidal run` sets CUDA_VISIBLE_DEVICES); -1 = "
                        "learner.num_ranks where the machine has GPUs, none where it has not; 0 = none (train on CPU)")
    micro_batch_tokens: int = opt(8192, "padded tokens (rows x longest row) of one forward/backward micro-batch")
    advantage_norm: AdvantageNorm = opt(AdvantageNorm.batch, "how group-centred advantages are scaled")
    zero_variance_filter: bool = opt(True, "drop groups whose rewards are all equal")
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    kernel_backend: KernelBackend = opt(KernelBackend.auto, "logprob kernel")
    param_dtype: Dtype = opt(Dtype.float32, "master weights and AdamW state; keep float32: in bfloat16 updates below "
                                            "its resolution vanish")
    mixed_precision: MixedPrecision = opt(
        MixedPrecision.no,
        "forward/backward compute through Accelerate's autocast: no (in param_dtype), bf16 or fp16; the LM head stays "
        "fp32")
    attention: Attention = opt(Attention.auto, "auto: flash_attention_2 on CUDA where flash-attn is installed, sdpa "
                                               "elsewhere")
    packing: Packing = opt(Packing.auto, "micro-batches packed end to end without padding (variable-length attention), "
                                         "padded per micro-batch, or shared: a prompt group's prompt computed once "
                                         "with all its completions after it (not with flash-attn); auto: packed under "
                                         "flash_attention_2, otherwise padded or shared, whichever computes less each "
                                         "step")
    torch_threads: int = opt(1, "intra-op threads of the learner")
    rollout_timeout_s: float = opt(600.0, "no rollout for this long means the actors are gone: the learner fails")
    dist_timeout_s: float = opt(7200.0, "the learner ranks' process group timeout: a rank waits this long in a "
                                        "collective while rank 0 is busy elsewhere (waiting for rollouts, the final "
                                        "evaluation, writing a checkpoint) before the group gives up")
    health_file: str = opt("", "touched while the loop makes progress, for liveness probes; empty = off")
    seed: int = opt(0, "torch seed")

    def check(self) -> None:
        _require(self.groups_per_step >= 1, "learner.groups_per_step", self.groups_per_step, "must be >= 1")
        _require(self.max_steps >= 1, "learner.max_steps", self.max_steps, "must be >= 1")
        _require(self.num_ranks >= 1, "learner.num_ranks", self.num_ranks, "must be >= 1")
        minibatches = self.loss.minibatches_per_step
        _require(self.groups_per_step >= self.num_ranks * minibatches, "learner.groups_per_step", self.groups_per_step,
                 f"every rank needs a group in every mini-batch: at least learner.num_ranks ({self.num_ranks}) x "
                 f"learner.loss.minibatches_per_step ({minibatches})")
        _require(1 <= minibatches <= self.groups_per_step, "learner.loss.minibatches_per_step", minibatches,
                 f"must be in [1, learner.groups_per_step = {self.groups_per_step}]")
        _require(self.micro_batch_tokens >= 1, "learner.micro_batch_tokens", self.micro_batch_tokens, "must be >= 1")
        _require(self.gpus in (-1, 0, self.num_ranks), "learner.gpus", self.gpus,
                 f"one GPU per rank: -1 (auto), 0 (CPU) or learner.num_ranks = {self.num_ranks}")
        _require(self.dist_timeout_s >= self.rollout_timeout_s, "learner.dist_timeout_s", self.dist_timeout_s,
                 f"must be >= learner.rollout_timeout_s = {self.rollout_timeout_s}: the other ranks wait in a "
                 "collective while rank 0 waits for rollouts")
        self.check_placement()
        self.check_numerics()
        self.loss.check()
        self.optim.check()

    def check_placement(self) -> None:
        """The ranks over machines, and sharding over the ranks."""
        _require(self.nodes >= 1 and self.num_ranks % self.nodes == 0, "learner.nodes", self.nodes,
                 f"must be >= 1 and divide learner.num_ranks = {self.num_ranks} (the same number of ranks on each "
                 "machine)")
        _require(0 <= self.node_rank < self.nodes, "learner.node_rank", self.node_rank,
                 f"must be in [0, learner.nodes = {self.nodes})")
        _require(self.nodes == 1 or self.master_addr, "learner.master_addr", self.master_addr,
                 "the learner spans several machines (learner.nodes > 1): name node 0's address")
        _require(not self.fsdp.enabled or self.num_ranks >= 2, "learner.fsdp.enabled", self.fsdp.enabled,
                 "sharding needs learner.num_ranks >= 2 (one rank holds the whole model anyway)")

    def check_numerics(self) -> None:
        """Precision, attention and the micro-batch layout that go together."""
        _require(not self.fsdp.enabled or self.mixed_precision != MixedPrecision.fp16, "learner.mixed_precision",
                 self.mixed_precision,
                 "a sharded learner (learner.fsdp.enabled) computes in bf16 or the parameters' dtype, not fp16")
        flash = self.attention == Attention.flash_attention_2
        _require(not flash or compute_dtype(self) != Dtype.float32, "learner.attention", self.attention,
                 "flash-attn computes in bf16 or fp16 only: set learner.mixed_precision=bf16 or learner.attention=sdpa")
        # the same rule as the trainer's (learner/trainer.py), which also sees attention=auto resolved to flash-attn
        _require(not flash or self.packing != Packing.shared, "learner.packing", self.packing,
                 "shared needs attention that takes a mask; flash_attention_2 does not: use learner.attention=sdpa "
                 "or learner.packing=packed")


@dataclass(frozen=True)
class EvalConfig(Section):
    """Evaluation on the held-out prompts."""

    every: int = opt(10, "optimizer steps between evaluations (0 = only at start and end)")
    n: int = opt(4, "samples per held-out prompt (mean@n pass rate)")
    temperature: float = opt(1.0, "eval sampling temperature")


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """The learner's checkpoints in run_dir, the state a run resumes from."""

    every: int = opt(0, "optimizer steps between checkpoints (0 = only at the end)")
    keep: int = opt(2, "checkpoints kept on disk")


@dataclass(frozen=True)
class TrackingConfig(Section):
    """MLflow tracking and the learner's progress lines."""

    uri: str = opt("", "MLflow tracking URI; empty = $MLFLOW_TRACKING_URI, else sqlite:///<run_dir>/mlflow.db")
    experiment: str = opt("", 'MLflow experiment name; empty = $MLFLOW_EXPERIMENT_NAME, else "tidal"')
    parent_run_id: str = opt("", "the MLflow run this run is a child of (tidal sweep sets it)")
    system_metrics_interval_s: float = opt(10.0, "CPU, memory, disk, network and (where nvidia-ml-py finds GPUs) GPU "
                                                 "metrics every this many seconds, as system/* metrics of the "
                                                 "learner's run; 0 = none")
    eval_completions: int = opt(64, "sample completions logged as a table at every evaluation; 0 = none")
    log_model: bool = opt(False, "also log the final exported model folder (run_dir/model) to MLflow, as artifacts")
    log_every_steps: int = opt(1, "one line in the learner's log every this many steps (step, reward, pass rate, loss, "
                                  "lag, tokens/s over the recent window, time per step), so `kubectl logs -f` shows "
                                  "progress; 0 = none")
    rollout_table_every: int = opt(25, "a table of sampled training rollouts (prompt, completion, reward and its "
                                       "components, advantage, versions, lag) in MLflow every this many steps; 0 = "
                                       "none")
    rollout_table_rows: int = opt(16, "rollouts in each such table")

    def check(self) -> None:
        _require(self.system_metrics_interval_s >= 0, "tracking.system_metrics_interval_s",
                 self.system_metrics_interval_s, "must be >= 0 (0 = no system metrics)")
        _require(self.eval_completions >= 0, "tracking.eval_completions", self.eval_completions,
                 "must be >= 0 (0 = no table)")


@dataclass(frozen=True)
class RunConfig(Section):
    """The whole run. Components receive only their own part."""

    name: str = opt("tidal", "run name (MLflow run name, weight dir name)")
    run_dir: str = opt("", "output folder; empty = runs/<name>-<timestamp>")
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

    def check(self) -> None:
        """Each section's own rules, in the order of the tree, then the rules that span sections."""
        for part in dataclasses.fields(self):
            value = getattr(self, part.name)
            if isinstance(value, Section):
                value.check()
        for rule in CROSS_SECTION_RULES:
            rule(self)


# ---- rules that span sections, each a named check ---------------------------------------------

def check_actor_holds_a_group(cfg: RunConfig) -> None:
    _require(cfg.actor.max_inflight >= cfg.sampling.n, "actor.max_inflight", cfg.actor.max_inflight,
             f"must hold at least one group (sampling.n = {cfg.sampling.n})")


def check_colocated_weights(cfg: RunConfig) -> None:
    _require(not (cfg.actor.colocate and cfg.weights.transport == WeightTransport.nccl), "actor.colocate",
             cfg.actor.colocate, "actors on the learner's GPUs cannot take weights by nccl (NCCL refuses two ranks "
             "of one communicator on one GPU): use weights.transport=tcp or file")


CROSS_SECTION_RULES = (check_actor_holds_a_group, check_colocated_weights)


# OmegaConf's words for a value outside an Enum field's set
OUTSIDE_CLOSED_SET = re.compile(r"Invalid value '.*', expected one of \[(.*)\]")


def _one_line(err: OmegaConfBaseException) -> str:
    """OmegaConf errors span several lines with a 'full_key' entry; keep the key and the reason
    (a value outside a closed set reads like the checks': the key, the value, the choices)."""
    key = getattr(err, "full_key", None) or getattr(err, "key", None)
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    outside = OUTSIDE_CLOSED_SET.fullmatch(reason)
    if key and outside and hasattr(err, "value"):
        return f"config key '{key}' = {err.value!r}: expected one of {outside.group(1)}"
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
    cfg.check()
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
    - weights.dir: the run's own folder in /dev/shm when empty (default_weights_dir)
    - broker.redis.url: `redis_url` when given (an embedded redis-server's)
    - actor.id, in an actor's own process (`actor=True`): actor-<actor.index> when empty
    """
    import time

    run_dir = Path(cfg.run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    broker = cfg.broker if redis_url is None else replace(cfg.broker, redis=replace(cfg.broker.redis, url=redis_url))
    actor_cfg = replace(cfg.actor, id=cfg.actor.id or f"actor-{cfg.actor.index}") if actor else cfg.actor
    return replace(
        cfg, run_dir=str(run_dir), broker=broker, actor=actor_cfg,
        model=cfg.model if model_path is None else replace(cfg.model, path=model_path),
        weights=replace(cfg.weights, dir=cfg.weights.dir or default_weights_dir(cfg.name, run_dir)))


def default_weights_dir(run_name: str, run_dir: str | Path) -> str:
    """weights.dir when it is empty: a folder in /dev/shm of this run's own, so two runs never share (or
    prune) each other's files. The weight channel owns (and at the end removes) exactly this folder."""
    run_dir = Path(run_dir)
    run_key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return f"/dev/shm/tidal-{run_name}-{run_dir.name}-{run_key}"


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def write_config(cfg: RunConfig, run_dir: Path) -> None:
    """The resolved config in the run directory (what `tidal run` writes too), for resumes and `tidal export`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(to_yaml(cfg))
    tmp.replace(run_dir / "config.yaml")  # atomic: actors may be reading it


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


# ---- what the sections' values mean ------------------------------------------------------------

def compute_dtype(cfg: LearnerConfig) -> str:
    """The dtype the learner's forward and backward compute in: learner.mixed_precision's, else the
    master weights'."""
    return {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.mixed_precision, cfg.param_dtype)


def parse_cores(spec: str) -> list[int]:
    """A core list as actor.cpu_cores and taskset write it ("1", "0-3", "0,2-3"), as core ids."""
    cores = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def curve_on(cfg: ZmqConfig) -> bool:
    """CURVE is on when asked, and by default whenever keys are named or the learner binds beyond
    loopback (`tidal run` writes curve=on for its children)."""
    beyond_loopback = cfg.host not in LOOPBACK and not cfg.host.startswith("127.")
    return cfg.curve == Curve.on or (cfg.curve == Curve.auto and (bool(cfg.keys_dir) or beyond_loopback))


# keys whose words YAML 1.1 reads as booleans (on/off, yes/no): the words the schema expects for
# (false, true); None where a boolean has no word, so it fails as the wrong value it is
YAML_BOOLEAN_WORDS = {"broker.zmq.curve": ("off", "on"), "learner.mixed_precision": ("no", None)}


def yaml_words(layer):
    """A config layer with `curve: on` (parsed by YAML as True) given back as the word "on"."""
    if not isinstance(layer, DictConfig):
        return layer
    for key, words in YAML_BOOLEAN_WORDS.items():
        value = OmegaConf.select(layer, key, default=None)
        if isinstance(value, bool) and words[value] is not None:
            OmegaConf.update(layer, key, words[value], merge=False)
    return layer


# ---- asking the schema: `tidal config explain KEY` --------------------------------------------

def field_help(cls: type) -> dict[str, str]:
    """Each field's help, as the schema holds it (opt's); a section's is its class's summary."""
    import typing

    hints = typing.get_type_hints(cls)
    return {f.name: f.metadata.get("help") or summary(hints[f.name]) for f in dataclasses.fields(cls)}


def summary(cls) -> str:
    """The first paragraph of a section's docstring, on one line ("" for anything else)."""
    doc = (cls.__doc__ or "") if dataclasses.is_dataclass(cls) else ""
    if doc.startswith(f"{cls.__name__}("):  # what dataclass writes for a class without a docstring
        return ""
    return " ".join(doc.split("\n\n")[0].split())


def kind_of(hint) -> str:
    """A field's type as `explain` prints it: a closed set as its choices."""
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " | ".join(choices(hint))
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def describe(name: str, hint, default, help_text: str) -> str:
    """One key: `name (type, default value): help`; a section: `name (section): summary`."""
    if dataclasses.is_dataclass(hint):
        return f"{name} (section): {help_text}"
    shown = default.value if isinstance(default, enum.Enum) else default
    return f"{name} ({kind_of(hint)}, default {shown!r}): {help_text or '(no help)'}"


def explain(key: str) -> str:
    """What a config key is: its type, default and help; for a section (or the whole run), each of its keys."""
    import typing

    cls, default, parts = RunConfig, RunConfig(), [p for p in key.split(".") if p]
    for i, part in enumerate(parts):
        where = ".".join(parts[:i]) or "the top level"
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"config key '{where}' is a value, not a section: '{key}' does not exist")
        hints = typing.get_type_hints(cls)
        if part not in hints:
            known = ", ".join(f.name for f in dataclasses.fields(cls))
            raise ConfigError(f"config key '{'.'.join(parts[:i + 1])}' does not exist; {where} has: {known}")
        if i == len(parts) - 1 and not dataclasses.is_dataclass(hints[part]):
            return describe(key, hints[part], getattr(default, part), field_help(cls)[part])
        cls, default = hints[part], getattr(default, part)
    hints, helps = typing.get_type_hints(cls), field_help(cls)
    rows = [describe(f.name, hints[f.name], getattr(default, f.name), helps[f.name]) for f in dataclasses.fields(cls)]
    return "\n".join([f"{key or 'the whole run'}: {summary(cls)}", *(f"  {row}" for row in rows)])
