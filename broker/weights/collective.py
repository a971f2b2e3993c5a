"""The collective weight channels (`weights.transport`: `nccl` on GPUs, `gloo` on CPUs): each actor's
engine forms a group of its own with the learner (the learner's sender as rank 0, the engine's
workers after it) and every version travels through that group by broadcast, straight into the
workers' models, a bounded piece at a time. Learner and actor agree on each step over a small
control connection; the data plane (gloo.py, nccl.py) is the only part that differs.

    learner  CollectivePublisher.publish ─► payload in host memory (page-locked on GPUs) ─► GroupServer
             per actor connection, once its token is checked, on a thread of its own bound to the
             learner's device (every request carries the token of the announcement):
               JOIN n   ─► the new group's spec ─► form the group as rank 0 with the actor's n workers
               FETCH v  ─► yes, or why not ─► send v through the group (streams of its own) ─► done, or failed
               STORE g  ─► one operation on group g's rendezvous keys (gloo's workers: no store port)
    actor    CollectiveReceiver.apply: join once (engine.init_weight_transfer: every worker forms its
             side) ─► FETCH v ─► engine.transfer_weights: pause(keep) ─► each worker receives the pieces
             and loads each as it lands ─► version label ─► resume ─► the learner's "done"

A group per actor engine, formed when it joins: actors come and go at any time, and a joining
actor is sent the current version like any other. A transfer that makes no progress for
weights.tcp_timeout_s is aborted by the side that waits (its communicator destroyed: on a GPU the
pending NCCL work ends) and the group is formed again on the next update, so a dead or stalled actor
costs the learner one connection's thread for that long and nothing else, and a learner that dies
mid-transfer costs the actor the version. The learner's training never waits for a transfer: sends
run on the connection's own thread and streams, from the payload in host memory, outside the
process group of the training ranks. Nothing is kept on the actor beyond the pieces in flight, so a
transfer that fails part-way leaves the engine paused on a torn model until a whole version loads
(requests in flight keep their place and tokens).
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import socket
import struct
import threading
import time
from functools import partial

from tidal.broker.schema import TOKEN_BYTES, WeightUpdate
from tidal.broker.weights import server, tags
from tidal.broker.weights.base import (
    EngineStuck,
    InitInfo,
    Transport,
    WeightPublisher,
    WeightReceiver,
    check_token,
    check_transport,
    update_info,
)
from tidal.broker.weights.payload import pack, payload_bytes, tensor_buckets
from tidal.broker.weights.server import Served, WeightServer, error_reply, read_reply, reply
from tidal.config import WeightsConfig

# magic, the channel's token, op, argument (JOIN: the engine's workers; FETCH: the version; STORE: the group)
CONTROL = struct.Struct(f"<4s{TOKEN_BYTES}sBQ")
CONTROL_MAGIC = b"TDG3"
JOIN, FETCH, STORE = 1, 2, 3
MAX_WORKERS = 4096  # workers of one engine (tensor x pipeline parallel)

log = logging.getLogger(__name__)


class Plane(abc.ABC):
    """A collective channel's data plane: how a group forms and carries a version. An instance is
    the learner's side, one per publisher; `join` is a worker's side."""

    name: str
    pin: bool = False  # payloads in page-locked host memory (copied to a GPU as they are sent)
    checksums: bool = False  # each bucket carries a sha256 the worker checks (host memory only)
    tags: bool = False  # each tensor carries a keyed tag (weights/tags.py) the worker checks where it lands

    def __init__(self, cfg: WeightsConfig):
        self.cfg = cfg

    @classmethod
    def check_learner(cls) -> None:
        """Raise ValueError naming the key where this machine cannot serve the channel."""

    def device_index(self) -> int:
        """The device the learner sends from: the constructing thread's."""
        return 0

    def bind(self, device_index: int) -> None:
        """Make `device_index` the current device of a connection's thread (a new thread starts on 0)."""

    def tag_device(self):
        """Where the learner computes a version's tags: beside the tensors it packs."""
        import torch

        return torch.device("cpu")

    @classmethod
    def check_announcement(cls, update: WeightUpdate) -> None:
        """Raise ValueError where `update` lacks what this channel's workers check its bytes against."""

    @abc.abstractmethod
    def mint(self, num_workers: int, bucket_bytes: int) -> dict:
        """A new group's spec (plain values), for the learner and an engine of `num_workers` workers."""

    @abc.abstractmethod
    def form(self, spec: dict, timeout_s: float):
        """The learner's side of the group (rank 0), on the connection's thread; has `abort()`."""

    @abc.abstractmethod
    def send(self, group, served: Served, progress) -> None:
        """Every byte of `served` through `group`, calling `progress()` as pieces go out; returns
        once sent, or once the group was aborted."""

    def abandon(self, spec: dict) -> None:
        """Let go of what `mint` kept for a group that never formed."""

    def serve_store(self, conn: socket.socket, group_id: int) -> None:
        """Answer one operation on group `group_id`'s rendezvous keys (an authenticated worker's)."""
        conn.sendall(error_reply(server.NOT_SERVED, f"the {self.name} channel keeps no rendezvous keys"))

    @classmethod
    @abc.abstractmethod
    def join(cls, engine, init: InitInfo):
        """In a worker: its side of the group `init.group` names; returns the member that receives
        (start, receive, finish, close)."""


class Watchdog:
    """Calls `on_stall()` once, from a thread of its own, when `progress()` has not been called for
    `timeout_s` while the watchdog is entered; `fired` says whether it did."""

    def __init__(self, timeout_s: float, on_stall):
        self.timeout_s, self.on_stall = timeout_s, on_stall
        self.last = time.monotonic()
        self.fired = False
        self.done = threading.Event()

    def progress(self) -> None:
        self.last = time.monotonic()

    def __enter__(self) -> Watchdog:
        self.last = time.monotonic()
        threading.Thread(target=self._watch, name="tidal-weights-watchdog", daemon=True).start()
        return self

    def __exit__(self, *_) -> None:
        self.done.set()

    def _watch(self) -> None:
        while not self.done.wait(min(1.0, self.timeout_s / 4)):
            if time.monotonic() - self.last > self.timeout_s:
                self.fired = True
                self.on_stall()
                return


# ---- the learner's side ------------------------------------------------------------------------


def control(token: bytes, op: int, arg: int) -> bytes:
    """A request to the learner's group server."""
    return CONTROL.pack(CONTROL_MAGIC, token, op, arg)


class GroupServer(WeightServer):
    """Answers each actor's JOIN and FETCH, and its workers' STOREs, on the connection's own thread;
    the connection's group lives as long as the connection and ends with it. Each actor's JOIN is
    served on its own thread, so one that never forms its group delays no other."""

    magic = CONTROL_MAGIC
    request_bytes = CONTROL.size

    def __init__(self, plane: Plane, cfg: WeightsConfig):
        super().__init__(cfg.tcp_host, cfg.tcp_port, max(cfg.keep, 2), cfg.tcp_timeout_s, cfg.max_connections)
        self.plane, self.bucket_bytes = plane, cfg.bucket_mib << 20
        self.device_index = plane.device_index()  # the training thread's device, where sends start from
        self.groups: set = set()  # every live group, aborted on close
        self.turns = threading.BoundedSemaphore(cfg.max_sends)  # transfers running at once

    def _handle(self, conn: socket.socket, opening: bytes) -> None:
        self.plane.bind(self.device_index)
        group, request = None, opening
        try:
            while request is not None:
                _, _, op, arg = CONTROL.unpack(request)
                if not self.authentic(request) or op not in (JOIN, FETCH, STORE):
                    conn.sendall(
                        error_reply(
                            server.BAD_REQUEST, f"not a tidal weight group request with this learner's token (op {op})"
                        )
                    )
                    return
                if op == STORE:
                    self.plane.serve_store(conn, arg)
                    return  # one operation a connection: a worker's rendezvous is a handful of them
                if op == JOIN:
                    self._drop(group)
                    group = None  # gone: a join that fails must not abort it a second time
                    if (group := self._join(conn, arg)) is None:
                        return  # the actor joins again, on a new connection
                elif not self._fetch(conn, group, arg):
                    return  # the transfer failed: the group is gone, and the actor joins again
                request = self.next_request(conn, CONTROL.size, idle_s=None)  # idles between versions
        finally:
            self._drop(group)

    def _join(self, conn: socket.socket, num_workers: int):
        if not 1 <= num_workers <= MAX_WORKERS:
            conn.sendall(error_reply(server.BAD_REQUEST, f"an engine of {num_workers} workers (1..{MAX_WORKERS})"))
            return None
        spec, group = self.plane.mint(num_workers, self.bucket_bytes), None
        try:
            conn.sendall(reply(server.OK, json.dumps(spec).encode()))
            group = self.plane.form(spec, self.timeout_s)
        except RuntimeError as err:  # the actor's workers never came (gloo: its timeout; nccl: ours)
            log.warning("weights: an actor's group did not form (%s); its connection is closed", err)
        finally:
            if group is None:  # never formed, or the actor went away: what was kept for it goes
                self.plane.abandon(spec)
        if group is None:
            return None
        with self.lock:
            self.groups.add(group)
        return group

    def _fetch(self, conn: socket.socket, group, version: int) -> bool:
        """Send `version` through the connection's group once fewer than weights.max_sends transfers
        run; False when the transfer failed."""
        if group is None:
            conn.sendall(error_reply(server.NOT_SERVED, "join first"))
            return True
        while not self.turns.acquire(timeout=self.timeout_s / 4):
            conn.sendall(reply(server.QUEUED))  # still there: the actor's read of the answer starts over
        served = None
        try:
            served, known = self.lease(version)
            if served is None:
                conn.sendall(error_reply(server.NOT_SERVED, f"version {version} is not served here (served: {known})"))
                return True
            conn.sendall(reply(server.OK))
            with Watchdog(self.timeout_s, group.abort) as watchdog:
                self.plane.send(group, served, watchdog.progress)
            if watchdog.fired:
                conn.sendall(
                    error_reply(
                        server.FAILED,
                        f"version {version}: no progress for {self.timeout_s:.0f} s "
                        "(weights.tcp_timeout_s); the transfer was aborted",
                    )
                )
                return False
            conn.sendall(reply(server.OK))
            return True
        except RuntimeError as err:  # the group failed (gloo: a peer gone or timed out)
            conn.sendall(error_reply(server.FAILED, f"version {version}: {err}"))
            return False
        finally:
            if served is not None:
                self.release(served)
            self.turns.release()

    def _drop(self, group) -> None:
        if group is None:
            return
        with self.lock:
            self.groups.discard(group)
        group.abort()

    def close(self) -> None:
        """As the base close, then end every group: a transfer still running is aborted at once on
        this side, and the threads end while the interpreter is whole (a group torn down at exit
        aborts the process: gloo's threads outlive Python's)."""
        super().close()
        with self.lock:
            groups = list(self.groups)
        for group in groups:
            group.abort()
        self.wait_for_handlers(self.timeout_s)


class CollectivePublisher(WeightPublisher):
    """Keeps the newest `keep` versions in host memory and serves them to every actor that joins,
    on weights.tcp_host:tcp_port."""

    def __init__(self, cfg: WeightsConfig, plane: Plane, incarnation: str = "", dtype: str | None = None):
        self.plane, self.incarnation, self.dtype = plane, incarnation, dtype
        self.bucket_bytes = cfg.bucket_mib << 20
        self.server = GroupServer(plane, cfg)
        self.location = server.advertised(cfg, self.server.port)

    def publish(self, named_tensors, version: int, entries=None) -> WeightUpdate:
        key = tags.new_key() if self.plane.tags else b""  # a key for this version alone
        tagger = tags.Tagger(key, self.plane.tag_device()) if key else None
        payload, manifest = pack(
            named_tensors,
            self.dtype,
            partial(self.server.buffer_for, pin=self.plane.pin),
            entries,
            tag=tagger.tag if tagger else None,
        )
        buckets = tensor_buckets(payload, manifest, self.bucket_bytes) if self.plane.checksums else []
        self.server.add(version, Served(payload, manifest, buckets))
        return WeightUpdate(
            version=version,
            transport=self.plane.name,
            location=self.location,
            manifest=manifest,
            checksum="",
            incarnation=self.incarnation,
            buckets=buckets,
            token=self.server.token,
            tag_key=key,
            tags=tagger.digests() if tagger else [],
        )

    def retain(self, version: int) -> None:
        self.server.retain(version)

    def close(self) -> None:
        self.server.close()


# ---- the actor's side ------------------------------------------------------------------------


class Refused(ValueError):
    """The learner answered, and said no: the connection and the group stay as they are."""


class CollectiveReceiver(WeightReceiver):
    """Joins the learner that announced a version (once per learner process) and has the engine's
    workers receive each version through the group, inside the engine's pause."""

    def __init__(self, cfg: WeightsConfig, plane: type[Plane]):
        self.cfg, self.transport, self.plane = cfg, plane.name, plane
        self.lock = asyncio.Lock()  # one version at a time through the group
        self.conn: socket.socket | None = None
        self.learner: tuple[str, str] | None = None  # (location, incarnation) of the group's learner

    async def apply(self, update: WeightUpdate, engine) -> float:
        check_transport(update, self.transport)
        payload_bytes(update)  # a malformed announcement is refused before the engine is touched
        check_token(update)
        self.plane.check_announcement(update)
        where = f"weights v{update.version} from the learner at {update.location} by {self.transport}"
        async with self.lock:
            try:
                await self._join(update, engine, where)
                await asyncio.to_thread(self._request, update.token, FETCH, update.version, where)
                info = update_info(self.transport, update, "", self.cfg.tcp_timeout_s)
                paused = await engine.transfer_weights(update.version, info, streaming=True)
                await asyncio.to_thread(read_reply, self.conn, f"{where} (the learner's end of the transfer)")
            except (Refused, EngineStuck):
                raise
            except Exception as err:  # noqa: BLE001 - the learner or the group gone, stalled, cut or damaged
                # (a worker's error reaches here as vLLM's plain Exception naming it): join again next time
                self.leave()
                raise ConnectionError(f"{where}: {err}") from err
            except BaseException:
                self.leave()
                raise
            return paused

    async def _join(self, update: WeightUpdate, engine, where: str) -> None:
        learner = (update.location, update.incarnation)
        if self.conn is not None and self.learner == learner and engine.weight_transport == self.transport:
            return  # joined, and the workers hold the group still
        self.leave()
        host, port = server.parse_location(update.location)
        conn = await asyncio.to_thread(socket.create_connection, (host, port), self.cfg.tcp_timeout_s)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conn = conn
            spec = json.loads(await asyncio.to_thread(self._request, update.token, JOIN, engine.num_workers(), where))
            # the workers reach the learner's rendezvous keys (gloo) with the announcement's token
            group = {**spec, "location": update.location, "token": update.token.hex()}
            # the workers form their side while the learner's connection thread forms its own
            try:
                await asyncio.wait_for(
                    engine.init_weight_transfer(
                        {"transport": self.transport, "group": group, "timeout_s": self.cfg.tcp_timeout_s}
                    ),
                    self.cfg.tcp_timeout_s * 2,
                )
            except TimeoutError:
                raise EngineStuck(
                    f"{where}: the engine's workers did not form their group within "
                    f"{self.cfg.tcp_timeout_s * 2:.0f} s (twice weights.tcp_timeout_s) and wait "
                    "on inside a call that cannot be cancelled; the actor must restart"
                ) from None
        except BaseException:
            self.leave()
            raise
        self.learner = learner

    def _request(self, token: bytes, op: int, arg: int, where: str) -> bytes:
        self.conn.sendall(control(token, op, arg))
        try:
            return read_reply(self.conn, where)
        except ValueError as err:
            if "refused by the learner" in str(err):
                raise Refused(str(err)) from None
            raise

    def leave(self) -> None:
        """Close the connection to the learner (its thread drops the group); the workers' side goes
        with the next join."""
        conn, self.conn, self.learner = self.conn, None, None
        if conn is not None:
            conn.close()


class CollectiveTransport(Transport):
    """A collective channel in the registry: these two sides over its data plane."""

    def __init__(self, plane: type[Plane]):
        self.plane, self.name = plane, plane.name

    def publisher(
        self, cfg: WeightsConfig, incarnation: str, dtype: str | None, owns_dir: bool = False
    ) -> WeightPublisher:
        self.plane.check_learner()
        return CollectivePublisher(cfg, self.plane(cfg), incarnation, dtype)

    def receiver(self, cfg: WeightsConfig) -> WeightReceiver:
        return CollectiveReceiver(cfg, self.plane)

    def join(self, engine, init: InitInfo):
        return self.plane.join(engine, init)
