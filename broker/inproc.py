"""In-process transport: the learner's threads and the actors' event loops in one process.

    learner threads ──submit_prompts──► GrantTable ◄──request_work── actor loop(s), each in its own thread
    learner thread  ◄──recv_rollout──── queue      ◄──send_rollout──
    learner thread  ──publish_weights─► newest announcement ──next_announcement──► actors

The same learner and actor code that runs over ZeroMQ or Redis runs over this, without
sockets or servers: the whole pipeline fits in a unit test or a notebook. Every message is
encoded and decoded with the wire codec on its way, so what crosses here is exactly what would
cross a socket, and bad frames are rejected and counted the same way. Grants follow the ZeroMQ
rules (`GrantTable`): at-least-once, a silent actor's groups are dispatched again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading

from tidal.broker.base import ActorInfo, ActorJoin, ActorTransport, LearnerTransport
from tidal.broker.grants import GrantTable
from tidal.broker.schema import (
    Heartbeat,
    Message,
    PromptGroup,
    RolloutGroup,
    Shutdown,
    WeightUpdate,
    WireCodec,
    WireError,
    WorkGrant,
)

log = logging.getLogger(__name__)


class InprocBroker:
    """The shared state; hands out one learner side and any number of actor sides."""

    def __init__(self, codec: WireCodec, actor_timeout_s: float = 10.0):
        self.codec = codec
        self.lock = threading.Lock()
        self.grants = GrantTable(actor_timeout_s)
        self.rollouts: queue.Queue[bytes] = queue.Queue()
        self.announcement: tuple[int, bytes] | None = None  # (sequence number, newest WeightUpdate or Shutdown)
        self._wakers: list[_Waker] = []

    def learner(self) -> InprocLearnerTransport:
        return InprocLearnerTransport(self)

    def actor(self, actor_id: str) -> InprocActorTransport:
        return InprocActorTransport(self, actor_id)

    def wake_actors(self) -> None:
        """Something an actor may wait for changed (new prompts, a new announcement)."""
        with self.lock:
            wakers = list(self._wakers)
        for waker in wakers:
            waker.wake()

    @contextlib.contextmanager
    def waiting(self):
        """A waker for the caller's event loop, registered while the caller waits."""
        waker = _Waker()
        with self.lock:
            self._wakers.append(waker)
        try:
            yield waker
        finally:
            with self.lock:
                self._wakers.remove(waker)


class _Waker:
    """An asyncio.Event that another thread can set: wakes one actor's loop without polling."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()

    def wake(self) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.event.set)

    async def wait(self, timeout_s: float | None) -> None:
        try:
            await asyncio.wait_for(self.event.wait(), timeout_s)
        except TimeoutError:
            pass
        self.event.clear()


class InprocLearnerTransport(LearnerTransport):
    def __init__(self, broker: InprocBroker):
        self.broker = broker
        self.ports: dict[str, int] = {}

    def submit_prompts(self, groups: list[PromptGroup]) -> None:
        frames = [self.broker.codec.encode(g) for g in groups]
        with self.broker.lock:
            self.broker.grants.submit([self.broker.codec.decode(f, expect=PromptGroup) for f in frames])
        self.broker.wake_actors()

    def recv_rollout(self, timeout_s: float) -> RolloutGroup | None:
        with self.broker.lock:
            self.broker.grants.expire()
        try:
            frame = self.broker.rollouts.get(timeout=timeout_s)
        except queue.Empty:
            return None
        try:
            group = self.broker.codec.decode(frame, expect=RolloutGroup)
        except WireError as err:
            log.warning("rejected a rollout frame: %s", err)
            return None
        with self.broker.lock:
            why = self.broker.grants.returned(group.group_id, group.actor_id)
            if why is not None:
                self.broker.grants.refused[why] += 1
        return None if why is not None else group

    def publish_weights(self, update: WeightUpdate) -> None:
        self._announce(update)
        with self.broker.lock:
            self.broker.grants.table.announced_version = update.version

    def shutdown_actors(self, reason: str) -> None:
        self._announce(Shutdown(reason=reason))

    def _announce(self, msg: Message) -> None:
        frame = self.broker.codec.encode(msg)
        with self.broker.lock:
            sequence = self.broker.announcement[0] + 1 if self.broker.announcement else 1
            self.broker.announcement = (sequence, frame)
        self.broker.wake_actors()

    def actors(self) -> dict[str, ActorInfo]:
        with self.broker.lock:
            return dict(self.broker.grants.actors)

    def bar(self, actor_id: str) -> None:
        with self.broker.lock:
            self.broker.grants.bar(actor_id)

    def take_joins(self) -> list[ActorJoin]:
        with self.broker.lock:
            return self.broker.grants.take_joins()

    def metrics(self) -> dict[str, float]:
        with self.broker.lock:
            return self.broker.grants.metrics(self.broker.codec.rejected)

    def close(self) -> None:
        pass


class InprocActorTransport(ActorTransport):
    """One actor's side; its methods run on that actor's event loop."""

    def __init__(self, broker: InprocBroker, actor_id: str):
        self.broker = broker
        self.actor_id = actor_id
        self.heard = 0  # sequence number of the newest announcement returned

    async def request_work(self, max_samples: int, timeout_s: float) -> list[PromptGroup]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        with self.broker.waiting() as waker:
            while True:
                with self.broker.lock:
                    groups = self.broker.grants.take(self.actor_id, max_samples)
                if groups:
                    frame = self.broker.codec.encode(WorkGrant(groups=groups))
                    return self.broker.codec.decode(frame, expect=WorkGrant).groups
                if loop.time() >= deadline:
                    return []
                await waker.wait(deadline - loop.time())

    async def send_rollout(self, group: RolloutGroup) -> None:
        self.broker.rollouts.put(self.broker.codec.encode(group))

    async def next_announcement(self) -> WeightUpdate | Shutdown:
        with self.broker.waiting() as waker:
            while True:
                with self.broker.lock:
                    newest = self.broker.announcement
                if newest is not None and newest[0] > self.heard:
                    self.heard = newest[0]
                    return self.broker.codec.decode(newest[1], expect=(WeightUpdate, Shutdown))
                await waker.wait(None)

    async def heartbeat(self, beat: Heartbeat) -> None:
        msg = self.broker.codec.decode(self.broker.codec.encode(beat), expect=Heartbeat)
        with self.broker.lock:
            self.broker.grants.on_heartbeat(msg)

    def close(self) -> None:
        pass
