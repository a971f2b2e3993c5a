"""ZeroMQ transport: embedded, no server. The learner binds, actors connect.

    actor DEALER ──hello/heartbeat/WorkRequest──► learner ROUTER ──WorkGrant──► actor   (prompt queue)
    actor PUSH   ──RolloutGroup────────────────► learner PULL                            (rollout stream)
    learner PUB  ──WeightUpdate / Shutdown─────► actor SUB (conflated: the newest wins)

Prompts are pulled, not pushed: an actor asks for as many samples as it has free slots and
the learner grants whole groups that fit. Nothing sits in an actor's socket buffer that it
did not ask for, and load balances itself across actors of different speeds.

ZeroMQ acknowledges nothing, so the learner keeps every granted group until its rollout comes
back. An actor silent for `broker.actor_timeout_s`, or one that says hello again under the
same id (restarted), has its unreturned groups queued again at the front. A slow actor that
was given up on may still deliver: the learner deduplicates by group id.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import zmq
import zmq.asyncio

from tidal.broker.base import ActorInfo, ActorJoin, ActorTransport, LearnerTransport, common_metrics
from tidal.broker.schema import (Heartbeat, Message, PromptGroup, RolloutGroup, Shutdown, WeightUpdate,
                                 WireCodec, WireError, WorkGrant, WorkRequest)
from tidal.config import ZmqConfig

log = logging.getLogger(__name__)

LONG_POLL_S = 0.25  # how long a work request waits at the learner for prompts before an empty grant


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
        self._actor_timeout_s = actor_timeout_s
        self._granted: dict[str, tuple[str, PromptGroup]] = {}  # group id -> (actor id, group), until returned
        self._joins: list[ActorJoin] = []
        self.num_redispatched = 0
        self._pending: collections.deque[PromptGroup] = collections.deque()
        self._parked: collections.deque[tuple[bytes, WorkRequest, float]] = collections.deque()
        self._rollouts: queue.Queue[RolloutGroup] = queue.Queue()
        self._outbox: queue.Queue[Message] = queue.Queue()
        self._latest_weights: WeightUpdate | None = None
        self._actors: dict[str, ActorInfo] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.ports: dict[str, int] = {}
        self.num_granted_groups = 0
        self._thread = threading.Thread(target=self._run, name="zmq-learner-io", daemon=True)
        self._thread.start()
        self._ready.wait()
        self._raise_if_failed()

    # ---- public, any thread ----------------------------------------------------------------

    def submit_prompts(self, groups: list[PromptGroup]) -> None:
        with self._lock:
            self._pending.extend(groups)

    def recv_rollout(self, timeout_s: float) -> RolloutGroup | None:
        self._raise_if_failed()
        try:
            return self._rollouts.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def publish_weights(self, update: WeightUpdate) -> None:
        with self._lock:
            self._latest_weights = update
        self._outbox.put(update)

    def shutdown_actors(self, reason: str) -> None:
        self._outbox.put(Shutdown(reason=reason))

    def actors(self) -> dict[str, ActorInfo]:
        with self._lock:
            return dict(self._actors)

    def take_joins(self) -> list[ActorJoin]:
        with self._lock:
            joins, self._joins = self._joins, []
        return joins

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = {"broker/pending_prompt_groups": float(len(self._pending)),
                   "broker/granted_groups": float(self.num_granted_groups),
                   "broker/unreturned_groups": float(len(self._granted)),
                   "broker/redispatched_groups": float(self.num_redispatched),
                   "broker/live_actors": float(len(self._actors))}
            return out | common_metrics(list(self._actors.values()), self._codec.rejected)

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
            events = dict(poller.poll(timeout=5))
            if pull in events:
                self._drain_rollouts(pull)
            if router in events:
                self._drain_control(router)
            while not self._outbox.empty():
                pub.send(self._codec.encode(self._outbox.get_nowait()))
            self._serve_parked(router)
            self._expire_silent_actors()

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
                self._granted.pop(group.group_id, None)
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
            if isinstance(msg, Heartbeat):
                self._on_heartbeat(msg)
            else:
                with self._lock:
                    if msg.actor_id in self._actors:
                        self._actors[msg.actor_id].last_seen = time.monotonic()
                self._parked.append((identity, msg, time.monotonic() + LONG_POLL_S))

    def _on_heartbeat(self, beat: Heartbeat) -> None:
        with self._lock:
            if beat.hello:
                announced = self._latest_weights.version if self._latest_weights else 0
                log.info("actor %s joined (engine %s, weight version %d, latest announced %d)",
                         beat.actor_id, beat.engine, beat.version, announced)
                self._joins.append(ActorJoin(beat.actor_id, beat.version, announced))
                self._requeue(beat.actor_id, "said hello again (restarted)")
            self._actors[beat.actor_id] = ActorInfo(beat.actor_id, beat.version, beat.engine, beat.outstanding,
                                                    beat.num_generated_tokens, beat.weight_swap_paused_s)

    def _expire_silent_actors(self) -> None:
        now = time.monotonic()
        with self._lock:
            for actor_id, info in list(self._actors.items()):
                if now - info.last_seen > self._actor_timeout_s:
                    del self._actors[actor_id]
                    self._requeue(actor_id, f"silent for {now - info.last_seen:.1f} s")

    def _requeue(self, actor_id: str, why: str) -> None:
        """Queue an actor's unreturned groups again, at the front (they are the oldest). Lock held."""
        mine = [gid for gid, (owner, _) in self._granted.items() if owner == actor_id]
        if not mine:
            return
        self._pending.extendleft(reversed([self._granted.pop(gid)[1] for gid in mine]))
        self.num_redispatched += len(mine)
        log.warning("actor %s %s: re-dispatching its %d unreturned groups", actor_id, why, len(mine))

    def _serve_parked(self, router: zmq.Socket) -> None:
        """Grant parked requests in arrival order; answer empty ones whose long poll ran out."""
        now = time.monotonic()
        still_parked = collections.deque()
        while self._parked:
            identity, request, deadline = self._parked.popleft()
            groups = self._take(request.actor_id, request.max_samples)
            if groups or now >= deadline:
                with self._lock:
                    latest = self._latest_weights
                router.send_multipart([identity, self._codec.encode(WorkGrant(groups=groups, latest_weights=latest))])
            else:
                still_parked.append((identity, request, deadline))
        self._parked = still_parked

    def _take(self, actor_id: str, max_samples: int) -> list[PromptGroup]:
        groups: list[PromptGroup] = []
        budget = max_samples
        with self._lock:
            while self._pending and self._pending[0].n <= budget:
                group = self._pending.popleft()
                budget -= group.n
                groups.append(group)
                self._granted[group.group_id] = (actor_id, group)
            self.num_granted_groups += len(groups)
        return groups


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

    async def request_work(self, max_samples: int, timeout_s: float) -> WorkGrant | None:
        if not self._request_open:
            await self._dealer.send(self._codec.encode(WorkRequest(actor_id=self._actor_id, max_samples=max_samples)))
            self._request_open = True
        if not await self._dealer.poll(timeout=int(timeout_s * 1000)):
            return None  # the request stays open; its grant is taken by the next call
        self._request_open = False
        return self._codec.decode(await self._dealer.recv(), expect=WorkGrant)

    async def send_rollout(self, group: RolloutGroup) -> None:
        await self._push.send(self._codec.encode(group), copy=False)

    async def latest_weights(self, timeout_s: float) -> WeightUpdate | None:
        """Every grant carries the newest announcement; an empty request fetches one."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            grant = await self.request_work(0, timeout_s=1.0)
            if grant is not None:
                return grant.latest_weights
        return None

    async def next_weight_update(self) -> WeightUpdate | Shutdown:
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
