"""The weight channel: how each new policy version travels from the learner into every actor's engine.

    learner   WeightPublisher.publish(tensors, version) ──► WeightUpdate, announced by the broker
    actor     WeightReceiver.apply(update, engine)      ──► engine.swap_weights: pause(keep) → load → resume
    worker    load_in_worker(worker, transport, payload), inside each vLLM worker process

One module per transport holds all three sides (`file`: a safetensors file per version in a
folder both sides can read; `tcp`: each actor pulls every version from the learner's memory and
hands it to vLLM through vLLM's weight-transfer API; `gloo` and `nccl`, the collective channel:
each vLLM worker receives every version by broadcast from the learner, in a process group of its
own, through the same API). The broker only carries the announcements,
and they are the one way an actor hears of new weights: a joining actor is sent the current one first.
"""
from __future__ import annotations

from tidal.broker.weights import collective, file, tcp
from tidal.broker.weights.base import WeightPublisher, WeightReceiver
from tidal.config import WeightsConfig

TRANSPORTS = {"file": file, "tcp": tcp, **{backend: collective for backend in collective.BACKENDS}}
default_dir = file.default_dir  # where a run's weights live when weights.dir is empty

__all__ = ["WeightPublisher", "WeightReceiver", "build_publisher", "build_receiver", "default_dir", "load_in_worker",
           "serves_shards"]


def build_publisher(cfg: WeightsConfig, incarnation: str, run_name: str, run_dir: str,
                    dtype: str | None = None, local_rank: int = 0) -> WeightPublisher:
    """`incarnation` names the learner process, so actors tell a resumed learner's versions apart;
    weights travel in `dtype`, what the actors serve (model.dtype). `local_rank`: which of a
    machine's learner ranks serves (a sharded learner's, where every rank serves its part)."""
    transport = check_transport(cfg)
    if transport == "tcp":
        return tcp.TcpPublisher(cfg, incarnation, dtype=dtype)
    if transport in collective.BACKENDS:
        return collective.CollectivePublisher(cfg, incarnation, dtype=dtype, local_rank=local_rank)
    return file.FilePublisher(cfg, incarnation, owns_dir=cfg.dir == default_dir(run_name, run_dir), dtype=dtype)


def serves_shards(cfg: WeightsConfig) -> bool:
    """Whether each rank of a sharded learner serves its own part of every version (else rank 0
    gathers the model and publishes it whole)."""
    return cfg.transport in collective.BACKENDS


def build_receiver(cfg: WeightsConfig) -> WeightReceiver:
    """Its `vllm_backend` names the weight-transfer engine the actor's vLLM must be created with."""
    transport = check_transport(cfg)
    if transport in collective.BACKENDS:
        return collective.CollectiveReceiver(cfg)
    return tcp.TcpReceiver(cfg) if transport == "tcp" else file.FileReceiver(cfg)


def check_transport(cfg: WeightsConfig) -> str:
    """The configured transport's name, once its keys are known to be usable."""
    if cfg.transport not in TRANSPORTS:
        raise ValueError(f"config key 'weights.transport' = {cfg.transport!r}: expected one of {', '.join(TRANSPORTS)}")
    rules = {"bucket_mib": (cfg.bucket_mib >= 1, ">= 1"), "tcp_timeout_s": (cfg.tcp_timeout_s > 0, "> 0"),
             "tcp_port": (0 <= cfg.tcp_port < 65536, "in 0..65535 (0: any free port)")}
    for key, (ok, expected) in rules.items():
        if cfg.transport != "file" and not ok:  # the network channels' keys
            raise ValueError(f"config key 'weights.{key}' = {getattr(cfg, key)!r}: must be {expected}")
    return cfg.transport


def load_in_worker(worker, transport: str, payload) -> float:
    """Runs in each vLLM worker process: loads one version by the announced transport's own means."""
    if transport not in TRANSPORTS:
        raise ValueError(f"weight update over unknown transport {transport!r}; known: {', '.join(TRANSPORTS)}")
    return TRANSPORTS[transport].load_in_worker(worker, payload)
