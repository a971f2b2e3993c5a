"""actor.*: the actor processes and each one's vLLM engine (actor.vllm), and the core lists
actor.cpu_cores takes (parse_cores)."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

from tidal.config.base import Section, _require, choices, opt


# StrEnum: code outside the config reads it as its word (why: tidal/config/base.py)
class CpuLinear(enum.StrEnum):
    packed = "packed"
    plain = "plain"


class OnUpdate(enum.StrEnum):
    recompute = "recompute"
    keep = "keep"


@dataclass(frozen=True)
class VllmConfig(Section):
    """Settings of each actor's vLLM engine (vLLM's AsyncEngineArgs)."""

    gpu_memory_utilization: float = opt(0.9, "fraction of each GPU's memory the engine may take (weights + KV cache)")
    tensor_parallel_size: int = opt(1, "GPUs one engine shards the model over")
    max_model_len: int = opt(0, "longest prompt + completion the engine accepts; 0 = the model's own")
    cpu_linear: CpuLinear = opt(
        CpuLinear.packed,
        "vLLM's CPU backend only: \"packed\" re-lays each linear layer's "
        "weight out for its GEMM kernel (faster generation; every weight "
        'update re-packs them all), "plain" keeps the weights as loaded (an '
        "update is copies in place, a shorter pause; generation somewhat "
        "slower)",
    )
    engine_kwargs: dict[str, Any] = opt(
        {}, "any other AsyncEngineArgs field, e.g. {enable_chunked_prefill: true, swap_space: 8}"
    )

    def check(self) -> None:
        _require(
            self.tensor_parallel_size >= 1, "actor.vllm.tensor_parallel_size", self.tensor_parallel_size, "must be >= 1"
        )
        _require(
            0 < self.gpu_memory_utilization <= 1,
            "actor.vllm.gpu_memory_utilization",
            self.gpu_memory_utilization,
            "must be in (0, 1]",
        )
        _require(
            self.max_model_len >= 0, "actor.vllm.max_model_len", self.max_model_len, "must be >= 0 (0 = the model's)"
        )
        taken = sorted(set(self.engine_kwargs) & set(TIDAL_ENGINE_ARGS))
        _require(
            not taken,
            "actor.vllm.engine_kwargs",
            taken,
            "tidal sets these engine arguments itself (use the actor.* / actor.vllm.* keys where there is one)",
        )
        # an engine's data-parallel replicas would each need ranks in its weight group and their own updates
        _require(
            self.engine_kwargs.get("data_parallel_size", 1) == 1,
            "actor.vllm.engine_kwargs.data_parallel_size",
            self.engine_kwargs.get("data_parallel_size"),
            "an actor runs one engine replica: scale with actor.replicas (each joins and leaves on its own)",
        )


CPU_LINEAR_LAYOUTS = tuple(choices(CpuLinear))

# engine arguments tidal sets itself: its correctness depends on them
TIDAL_ENGINE_ARGS = (
    "model",
    "dtype",
    "seed",
    "logprobs_mode",
    "worker_extension_cls",
    "enable_prefix_caching",
    "max_num_seqs",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "max_model_len",
    "enforce_eager",
    "weight_transfer_config",
)
CORES_PATTERN = r"\d+(-\d+)?(,\d+(-\d+)?)*"


@dataclass(frozen=True)
class ActorConfig(Section):
    """One vLLM engine per actor process."""

    replicas: int = opt(1, "actor processes the launcher starts")
    index: int = opt(0, "this actor's number: its sampling seed is actor.seed + index; the launcher sets it")
    id: str = opt("", "this actor's id, unique among live actors; empty = actor-<index>")
    max_inflight: int = opt(256, "samples the engine generates at once (its max_num_seqs; samples, not groups)")
    max_queued: int = opt(
        -1,
        "samples the actor takes beyond actor.max_inflight, waiting in the engine's queue to "
        "start once a running one finishes: a group holds its slots until its longest sample is "
        "done, so without a queue a long-tailed batch leaves the engine below max_inflight (the "
        "long task's actor generated 0.8x the tokens/s of vLLM fed every request at once; with "
        "as many queued, 0.99x). -1: as many as max_inflight",
    )
    kv_cache_gib: float = opt(1.0, "CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)")
    on_update: OnUpdate = opt(
        OnUpdate.recompute,
        "what a weight update does to the requests running: recompute = their keys and values are "
        "dropped and recomputed under the new weights before they sample on (each update costs every "
        "running context again); keep = they keep them and sample on over keys the older weights "
        "computed (their tokens carry the version that sampled them and are corrected like any "
        "off-policy token), while every request started after the update is salted so that none "
        "reuses a cached prefix of older weights",
    )
    enforce_eager: bool = opt(True, "skip graph capture (CPU and debugging)")
    cpu_cores: str = opt("", 'cores for the engine\'s OpenMP threads, e.g. "1" or "0-1"; empty = auto')
    heartbeat_s: float = opt(1.0, "seconds between heartbeats to the learner")
    seed: int = opt(0, "sampling seed (offset by actor.index)")
    max_restarts: int = opt(5, "the launcher restarts a dead actor this many times (per actor) before giving up")
    restart_backoff_s: float = opt(1.0, "first restart delay; doubles per restart of the same actor, up to 30 s")
    health_file: str = opt("", "touched every heartbeat, for liveness probes (`tidal health FILE`); empty = off")
    gpus_per_replica: int = opt(
        -1,
        "GPUs of each actor (`tidal run` sets CUDA_VISIBLE_DEVICES); -1 = "
        "actor.vllm.tensor_parallel_size where the machine has GPUs, none where it has "
        "not; 0 = none",
    )
    colocate: bool = opt(
        False,
        "share the learner's GPUs instead of taking GPUs of their own (one machine, too few "
        "GPUs): give the engines a memory share that leaves the learner room "
        "(actor.vllm.gpu_memory_utilization)",
    )
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def check(self) -> None:
        _require(self.replicas >= 1, "actor.replicas", self.replicas, "must be >= 1")
        _require(self.index >= 0, "actor.index", self.index, "must be >= 0")
        _require(
            self.on_update in choices(OnUpdate),
            "actor.on_update",
            self.on_update,
            f"expected one of {', '.join(choices(OnUpdate))}",
        )
        _require(
            self.max_queued >= -1,
            "actor.max_queued",
            self.max_queued,
            "must be >= 0, or -1 for as many as actor.max_inflight",
        )
        self.vllm.check()
        tp = self.vllm.tensor_parallel_size
        _require(
            self.gpus_per_replica in (-1, 0) or self.gpus_per_replica >= tp,
            "actor.gpus_per_replica",
            self.gpus_per_replica,
            f"-1 (auto), 0 (CPU) or at least actor.vllm.tensor_parallel_size = {tp}",
        )
        _require(
            not self.cpu_cores or re.fullmatch(CORES_PATTERN, self.cpu_cores) is not None,
            "actor.cpu_cores",
            self.cpu_cores,
            "expected core ids like 1, 0-3 or 0,2-3 (empty: vLLM picks)",
        )


def parse_cores(spec: str) -> list[int]:
    """A core list as actor.cpu_cores and taskset write it ("1", "0-3", "0,2-3"), as core ids."""
    cores = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores
