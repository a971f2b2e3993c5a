"""The two sides of a weight channel; each transport's module implements both (and the worker's part)."""
from __future__ import annotations

import abc

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

    @abc.abstractmethod
    async def apply(self, update: WeightUpdate, engine) -> float:
        """Load `update` into `engine` while its requests in flight wait; returns seconds paused."""
