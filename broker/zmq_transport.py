"""ZeroMQ transport: embedded, no server. The learner binds, actors connect.

    actor DEALER ──hello/heartbeat/WorkRequest──► learner ROUTER ──WorkGrant──► actor   (prompt queue)
    actor PUSH   ──RolloutGroup────────────────► learner PULL                            (rollout stream)
    learner PUB  ──WeightUpdate / Shutdown─────► actor SUB (conflated: the newest wins)

Prompts are pulled, not pushed (see `GrantTable`): nothing sits in an actor's socket buffer that
it did not ask for, and load balances itself across actors of different speeds. ZeroMQ
acknowledges nothing, so the learner keeps every granted group until its rollout comes back.

PUB/SUB drops what a subscriber was not yet connected for, so the learner repeats its newest
announcement every ANNOUNCE_EVERY_S: a joining actor hears the current weights within about a
second, from the same socket that brings every later version.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import zmq
import zmq.asyncio

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
    WorkRequest,
)
from tidal.config import ZmqConfig

log = logging.getLogger(__name__)

LONG_POLL_S = 0.25  # how long a work request waits at the learner for prompts before an empty grant
ANNOUNCE_EVERY_S = 1.0  # the newest announcement is repeated this often, for actors that joined since
POLL_MS = 5  # the I/O thread's longest wait between socket checks


def _bind(sock: zmq.Socket, host: str, port: int) -> int:
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return port
    return sock.bind_to_random_port(f"tcp://{host}")


class ZmqLearnerTransport(LearnerTransport):
    """Owns the learner's three sockets on one I/O thread; the public methods are thread-safe."""

    def __init__(self, cfg: ZmqConfig, codec: WireCodec, actor_timeout_s: float = 10.0):
        self._cfg = cfg
        self._codec = codec
        self._grants = GrantTable(actor_timeout_s)
        self._parked: collections.deque[tuple[bytes, WorkRequest, float]] = collections.deque()
        self._rollouts: queue.Queue[RolloutGroup] = queue.Queue()
        self._announcement: bytes | None = None  # the newest WeightUpdate or Shutdown, encoded
        self._announce_at = 0.0  # when the I/O thread sends it next
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.ports: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="zmq-learner-io", daemon=True)
        self._thread.start()
        self._ready.wait()
        self._raise_if_failed()

    # ---- public, any thread ----------------------------------------------------------------

    def submit_prompts(self, groups: list[PromptGroup]) -> None:
        with self._lock:
            self._grants.submit(groups)

    def recv_rollout(self, timeout_s: float) -> RolloutGroup | None:
        self._raise_if_failed()
        try:
            return self._rollouts.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def publish_weights(self, update: WeightUpdate) -> None:
        self._announce(update)
        with self._lock:
            self._grants.announced_version = update.version

    def shutdown_actors(self, reason: str) -> None:
        self._announce(Shutdown(reason=reason))

    def _announce(self, msg: Message) -> None:
        frame = self._codec.encode(msg)
        with self._lock:
            self._announcement, self._announce_at = frame, 0.0  # sent at the I/O thread's next turn

    def actors(self) -> dict[str, ActorInfo]:
        with self._lock:
            return dict(self._grants.actors)

    def take_joins(self) -> list[ActorJoin]:
        with self._lock:
            return self._grants.take_joins()

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return self._grants.metrics(self._codec.rejected)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"zmq learner I/O thread failed: {self._error!r}") from self._error

    # ---- the I/O thread ----------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        try:
            router, pull, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted actor reuses its id at once
            pull.setsockopt(zmq.RCVHWM, self._cfg.rollout_hwm)
            for sock in (router, pull, pub):
                sock.setsockopt(zmq.LINGER, 0)
            self.ports = {"control": _bind(router, self._cfg.host, self._cfg.control_port),
                          "rollout": _bind(pull, self._cfg.host, self._cfg.rollout_port),
                          "weights": _bind(pub, self._cfg.host, self._cfg.weights_port)}
            self._ready.set()
            self._loop(router, pull, pub)
        except BaseException as err:  # surfaces in the training thread via _raise_if_failed
            self._error = err
            log.exception("zmq learner I/O thread failed")
        finally:
            self._ready.set()
            ctx.destroy(linger=0)

    def _loop(self, router: zmq.Socket, pull: zmq.Socket, pub: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        while not self._closed.is_set():
            events = dict(poller.poll(timeout=POLL_MS))
            if pull in events:
                self._drain_rollouts(pull)
            if router in events:
                self._drain_control(router)
            self._repeat_announcement(pub)
            self._serve_parked(router)
            with self._lock:
                self._grants.expire_silent_actors()

    def _repeat_announcement(self, pub: zmq.Socket) -> None:
        with self._lock:
            frame, due = self._announcement, time.monotonic() >= self._announce_at
            if frame is not None and due:
                self._announce_at = time.monotonic() + ANNOUNCE_EVERY_S
        if frame is not None and due:
            pub.send(frame)

    def _drain_rollouts(self, pull: zmq.Socket) -> None:
        while True:
            try:
                frame = pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                group = self._codec.decode(frame.buffer, expect=RolloutGroup)
            except WireError as err:
                log.warning("rejected a frame on the rollout stream: %s", err)
                continue
            with self._lock:
                self._grants.returned(group.group_id)
            self._rollouts.put(group)

    def _drain_control(self, router: zmq.Socket) -> None:
        while True:
            try:
                identity, frame = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not [identity, frame]: a foreign peer
                self._codec.rejected["malformed"] += 1
                log.warning("rejected a control message with an unexpected number of frames")
                continue
            try:
                msg = self._codec.decode(frame, expect=(Heartbeat, WorkRequest))
            except WireError as err:
                log.warning("rejected a frame on the control socket from %r: %s", identity, err)
                continue
            with self._lock:
                if isinstance(msg, Heartbeat):
                    self._grants.on_heartbeat(msg)
                else:
                    self._grants.seen(msg.actor_id)
                    self._parked.append((identity, msg, time.monotonic() + LONG_POLL_S))

    def _serve_parked(self, router: zmq.Socket) -> None:
        """Grant parked requests in arrival order; answer empty ones whose long poll ran out."""
        now = time.monotonic()
        still_parked = collections.deque()
        while self._parked:
            identity, request, deadline = self._parked.popleft()
            with self._lock:
                groups = self._grants.take(request.actor_id, request.max_samples)
            if groups or now >= deadline:
                router.send_multipart([identity, self._codec.encode(WorkGrant(groups=groups))])
            else:
                still_parked.append((identity, request, deadline))
        self._parked = still_parked


class ZmqActorTransport(ActorTransport):
    """Actor side, on the actor's asyncio loop."""

    def __init__(self, cfg: ZmqConfig, codec: WireCodec, actor_id: str):
        if not (cfg.control_port and cfg.rollout_port and cfg.weights_port):
            raise ValueError("broker.zmq.control_port, rollout_port and weights_port must be set for an actor "
                             "(the launcher fills them in; on a cluster set them in the config)")
        self._codec = codec
        self._ctx = zmq.asyncio.Context()
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, actor_id.encode())
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, cfg.rollout_hwm)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.CONFLATE, 1)  # only the newest announcement matters
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        for sock, port in ((self._dealer, cfg.control_port), (self._push, cfg.rollout_port),
                           (self._sub, cfg.weights_port)):
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(f"tcp://{cfg.host}:{port}")
        self._request_open = False
        self._actor_id = actor_id

    async def request_work(self, max_samples: int, timeout_s: float) -> list[PromptGroup]:
        if not self._request_open:
            await self._dealer.send(self._codec.encode(WorkRequest(actor_id=self._actor_id, max_samples=max_samples)))
            self._request_open = True
        if not await self._dealer.poll(timeout=int(timeout_s * 1000)):
            return []  # the request stays open; its grant is taken by the next call
        self._request_open = False
        return self._codec.decode(await self._dealer.recv(), expect=WorkGrant).groups

    async def send_rollout(self, group: RolloutGroup) -> None:
        await self._push.send(self._codec.encode(group), copy=False)

    async def next_announcement(self) -> WeightUpdate | Shutdown:
        while True:
            frame = await self._sub.recv()
            try:
                return self._codec.decode(frame, expect=(WeightUpdate, Shutdown))
            except WireError as err:
                log.warning("rejected a frame on the weight channel: %s", err)

    async def heartbeat(self, beat: Heartbeat) -> None:
        await self._dealer.send(self._codec.encode(beat))

    def close(self) -> None:
        self._ctx.destroy(linger=0)
