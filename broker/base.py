"""The two faces of a transport: what the learner sees and what an actor sees.

The learner side is synchronous and thread-safe (the coordinator thread submits prompts, the
training loop takes rollouts and publishes weights); the actor side is asyncio, because the
actor runs vLLM's AsyncLLM. Implementations: zmq (embedded default), redis (durable) and
inproc (both sides in one process, for tests and notebooks).

Delivery is at-least-once on both: a consumer that dies before acknowledging gets its work
redelivered, so every consumer of the learner side deduplicates by group id.
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field

from tidal.broker.schema import Heartbeat, PromptGroup, RolloutGroup, Shutdown, WeightUpdate


@dataclass
class ActorInfo:
    """What the learner knows about one live actor, from its heartbeats."""

    actor_id: str
    version: int
    engine: dict[str, str]
    outstanding: list[str]
    num_generated_tokens: int = 0
    weight_swap_paused_s: float = 0.0
    last_seen: float = field(default_factory=time.monotonic)


@dataclass
class ActorJoin:
    """An actor's hello: the version it runs then, and the newest version announced by then."""

    actor_id: str
    version: int
    announced: int


def common_metrics(actors: list[ActorInfo], rejected: dict[str, int]) -> dict[str, float]:
    """What every learner transport reports: the slowest recent weight swap and rejected frames."""
    out = {"broker/rejected_frames": float(sum(rejected.values()))}
    out |= {f"broker/rejected/{reason}": float(count) for reason, count in rejected.items()}
    if actors:
        out["timing/actor_weight_swap_paused_s"] = max(a.weight_swap_paused_s for a in actors)
    return out


class LearnerTransport(abc.ABC):
    """Learner side: prompt queue out, rollout stream in, weight announcements out."""

    @abc.abstractmethod
    def submit_prompts(self, groups: list[PromptGroup]) -> None:
        """Queue prompt groups for the actors (never blocks; admission control bounds them)."""

    def resubmit_prompts(self, groups: list[PromptGroup]) -> None:
        """A learner resumed from a checkpoint queues again the groups outstanding at it. Whatever an
        earlier learner process queued and this one does not is withdrawn, where the transport kept it."""
        self.submit_prompts(groups)

    @abc.abstractmethod
    def recv_rollout(self, timeout_s: float) -> RolloutGroup | None:
        """The next valid rollout group, or None after timeout_s. Bad frames are counted, not raised."""

    @abc.abstractmethod
    def publish_weights(self, update: WeightUpdate) -> None:
        """Announce a new weight version to every actor, including ones that join later."""

    @abc.abstractmethod
    def shutdown_actors(self, reason: str) -> None:
        """Tell every actor to stop (the run is over)."""

    @abc.abstractmethod
    def actors(self) -> dict[str, ActorInfo]:
        """Actors heard from within the actor timeout."""

    def take_joins(self) -> list[ActorJoin]:
        """Hellos since the last call."""
        return []

    def take_dead_letters(self) -> list[str]:
        """Group ids given up on (delivered too often) since the last call."""
        return []

    def commit(self) -> None:
        """Everything returned by recv_rollout so far is durably handled (checkpointed): acknowledge it."""

    def leave_pending(self, group: RolloutGroup) -> None:
        """A group returned by recv_rollout that this learner will not use: keep it for a later one."""

    @abc.abstractmethod
    def metrics(self) -> dict[str, float]:
        """broker/... counters: rejected frames by reason, queue depths."""

    @abc.abstractmethod
    def close(self) -> None: ...


class ActorTransport(abc.ABC):
    """Actor side (asyncio): ask for work, publish rollouts, hear announcements."""

    @abc.abstractmethod
    async def request_work(self, max_samples: int, timeout_s: float) -> list[PromptGroup]:
        """Prompt groups whose samples fit in max_samples; empty if none came within timeout_s."""

    @abc.abstractmethod
    async def send_rollout(self, group: RolloutGroup) -> None:
        """Publish a finished group; this also acknowledges its prompt."""

    @abc.abstractmethod
    async def next_announcement(self) -> WeightUpdate | Shutdown:
        """The one way an actor hears of new weights and of the run's end. The first call returns
        the current weights (a joining actor loads them before it works); later calls return what
        was announced since, the newest first (announcements are never queued up)."""

    @abc.abstractmethod
    async def heartbeat(self, beat: Heartbeat) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...
