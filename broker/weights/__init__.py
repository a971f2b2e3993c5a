"""The weight channel: how each new policy version travels from the learner into every actor's engine.

    learner   WeightPublisher.publish(tensors, version) ──► WeightUpdate, announced by the broker
    actor     WeightReceiver.apply(update, engine)      ──► engine.swap_weights: pause(keep) → load → resume
    worker    load_in_worker(worker, transport, payload), inside each vLLM worker process

One module per transport holds all three sides (`file`: a safetensors file per version in a
folder both sides can read). The broker only carries the announcements, and they are the one
way an actor hears of new weights: a joining actor is sent the current one first.
"""
from __future__ import annotations

from tidal.broker.weights import file
from tidal.broker.weights.base import WeightPublisher, WeightReceiver
from tidal.config import WeightsConfig

TRANSPORTS = {"file": file}
default_dir = file.default_dir  # where a run's weights live when weights.dir is empty

__all__ = ["WeightPublisher", "WeightReceiver", "build_publisher", "build_receiver", "default_dir", "load_in_worker"]


def build_publisher(cfg: WeightsConfig, incarnation: str, run_name: str, run_dir: str,
                    dtype: str | None = None) -> WeightPublisher:
    """`incarnation` names the learner process, so actors tell a resumed learner's versions apart;
    weights travel in `dtype`, what the actors serve (model.dtype)."""
    return file.FilePublisher(cfg, incarnation, owns_dir=cfg.dir == default_dir(run_name, run_dir), dtype=dtype)


def build_receiver(cfg: WeightsConfig) -> WeightReceiver:
    return file.FileReceiver(cfg)


def load_in_worker(worker, transport: str, payload) -> float:
    """Runs in each vLLM worker process: loads one version by the announced transport's own means."""
    if transport not in TRANSPORTS:
        raise ValueError(f"weight update over unknown transport {transport!r}; known: {', '.join(TRANSPORTS)}")
    return TRANSPORTS[transport].load_in_worker(worker, payload)
