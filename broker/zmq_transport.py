"""ZeroMQ transport: embedded, no server. The learner binds, actors connect.

    actor DEALER ──hello/heartbeat/WorkRequest──► learner ROUTER ──WorkGrant──► actor   (prompt queue)
    actor PUSH   ──RolloutGroup────────────────► learner PULL                            (rollout stream)
    learner PUB  ──WeightUpdate / Shutdown─────► actor SUB (conflated: the newest wins)

Prompts are pulled, not pushed (`GrantTable`): nothing sits in an actor's socket buffer that it
did not ask for, and load balances itself across actors of different speeds. ZeroMQ acknowledges
nothing, so the learner keeps every granted group until its rollout comes back.

PUB/SUB drops what a subscriber was not yet connected for, so the learner repeats its newest
announcement every ANNOUNCE_EVERY_S: a joining actor hears the current weights within about a
second, from the same socket that brings every later version.

Peers: with CURVE (`broker.zmq.curve`; always on in `tidal run`) every connection is encrypted and
its key says which actor it is (the ZAP User-Id); a message claiming another actor's id is refused.
A connection's routing id is `<actor id>/<random nonce>`, new for each connection: the ROUTER refuses
a second connection under a routing id in use (no ROUTER_HANDOVER), and nobody can take an actor's
routing id before it connects, since nobody knows the nonce, so no peer can lock an actor out or take
its grants. Without CURVE (curve=off, a role started alone) anyone who reaches the ports can claim any
actor's id and send what that actor could: only the lock-out holds.

Every buffer a peer fills is bounded in bytes per connection: frames by ZMQ_MAXMSGSIZE; control
messages by broker.max_control_bytes, broker.zmq.control_hwm per connection (the I/O thread reads
them as they come) and a rate per actor, shared by all its connections; rollouts by the PULL
socket's high-water mark (`rollout_mark`: rollout_hwm frames, fewer where frames of
broker.max_message_bytes would hold more than rollout_buffer_bytes); subscriptions by SUBSCRIPTION_HWM
frames of SUBSCRIPTION_BYTES. libzmq keeps one decoded frame beside a full queue. The training thread
reads the PULL socket itself, and what it has not read yet stays there; beyond the mark an actor's
rollouts wait in the actor. Each socket keeps at most broker.zmq.max_connections TCP connections open
(`connection_cap`): its monitor reports each accepted one by file descriptor, and the I/O thread shuts
down the newest beyond the cap at once (`_Connections`); connections in are never displaced. In all the
learner holds at most `buffer_bound_bytes` (cap x per connection). The cap counts strangers' connections
before their handshake, which is what bounds them (each holds at most a frame until its handshake fails
or times out), and anyone who reaches a port, or one key holder, can take the whole cap: new connections
are then refused until those close. The bound holds for peers that send one frame a message, as actors
do. A key holder is trusted beyond it, as libzmq 4.3 gives no way to hold it: a message's frames are kept
until its last one comes (the mark counts messages), what a connection sent stays in the socket after it
closes until read, and a connection under a routing id in use is never read. What the learner keeps per
actor (its newest heartbeat, its newest parked request per connection) has a size set by the wire's
bounds, for at most broker.max_actors ids. An actor's own queue has no mark: it holds at most the groups
it was granted, and the learner grants no more than its admission control releases.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import math
import os
import resource
import secrets
import socket
import struct
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
from tidal.broker.zmq_keys import ActorKeys, require_keys, secure_client, secure_server
from tidal.config import BrokerConfig, ConfigError, curve_on
from tidal.logs import SparseLog, power_of_ten

log = logging.getLogger(__name__)

LONG_POLL_S = 0.25  # how long a work request waits at the learner for prompts before an empty grant
ANNOUNCE_EVERY_S = 1.0  # the newest announcement is repeated this often, for actors that joined since
# the I/O thread's longest wait: for long-poll deadlines, repeated announcements and silent actors.
# New prompts and announcements wake it at once (`_wake`), so this bounds no grant's latency.
POLL_MS = 50
# control messages per second and identity, sustained (bursts up to twice that). An accepted one costs
# the I/O thread ~10 us, so a peer at this rate takes ~5% of it; an actor moving thousands of small
# groups a second needs it this high, as one grant per request paces it (see REQUEST_EVERY_S)
CONTROL_RATE = 5000.0
MAX_IDENTITIES = 8192  # identities whose rate is tracked; the oldest is forgotten first
# an actor's work request unanswered this long is sent again; the learner answers each within LONG_POLL_S
REQUEST_AGAIN_S = 5.0
# an actor asks at most this often, at half the rate that is refused: a busy actor that finishes
# groups faster gathers the freed slots into its next request instead of losing requests to the limit.
# Its grants come no faster either: at 2 ms it could not take more than ~15k groups/s of 64 in flight
REQUEST_EVERY_S = 2 / CONTROL_RATE
# the weights socket's inbound frames are subscriptions: an actor sends one of a byte. The limit is on
# CURVE's handshake frames too (under 400 bytes); without it a stranger's first frame could be any size
SUBSCRIPTION_BYTES = 1024
# A CURVE socket whose receive mark is 1 takes nothing in: every message waited in the kernel and the
# learner heard no request, or no rollout, until its timeout. The config refuses such marks; this floor
# holds for a transport built without that check.
MIN_MARK = 2
FILES_OF_ITS_OWN = 512  # what a learner opens beside its connections: weights, checkpoints, logs, libraries
SUBSCRIPTION_HWM = 16  # subscriptions held unread per connection (the PUB socket takes them as it sends)
# a peer whose host is gone is noticed by TCP keepalive within ~2 minutes: the learner never writes to a
# rollout connection and rarely to a control one, and the connection would hold its place under the cap
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 60, 10, 6
CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED  # each with the connection's file descriptor


def _bind(sock: zmq.Socket, host: str, port: int) -> int:
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return port
    return sock.bind_to_random_port(f"tcp://{host}")


def routing_id(actor_id: str) -> bytes:
    """A connection's routing id: the actor id, and a nonce nobody else knows (no one can take it first)."""
    return f"{actor_id}/{secrets.token_hex(16)}".encode()


def claimed_actor(identity: bytes) -> bytes:
    """The actor id a routing id claims (b"" for one not of the form <actor id>/<nonce>)."""
    actor, slash, nonce = identity.partition(b"/")
    return actor if slash and nonce else b""


def rollout_mark(cfg: BrokerConfig) -> int:
    """The PULL socket's high-water mark, in frames: rollout_hwm, fewer where frames as large as the wire
    allows would hold more than rollout_buffer_bytes."""
    return max(MIN_MARK, min(cfg.zmq.rollout_hwm, cfg.zmq.rollout_buffer_bytes // cfg.max_message_bytes))


def control_mark(cfg: BrokerConfig) -> int:
    """The ROUTER socket's high-water mark, in messages: control_hwm, at least MIN_MARK."""
    return max(MIN_MARK, cfg.zmq.control_hwm)


def connection_cap(cfg: BrokerConfig, open_files: int | None = None) -> int:
    """TCP connections each learner socket keeps open: broker.zmq.max_connections, else twice
    broker.max_actors (an actor holds one per socket; the rest is room for reconnects and strangers),
    fewer where the process's `open_files` could not hold three sockets' worth beside its own files."""
    if cfg.zmq.max_connections:
        return cfg.zmq.max_connections
    auto = 2 * cfg.max_actors
    return auto if open_files is None else min(auto, (open_files - FILES_OF_ITS_OWN) // 3)


def open_file_limit() -> int:
    """The files this process may open, its soft limit raised to the hard one first (no privilege needed):
    at a soft limit of 1,024, 1,100 connections under a cap of 2,048 made the learner fail on EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # an unlimited hard limit beyond what the kernel allows: keep the soft one
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def checked_cap(cfg: BrokerConfig, open_files: int) -> int:
    """The connection cap, once three sockets of it and the learner's own files fit in `open_files`;
    ConfigError naming the key to lower otherwise."""
    cap = connection_cap(cfg, open_files)
    needed = 3 * max(cap, cfg.max_actors) + FILES_OF_ITS_OWN
    if needed > open_files:
        key, value = (
            ("broker.zmq.max_connections", cfg.zmq.max_connections)
            if cfg.zmq.max_connections
            else ("broker.max_actors", cfg.max_actors)
        )
        raise ConfigError(
            f"config key '{key}' = {value}: 3 sockets x {max(cap, cfg.max_actors)} connections and "
            f"{FILES_OF_ITS_OWN} files of the learner's own need {needed} open files, and this process "
            f"may open {open_files} (its hard limit, ulimit -Hn): lower {key}, or raise the limit"
        )
    return cap


def buffer_bound_bytes(cfg: BrokerConfig, cap: int | None = None) -> int:
    """The most bytes the learner's sockets hold for their peers (sending a frame a message, as actors do):
    per connection a full queue and the frame decoded beside it, on each socket, times the cap. The kernel's
    TCP buffers come on top."""
    per_connection = (
        (rollout_mark(cfg) + 1) * cfg.max_message_bytes
        + (control_mark(cfg) + 1) * cfg.max_control_bytes
        + (SUBSCRIPTION_HWM + 1) * SUBSCRIPTION_BYTES
    )
    return (cap or connection_cap(cfg)) * per_connection


def seed_routing_ids() -> None:
    """Seed the C library's rand(), from which libzmq draws a ROUTER's first automatic routing id and which
    nothing else seeds: unseeded, that id is known in advance, and a peer that claims it as its own and then
    connects once more without one trips an assertion that aborts the process (libzmq 4.3)."""
    try:
        ctypes.CDLL(None).srand(secrets.randbits(32))
    except (OSError, AttributeError):  # no C library to reach: libzmq's own default then
        log.warning("could not seed the C library's rand(): the ROUTER's automatic routing ids are predictable")


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _RateLimit:
    """A token bucket per identity: a peer flooding the control socket is throttled, not obeyed."""

    def __init__(self, rate: float):
        self.rate = rate
        self.buckets: collections.OrderedDict[bytes, tuple[float, float]] = collections.OrderedDict()

    def allow(self, identity: bytes) -> bool:
        now = time.monotonic()
        tokens, then = self.buckets.pop(identity, (2 * self.rate, now))
        tokens = min(2 * self.rate, tokens + (now - then) * self.rate)
        self.buckets[identity] = (tokens - 1, now)
        while len(self.buckets) > MAX_IDENTITIES:
            self.buckets.popitem(last=False)
        return tokens >= 1


class _Connections:
    """One bound socket's open TCP connections by file descriptor, as its monitor reports them (libzmq names
    neither key nor routing id there), each with the machine it comes from (its peer address). With the cap
    full, a newcomer takes the place of the newest connection of the machine holding the most, where that
    machine holds more than the newcomer's would: strangers that hoard the places from one machine, and
    retake each as it frees, cannot keep an actor of another machine (a pod on Kubernetes) out. Otherwise
    the newcomer is refused. Refusals are marked as the events are read."""

    def __init__(self, name: str, sock: zmq.Socket, cap: int):
        self.name, self.cap = name, cap
        # an endpoint of its own: pyzmq's default is named after the socket's FD, which a socket made after
        # this one is closed may have again before libzmq has unbound this one's
        self.monitor = sock.get_monitor_socket(CONNECTION_EVENTS, f"inproc://tidal-monitor-{secrets.token_hex(8)}")
        self.open: dict[int, int] = {}  # fd -> the number of its ACCEPTED event
        self.machine: dict[int, str] = {}  # fd -> its peer's address ("" where it could not be read)
        self.refused: set[int] = set()  # open fds shut down (or about to be), not yet reported gone
        self.num_accepted = 0

    def admitted(self) -> int:
        return len(self.open) - len(self.refused)

    def read_events(self) -> list[tuple[int, int]]:
        """Apply the events waiting, in order; (fd, event number) of each connection refused meanwhile. In order,
        a connection's DISCONNECTED comes before any ACCEPTED of its fd number again: libzmq reports it, then
        closes the fd."""
        refused = []
        while True:
            try:
                head, _endpoint = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return refused
            event, fd = struct.unpack("=HI", head)
            # either way the fd's earlier connection is gone (an ACCEPTED of an fd still open: it closed unreported)
            self.open.pop(fd, None)
            self.machine.pop(fd, None)
            self.refused.discard(fd)
            if event != zmq.EVENT_ACCEPTED:
                continue
            self.num_accepted += 1
            self.open[fd], self.machine[fd] = self.num_accepted, peer_machine(fd)
            if self.admitted() > self.cap:
                out = self._make_room(fd)
                self.refused.add(out)
                refused.append((out, self.open[out]))

    def _make_room(self, newcomer: int) -> int:
        """The connection to shut down now that `newcomer` is one beyond the cap: the newest of the machine
        holding the most, where that is not the newcomer's machine and holds more than it; else the newcomer."""
        held: dict[str, list[int]] = {}
        for fd in self.open.keys() - self.refused:
            held.setdefault(self.machine[fd], []).append(fd)
        mine = held[self.machine[newcomer]]
        heaviest = max(held.values(), key=len)
        if heaviest is mine or len(heaviest) <= len(mine):
            return newcomer
        return max(heaviest, key=self.open.__getitem__)


def peer_machine(fd: int) -> str:
    """The address a connection comes from ("" where it cannot be read: gone already, or not TCP)."""
    try:
        with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as dup:  # a dup, closed here
            peer = dup.getpeername()
    except OSError:
        return ""
    return peer[0] if isinstance(peer, tuple) else ""


def refuse_beyond_cap(tables: list[_Connections]) -> list[_Connections]:
    """Read every socket's connection events and shut down the connections beyond each cap (one table entry
    returned per refusal). A shutdown on a duplicate of the fd, never a close of libzmq's own: libzmq reads
    EOF, closes its fd and reports it gone. The fd is duplicated, then the events are read again, and the
    duplicate shut down only if the connection is still open: had libzmq closed the fd before the dup (its
    number perhaps another file's by then), the connection's DISCONNECTED would be among those events."""
    refused: list[_Connections] = []
    pending = [(t, fd, n) for t in tables for fd, n in t.read_events()]
    while pending:
        refused += [t for t, _, _ in pending]
        dups = [(t, fd, n, _dup(fd)) for t, fd, n in pending if t.open.get(fd) == n]
        pending = [(t, fd, n) for t in tables for fd, n in t.read_events()]
        for t, fd, n, dup in dups:
            if dup is None:
                continue
            if t.open.get(fd) == n:
                try:
                    dup.shutdown(socket.SHUT_RDWR)
                except OSError:  # reset by the peer meanwhile
                    pass
            dup.close()
    return refused


def _dup(fd: int) -> socket.socket | None:
    try:
        return socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)  # a dup; the family is not looked at
    except OSError:  # closed already (or no fd left to dup: it stays until its handshake fails or times out)
        return None


class _Waker:
    """A pipe other threads write to wake the I/O thread's poll. A wake-up written and not yet taken is not
    written again (a write is a syscall and a GIL round trip); the I/O thread clears the flag after it drains
    the pipe and before it serves anything, so a caller that finds it set is served by that turn, and one
    that writes after the drain wakes the next."""

    def __init__(self):
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        os.set_blocking(self.read_fd, False)
        self.pending = False

    def wake(self) -> None:
        if self.pending:
            return
        self.pending = True
        try:
            os.write(self.write_fd, b"\0")
        except (BlockingIOError, OSError):  # full: a wake-up is pending anyway; closed: nothing to wake
            pass

    def taken(self) -> None:
        """The I/O thread's poll saw the pipe readable: drain it, then clear the flag (cleared first, a write
        in between would be lost)."""
        os.read(self.read_fd, 4096)
        self.pending = False

    @property
    def closed(self) -> bool:
        return self.write_fd < 0

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            os.close(fd)
        self.read_fd = self.write_fd = -1


class _ControlSide:
    """The control socket as the I/O thread serves it: heartbeats and hellos into the live-actor table, work
    requests parked until prompts come (a long poll) and granted in arrival order, a rate per actor; what
    does not belong is refused and counted. The grant table is touched under the transport's lock."""

    def __init__(self, grants: GrantTable, lock: threading.Lock, codec: WireCodec, refuse, sparse: SparseLog):
        self.grants, self.lock, self.codec, self.refuse, self.sparse = grants, lock, codec, refuse, sparse
        self.rate = _RateLimit(CONTROL_RATE)
        self.authenticated = False  # CURVE is on: each connection's key names its actor
        # requests waiting for prompts, by connection, in arrival order: the newest of each (an actor has one open)
        self.parked: dict[bytes, tuple[WorkRequest, float]] = {}
        # a parked request found no prompts at its last try: new ones must wake the I/O thread. Set and
        # read under the lock, in the same section as that try and as the submission, so a submitter that
        # reads False either comes before a try (which then sees its prompts) or after one that got some
        self.starving = False

    def drain(self, router: zmq.Socket) -> None:
        while router.get(zmq.EVENTS) & zmq.POLLIN:  # asked, not tried: a miss would raise (and build) an error
            frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            if len(frames) != 2:  # not [identity, frame]: a foreign peer
                self.refuse("malformed", "a control message with an unexpected number of frames")
                continue
            identity, frame = frames
            # one budget per actor, however many connections it opens: its key's, else the id it claims
            sender = frame.get("User-Id").encode() if self.authenticated else claimed_actor(identity.bytes)
            if not self.rate.allow(sender):
                self.refuse("rate_limited", f"control messages from {identity.bytes[:40]!r}")
                continue
            try:
                msg = self.codec.decode(frame.buffer, expect=(Heartbeat, WorkRequest))
            except WireError as err:
                self.sparse.warning(
                    f"control frames rejected ({err.reason})",
                    "rejected a frame on the control socket from %r: %s",
                    identity.bytes[:40],
                    err,
                )
                continue
            wrong_key = self.authenticated and frame.get("User-Id") != msg.actor_id
            if msg.actor_id.encode() != claimed_actor(identity.bytes) or wrong_key:
                self.refuse(
                    "impersonation",
                    f"{type(msg).__name__} claims {msg.actor_id!r} from connection {identity.bytes[:40]!r}",
                )
                continue
            self.on_control(identity.bytes, msg)

    def on_control(self, identity: bytes, msg: Heartbeat | WorkRequest) -> None:
        with self.lock:
            if isinstance(msg, Heartbeat):
                self.grants.on_heartbeat(msg)
                return
            live = msg.actor_id in self.grants.actors
            self.grants.seen(msg.actor_id)
        # an id that never introduced itself with a heartbeat gets an empty grant at once
        self.parked.pop(identity, None)
        self.parked[identity] = (msg, time.monotonic() + (LONG_POLL_S if live else 0.0))
        if not live:
            self.refuse("unknown_actor", f"work request from {msg.actor_id!r}, which sent no heartbeat")

    def serve_parked(self, router: zmq.Socket, encode) -> None:
        """Grant parked requests in arrival order; answer empty ones whose long poll ran out."""
        with self.lock:
            self.starving = False
        if not self.parked:
            return
        now = time.monotonic()
        still_parked = {}
        for identity, (request, deadline) in self.parked.items():
            with self.lock:
                groups = self.grants.take(request.actor_id, request.max_samples)
                waits = not groups and now < deadline
                self.starving |= waits
            if waits:
                still_parked[identity] = (request, deadline)
            else:
                router.send_multipart([identity, encode(WorkGrant(groups=groups))])
        self.parked = still_parked


class ZmqLearnerTransport(LearnerTransport):
    """Control and weight sockets on one I/O thread; the rollout socket is read by the one thread that
    calls recv_rollout (the training loop). The other public methods are thread-safe."""

    shutdown_flush_s = 0.2  # the PUB socket sends on its I/O thread, and closing drops what it holds

    def __init__(self, cfg: BrokerConfig, codec: WireCodec):
        self._cfg, self._zmq = cfg, cfg.zmq
        self._codec = codec
        control_codec = WireCodec(cfg.max_control_bytes)
        control_codec.rejected = codec.rejected  # one count of rejected frames
        self._grants = GrantTable(cfg.actor_timeout_s, cfg.max_actors, cfg.grant_timeout_s)
        self._sparse = SparseLog(log)  # what peers send that is refused: a line at the 1st, 10th, 100th ...
        self._cap = checked_cap(cfg, open_file_limit())  # before any socket: a cap the process cannot hold is refused
        self._lock = threading.Lock()
        self._control = _ControlSide(self._grants, self._lock, control_codec, self._refuse, self._sparse)
        self._expire_at = 0.0  # when the I/O thread next looks for silent actors
        self._announcement: bytes | None = None  # the newest WeightUpdate or Shutdown, encoded
        self._announce_at = 0.0  # when the I/O thread sends it next
        self._closed = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.ports: dict[str, int] = {}
        self._ctx = zmq.Context()
        self._pull: zmq.Socket | None = None  # made and bound by the I/O thread, read by the training thread
        self._recv_timeout_ms = -1  # the PULL socket's RCVTIMEO, as the training thread last set it
        self._authenticated = False  # CURVE is on: each connection's key names its actor
        self._conns: list[_Connections] = []  # each bound socket's connections, kept by the I/O thread
        self._waker = _Waker()  # other threads wake the I/O thread's poll through it
        self._thread = threading.Thread(target=self._run, name="zmq-learner-io", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._ctx.destroy(linger=0)
        self._raise_if_failed()

    # ---- public, any thread ----------------------------------------------------------------

    def submit_prompts(self, groups: list[PromptGroup]) -> None:
        with self._lock:
            self._grants.submit(groups)
            starving = self._control.starving
        if starving:  # a parked request found the queue empty: these may be what it waits for
            self._waker.wake()

    def recv_rollout(self, timeout_s: float) -> RolloutGroup | None:
        """Read by the calling thread itself, as the Redis transport reads: no rollout waits on the I/O
        thread or crosses to this one, and what is not read yet stays in the socket, up to its high-water
        mark per actor; the rest waits in the actors."""
        self._raise_if_failed()
        deadline = time.monotonic() + timeout_s
        wait_ms = min(max(0, math.ceil(timeout_s * 1000)), 2**31 - 1)
        while True:
            # a blocking receive under the socket's own timeout: when a rollout is waiting (the busy case)
            # that is one call, where a non-blocking try, a poll and a second try were three, and a miss
            # raised (and built) an exception each time
            if wait_ms != self._recv_timeout_ms:
                self._pull.setsockopt(zmq.RCVTIMEO, wait_ms)  # 0: return at once; never -1 (forever)
                self._recv_timeout_ms = wait_ms
            try:
                frame = self._pull.recv(copy=False)
            except zmq.Again:
                return None
            group = self._accept(frame)
            if group is not None:
                return group
            wait_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))

    def publish_weights(self, update: WeightUpdate) -> None:
        self._announce(update)
        with self._lock:
            self._grants.table.announced_version = update.version

    def shutdown_actors(self, reason: str) -> None:
        self._announce(Shutdown(reason=reason))

    def _announce(self, msg: Message) -> None:
        frame = self._codec.encode(msg)
        with self._lock:
            self._announcement, self._announce_at = frame, 0.0  # sent at the I/O thread's next turn
        self._waker.wake()

    def actors(self) -> dict[str, ActorInfo]:
        with self._lock:
            return dict(self._grants.actors)

    def bar(self, actor_id: str) -> None:
        with self._lock:
            self._grants.bar(actor_id)

    def take_joins(self) -> list[ActorJoin]:
        with self._lock:
            return self._grants.take_joins()

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return self._grants.metrics(self._codec.rejected)

    def connections(self) -> dict[str, int]:
        """Open connections admitted under the cap, by socket (control, rollout, weights)."""
        return {conns.name: conns.admitted() for conns in self._conns}

    def close(self) -> None:
        if self._waker.closed:  # closed already: a second close (a finally after an explicit one) does nothing
            return
        self._closed.set()
        self._waker.wake()
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)  # here, not in the I/O thread: the training thread may be reading the PULL socket
        self._waker.close()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"zmq learner I/O thread failed: {self._error!r}") from self._error

    # ---- the I/O thread ----------------------------------------------------------------------

    def _run(self) -> None:
        ctx = self._ctx
        keys, own = None, []
        try:
            if curve_on(self._zmq):
                require_keys(self._zmq.keys_dir, self._zmq.host)
                keys = ActorKeys(ctx, self._zmq.keys_dir).begin()
            seed_routing_ids()
            router, pull, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
            own = [router, pub]  # the PULL socket is the training thread's once bound; close() closes it
            self._limit(router, pull, pub)
            if keys is not None:
                for sock in (router, pull, pub):
                    secure_server(sock, self._zmq.keys_dir)
            cap = self._cap  # monitored before they bind: no connection goes uncounted
            self._conns = [
                _Connections(name, sock, cap)
                for name, sock in (("control", router), ("rollout", pull), ("weights", pub))
            ]
            self.ports = {
                "control": _bind(router, self._zmq.host, self._zmq.control_port),
                "rollout": _bind(pull, self._zmq.host, self._zmq.rollout_port),
                "weights": _bind(pub, self._zmq.host, self._zmq.weights_port),
            }
            self._pull, self._authenticated = pull, keys is not None
            self._control.authenticated = self._authenticated
            log.info(
                "zmq learner: at most %d connections a socket, holding at most %.1f GiB for their peers "
                "(broker.zmq.max_connections; see buffer_bound_bytes)",
                cap,
                buffer_bound_bytes(self._cfg, cap) / 2**30,
            )
            self._ready.set()
            self._loop(router, pub)
        except BaseException as err:  # surfaces in the training thread via _raise_if_failed
            self._error = err
            log.exception("zmq learner I/O thread failed")
        finally:
            self._ready.set()
            if keys is not None:
                keys.stop()
            for sock in own:
                sock.close(linger=0)

    def _limit(self, router: zmq.Socket, pull: zmq.Socket, pub: zmq.Socket) -> None:
        """Each socket's bounds per connection, set before it binds."""
        # no ROUTER_HANDOVER: a second connection under a routing id in use is refused and never displaces the
        # first; and each actor connection's routing id holds a nonce, so nobody can take it first
        router.setsockopt(zmq.MAXMSGSIZE, self._cfg.max_control_bytes)
        router.setsockopt(zmq.RCVHWM, control_mark(self._cfg))
        pull.setsockopt(zmq.MAXMSGSIZE, self._cfg.max_message_bytes)  # bigger frames drop the connection
        pull.setsockopt(zmq.RCVHWM, rollout_mark(self._cfg))
        pub.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_BYTES)
        pub.setsockopt(zmq.RCVHWM, SUBSCRIPTION_HWM)
        for sock in (router, pull, pub):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
            sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
            sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)

    def _loop(self, router: zmq.Socket, pub: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._waker.read_fd, zmq.POLLIN)
        monitors = {conns.monitor for conns in self._conns}
        for monitor in monitors:
            poller.register(monitor, zmq.POLLIN)
        while not self._closed.is_set():
            events = dict(poller.poll(timeout=POLL_MS))
            if monitors & events.keys():  # first: a connection beyond the cap is shut down before its handshake ends
                self._watch_connections()
            if self._waker.read_fd in events:
                self._waker.taken()
            if router in events:
                self._control.drain(router)
            self._repeat_announcement(pub)
            self._control.serve_parked(router, self._codec.encode)
            if (now := time.monotonic()) >= self._expire_at:
                self._expire_at = now + POLL_MS / 1000
                with self._lock:
                    self._grants.expire()

    def _watch_connections(self) -> None:
        for conns in refuse_beyond_cap(self._conns):
            self._refuse(
                "too_many_connections",
                f"a connection to the {conns.name} socket beyond its {conns.cap} (broker.zmq.max_connections)",
            )

    def _repeat_announcement(self, pub: zmq.Socket) -> None:
        with self._lock:
            frame, due = self._announcement, time.monotonic() >= self._announce_at
            if frame is not None and due:
                self._announce_at = time.monotonic() + ANNOUNCE_EVERY_S
        if frame is not None and due:
            pub.send(frame)

    def _accept(self, frame: zmq.Frame) -> RolloutGroup | None:
        """The frame's rollout, if it decodes, comes from the actor it names and was granted to it."""
        try:
            group = self._codec.decode(frame.buffer, expect=RolloutGroup)
        except WireError as err:
            self._sparse.warning(
                f"rollout frames rejected ({err.reason})", "rejected a frame on the rollout stream: %s", err
            )
            return None
        if self._authenticated and frame.get("User-Id") != group.actor_id:
            self._refuse(
                "impersonation",
                f"rollout {group.group_id} claims {group.actor_id!r} from the key of {frame.get('User-Id')!r}",
            )
            return None
        with self._lock:
            why = self._grants.returned(group.group_id, group.actor_id)
        if why is not None:
            self._refuse(why, f"rollout {group.group_id[:80]} from {group.actor_id}")
            return None
        return group

    def _refuse(self, reason: str, what: str) -> None:
        """Counted exactly (broker/rejected/<reason>); logged at the 1st, 10th, 100th ... of each reason."""
        with self._lock:
            self._grants.refused[reason] += 1
            count = self._grants.refused[reason]
        if power_of_ten(count):
            log.warning("refused %s: %s (#%d)", what, reason, count)


class ZmqActorTransport(ActorTransport):
    """Actor side, on the actor's asyncio loop."""

    def __init__(self, cfg: BrokerConfig, codec: WireCodec, actor_id: str):
        z = cfg.zmq
        if not (z.control_port and z.rollout_port and z.weights_port):
            raise ValueError(
                "broker.zmq.control_port, rollout_port and weights_port must be set for an actor "
                "(the launcher fills them in; on a cluster set them in the config)"
            )
        if curve_on(z):
            require_keys(z.keys_dir, z.host)
        self._codec = codec
        self._ctx = zmq.asyncio.Context()
        # the DEALER is a plain socket driven without the asyncio socket's futures and callbacks, which
        # cost more than the request itself; the event loop watches its FD (`_readable`). Not made by
        # the context, so close() closes it
        self._dealer = zmq.Socket(self._ctx, zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, routing_id(actor_id))
        self._push = self._ctx.socket(zmq.PUSH)
        # no high-water mark on the actor's side: a rollout it finished is queued at once. A mark here
        # stalled sends that had room: the socket learns that its I/O thread took messages only every
        # ~1 ms of sending, and a busy actor sends more than a mark of 64 in that time (6-11% of the
        # broker bench's groups waited a retry). The queue holds at most the groups granted to this actor
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.CONFLATE, 1)  # only the newest announcement matters
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        for sock, port in ((self._dealer, z.control_port), (self._push, z.rollout_port), (self._sub, z.weights_port)):
            sock.setsockopt(zmq.LINGER, 2000)
            sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
            if curve_on(z):
                secure_client(sock, z.keys_dir, actor_id)
            sock.connect(f"tcp://{z.host}:{port}")
        # the PUSH socket driven directly too: a send needs none of the asyncio socket's machinery,
        # which was most of a send's cost at 5 KB
        self._push_now = zmq.Socket.shadow(self._push.underlying)
        self._dealer_fd = self._dealer.FD
        self._watching: asyncio.AbstractEventLoop | None = None  # the loop that watches the DEALER's FD
        self._waiter: asyncio.Future | None = None  # a request waiting for its grant
        self._control_full = False  # the last control message found the queue to the learner full
        self._request_open, self._request_sent_at = False, 0.0
        self._actor_id = actor_id

    async def request_work(self, max_samples: int, timeout_s: float) -> list[PromptGroup]:
        now = time.monotonic()
        if not self._request_open or now - self._request_sent_at > REQUEST_AGAIN_S:
            # asked again when unanswered for long: the learner dropped it (rate limit) or restarted
            if (wait := self._request_sent_at + REQUEST_EVERY_S - now) > 0:
                await asyncio.sleep(wait)
            now = time.monotonic()
            if self._send_control(WorkRequest(actor_id=self._actor_id, max_samples=max_samples)):
                self._request_open, self._request_sent_at = True, now
        if not await self._readable(timeout_s):
            return []  # the request stays open; its grant is taken by the next call
        self._request_open = False
        return self._codec.decode(self._dealer.recv(zmq.NOBLOCK), expect=WorkGrant).groups

    def _send_control(self, msg: Heartbeat | WorkRequest) -> bool:
        """Queued for the learner; False when its queue is full (the learner has been unreachable for
        a thousand messages): a heartbeat is repeated anyway, and a request is sent again next time."""
        try:
            self._dealer.send(self._codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            if not self._control_full:
                log.warning(
                    "the learner takes no control messages (unreachable?): %s dropped, and every one until it does",
                    type(msg).__name__,
                )
            self._control_full = True
            return False
        self._control_full = False
        return True

    async def _readable(self, timeout_s: float) -> bool:
        """Whether a message waits on the DEALER, waiting up to `timeout_s` on the event loop. The FD
        only says that something may have changed; the socket's EVENTS says what."""
        deadline = time.monotonic() + timeout_s
        while not self._dealer.get(zmq.EVENTS) & zmq.POLLIN:
            if (remaining := deadline - time.monotonic()) <= 0:
                return False
            loop = asyncio.get_running_loop()
            if self._watching is not loop:
                self._unwatch()
                loop.add_reader(self._dealer_fd, self._dealer_changed)
                self._watching = loop
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(remaining, _resolve, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        return True

    def _dealer_changed(self) -> None:
        # reading EVENTS takes the socket's pending commands, which clears its FD: a level-triggered
        # selector would otherwise call this on every turn of the loop while nobody waits
        if self._dealer.get(zmq.EVENTS) & zmq.POLLIN and self._waiter is not None:
            _resolve(self._waiter)

    async def send_rollout(self, group: RolloutGroup) -> None:
        # queued at once: without a high-water mark the socket never refuses, so nothing waits or retries
        self._push_now.send(self._codec.encode(group), zmq.NOBLOCK, copy=False)

    async def next_announcement(self) -> WeightUpdate | Shutdown:
        while True:
            frame = await self._sub.recv()
            try:
                return self._codec.decode(frame, expect=(WeightUpdate, Shutdown))
            except WireError as err:
                log.warning("rejected a frame on the weight channel: %s", err)

    async def heartbeat(self, beat: Heartbeat) -> None:
        self._send_control(beat)

    def _unwatch(self) -> None:
        if self._watching is not None and not self._watching.is_closed():
            self._watching.remove_reader(self._dealer_fd)
        self._watching = None

    def close(self) -> None:
        self._unwatch()
        self._dealer.close(linger=0)
        self._ctx.destroy(linger=0)
