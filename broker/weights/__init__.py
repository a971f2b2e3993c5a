"""The weight channel: how each new policy version travels from the learner into every actor's engine.

    learner   WeightPublisher.publish(tensors, version) ──► WeightUpdate, announced by the broker
    actor     WeightReceiver.apply(update, engine)      ──► engine: pause(keep) → vLLM's weight-transfer API → resume
    worker    tidal's weight-transfer engine (actor/weight_engine.py), inside each vLLM worker process

One module per channel holds its sides, registered here by name (`weights.transport`): `file`, a
safetensors file per version in a folder both sides can read; `tcp`, each actor pulls every version
from the learner's memory (elastic, through host memory, nothing shared); `gloo` and `nccl`, the
collective channels (collective.py): each actor's engine forms a group with the learner and every
version arrives by broadcast straight into the workers' models (nccl through vLLM's own NCCL engine).
The broker only carries the announcements, and they are the one way an actor hears of new weights:
a joining actor is sent the current one first. Its peers are authenticated, so the announcement
carries what the channels trust: a sha256 per byte range, checked before anything loads (nccl: a
keyed tag per tensor, checked on the GPU it lands on, before the engine serves from it), and for the
network channels the learner's token, without which its weight port answers nothing.
"""

from __future__ import annotations

from tidal.broker.weights import file, gloo, nccl, tcp
from tidal.broker.weights.base import (
    RELOAD_LOGGER,
    EngineStuck,
    InitInfo,
    Transport,
    UpdateInfo,
    WeightPublisher,
    WeightReceiver,
    quiet_harmless_reload_warnings,
    weight_layout,
)
from tidal.broker.weights.payload import without_aliases
from tidal.broker.weights.staging import orphaned_staging
from tidal.broker.weights.tags import SCRATCH_BYTES as TAG_SCRATCH_BYTES
from tidal.config import WeightsConfig, default_weights_dir

TRANSPORTS: dict[str, Transport] = {t.name: t for t in (file.TRANSPORT, tcp.TRANSPORT, gloo.TRANSPORT, nccl.TRANSPORT)}
default_dir = default_weights_dir  # where a run's weights live when weights.dir is empty (the config's rule)

# the names code outside the weight channels uses: nothing else of theirs is imported from outside
__all__ = [
    "RELOAD_LOGGER",
    "TAG_SCRATCH_BYTES",
    "TRANSPORTS",
    "EngineStuck",
    "InitInfo",
    "UpdateInfo",
    "WeightPublisher",
    "WeightReceiver",
    "build_publisher",
    "build_receiver",
    "default_dir",
    "orphaned_staging",
    "quiet_harmless_reload_warnings",
    "transport",
    "weight_layout",
    "without_aliases",
]


def transport(name: str) -> Transport:
    if name not in TRANSPORTS:
        raise ValueError(f"weight update over unknown transport {name!r}; known: {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name]


def build_publisher(
    cfg: WeightsConfig, incarnation: str, run_name: str, run_dir: str, dtype: str | None = None
) -> WeightPublisher:
    """`incarnation` names the learner process, so actors tell a resumed learner's versions apart;
    weights travel in `dtype`, what the actors serve (model.dtype)."""
    check_transport(cfg)
    owns_dir = cfg.dir == default_dir(run_name, run_dir)  # the run's own folder in /dev/shm: removed at the end
    return TRANSPORTS[cfg.transport].publisher(cfg, incarnation, dtype, owns_dir=owns_dir)


def build_receiver(cfg: WeightsConfig) -> WeightReceiver:
    check_transport(cfg)
    return TRANSPORTS[cfg.transport].receiver(cfg)


def check_transport(cfg: WeightsConfig) -> str:
    """The configured transport's name, once its keys are known to be usable: the rules load_config
    applies (WeightsConfig.check), again for a config built in code. A ConfigError is a ValueError."""
    cfg.check()
    return cfg.transport
