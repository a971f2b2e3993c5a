"""The two sides of a weight channel; each transport's module implements both (and the worker's part).
What every channel's worker side shares sits at the end."""
from __future__ import annotations

import abc
import logging

from tidal.broker.schema import WeightUpdate


class WeightPublisher(abc.ABC):
    """Learner side: makes a version's tensors available to the actors."""

    @abc.abstractmethod
    def publish(self, named_tensors: dict, version: int) -> WeightUpdate:
        """Make the tensors available; returns the announcement for the broker to carry."""

    def close(self) -> None:
        """Release what the channel holds for this run (files, sockets)."""


class WeightReceiver(abc.ABC):
    """Actor side: brings an announced version into the engine."""

    vllm_backend: str | None = None  # the vLLM weight-transfer engine this channel loads through, if any

    @abc.abstractmethod
    async def apply(self, update: WeightUpdate, engine) -> float:
        """Load `update` into `engine` while its requests in flight wait; returns seconds paused."""


# ---- inside vLLM's workers ----------------------------------------------------------------------

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _RotaryReloadFilter(logging.Filter):
    """On every weight reload vLLM warns "RotaryEmbedding: Failed to load weights" once per layer:
    the rotary cos/sin cache is a buffer computed from the config, never in a checkpoint, and vLLM
    puts the computed one back. The warning says nothing wrong and would fill the actor's log
    (one per layer per update); the same warning for any other layer is a real problem and stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


def quiet_harmless_reload_warnings() -> None:
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _RotaryReloadFilter) for f in logger.filters):
        logger.addFilter(_RotaryReloadFilter())
