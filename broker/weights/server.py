"""The learner's side of the network weight channels: a server that keeps the newest versions'
payloads and answers every actor that proves it holds the channel's token, and the small framing
both sides of those channels speak (a request that opens with a magic and the token, a reply header
with a status, a body).

    accept loop (one thread) ─► a new connection waits, holding no thread, for its first request
                                (at most AUTH_TIMEOUT_S; at most MAX_PENDING wait, the oldest dropped first)
                             ─► the token compared in constant time: wrong ─► a short refusal, closed
                             ─► a handler thread while fewer than weights.max_connections run; when all are
                                taken, an idle one of the machine holding the most goes if that machine holds
                                more than one above the newcomer's; else "busy", at once
    handler                  ─► the channel's requests (each carrying the token) until the actor goes away

A stranger's connection gets nothing (no version list either) and never holds a handler thread, so
it cannot delay an honest actor. A token holder (every actor has the token) cannot take every slot
from the others either: the slots are shared fairly among the machines (by address: one per pod on
Kubernetes) that ask for them, an idle connection giving way first. The accept loop outlives any
error (no thread left, no descriptor left): it logs it, counts it, pauses a moment and serves on.
"""

from __future__ import annotations

import collections
import hmac
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from tidal.broker.schema import TOKEN_BYTES, TensorSpec, WeightBucket
from tidal.config import WeightsConfig

MAGIC = b"TDW2"
REPLY = struct.Struct("<4sBQ")  # magic, status, bytes that follow (the body, or an error text)
OK, NOT_SERVED, BAD_REQUEST, FAILED = 0, 1, 2, 3
QUEUED = 4  # no body: the request waits its turn, the answer follows (sent every so often while it waits)
UNAUTHORIZED, BUSY = 5, 6  # the request lacks the token; the learner serves as many connections as it will
DELTA = 7  # the body is what changed since the version the request says it holds (weights/delta.py)
MAX_ERROR_BYTES = 4096
KEEPALIVE_S = 30  # an idle connection's peer is probed after this long, then every this long, 4 times
MAX_PENDING = 128  # connections still to present their token; beyond it the oldest is dropped
AUTH_TIMEOUT_S = 5.0  # a connection presents its token within this long (or weights.tcp_timeout_s if shorter)
ACCEPT_BACKOFF_S = 0.1  # after a failed accept (no descriptor or thread left), before the next one
EVICT_WAIT_S = 1.0  # how long a newcomer waits for the slot an evicted idle connection frees
TOKEN_AT = slice(4, 4 + TOKEN_BYTES)  # where every request carries the token: right after its magic

log = logging.getLogger(__name__)


def new_token() -> bytes:
    """A weight channel's token: random bytes drawn once per learner process."""
    return secrets.token_bytes(TOKEN_BYTES)


@dataclass(eq=False)
class Served:
    """One version as the learner serves it."""

    payload: object  # torch uint8 [total] in host memory
    manifest: list[TensorSpec]
    buckets: list[WeightBucket]
    view: memoryview | None = None  # the payload's bytes, where a socket sends them
    users: int = field(default=0)  # connections sending it now (its buffer is reused only at 0)


@dataclass(eq=False)
class Pending:
    """A connection that has not yet presented its token: the bytes of its first request so far."""

    deadline: float
    received: bytearray = field(default_factory=bytearray)


class WeightServer:
    """Serves the newest `keep` versions from memory to the holders of `token`, one thread per
    authenticated connection (`_handle`), at most `max_connections` at once. A version's buffer is
    reused for a later one of the same size once it is no longer served and no connection still
    sends it: a pinned buffer costs seconds to allocate for a large model."""

    magic: bytes = MAGIC  # what a request of this channel opens with
    request_bytes: int = 4 + TOKEN_BYTES  # the size of a request of this channel (its first one included)

    def __init__(self, host: str, port: int, keep: int, timeout_s: float, max_connections: int):
        self.keep, self.timeout_s = keep, timeout_s
        self.token = new_token()
        self.versions: dict[int, Served] = {}
        self.retained: int | None = None  # the version the actors are told of: served whatever `keep` says
        self.retired: list[Served] = []  # no longer served; reusable once no connection sends them
        self.lock = threading.Lock()
        self.connections: dict[socket.socket, str] = {}  # each served connection's machine (its address)
        self.idle: set[socket.socket] = set()  # served connections waiting for their next request
        self.evicted = 0  # idle connections closed for a machine under its share of the slots
        self.handlers: set[threading.Thread] = set()  # one per authenticated connection, while it lasts
        self.slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections
        self.errors = 0  # connections ended by something other than the network (a bug: logged with its trace)
        self.accept_errors = 0  # failures of the accept loop itself (it serves on)
        self.refused: collections.Counter[str] = collections.Counter()  # by reason: unauthorized, busy, ...
        self.pending: collections.OrderedDict[socket.socket, Pending] = collections.OrderedDict()
        self.auth_timeout_s = min(AUTH_TIMEOUT_S, timeout_s)
        self.closed = False
        self.listener = socket.create_server((host, port), reuse_port=False)  # only where it is told
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()  # close() wakes the accept loop through it
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.thread = threading.Thread(target=self._accept, name="tidal-weight-server", daemon=True)
        self.thread.start()

    def add(self, version: int, served: Served) -> None:
        with self.lock:
            self.versions[version] = served
            for old in [v for v in self.versions if v <= version - self.keep and v != self.retained]:
                self.retired.append(self.versions.pop(old))

    def retain(self, version: int) -> None:
        """Keep serving `version`, the one the actors are told of, beyond `keep` (until another is); the
        one retained before goes once `keep` newer ones are in."""
        with self.lock:
            previous, self.retained = self.retained, version
            newest = max(self.versions, default=version)
            if (
                previous is not None
                and previous != version
                and previous in self.versions
                and previous <= newest - self.keep
            ):
                self.retired.append(self.versions.pop(previous))

    def buffer_for(self, total: int, pin: bool = False):
        """A uint8 [total] host buffer for a new version: a retired version's, else a new one (`pin`:
        page-locked, so that copies to a GPU run asynchronously)."""
        import torch

        with self.lock:
            for served in self.retired:
                if served.users == 0 and served.payload.numel() == total:
                    self.retired.remove(served)
                    return served.payload
            self.retired = [s for s in self.retired if s.users > 0]  # the others are freed with their last user
        return torch.empty(total, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())

    def lease(self, version: int) -> tuple[Served | None, list[int]]:
        """(the version, marked as being sent until `release`d, or None; the versions served)."""
        with self.lock:
            served = self.versions.get(version)
            if served is not None:
                served.users += 1
            return served, sorted(self.versions)

    def release(self, served: Served) -> None:
        with self.lock:
            served.users -= 1

    def authentic(self, request: bytes) -> bool:
        """Whether `request` is this channel's and carries the token (compared in constant time)."""
        return request[:4] == self.magic and hmac.compare_digest(request[TOKEN_AT], self.token)

    # ---- the accept loop: one thread, no thread per connection until it is authenticated ----------

    def _accept(self) -> None:
        try:
            while not self.closed:
                try:
                    self._poll()
                except Exception:  # noqa: BLE001 - no descriptor or thread left, or a bug: serve on
                    self.accept_errors += 1
                    if self.accept_errors & (self.accept_errors - 1) == 0:  # the 1st, 2nd, 4th, ...: cannot flood
                        log.exception(
                            "weight server: accepting a connection failed (%d failures so far); it serves on",
                            self.accept_errors,
                        )
                    time.sleep(ACCEPT_BACKOFF_S)
        finally:
            for conn in list(self.pending):
                self._forget(conn)
            self.selector.close()

    def _poll(self) -> None:
        """One turn: take new connections, read what waiting ones sent, drop those past their deadline."""
        wait_s = min((p.deadline for p in self.pending.values()), default=time.monotonic() + 1.0) - time.monotonic()
        for key, _ in self.selector.select(timeout=max(0.0, wait_s)):
            if key.fileobj is self.listener:
                self._admit()
            elif key.fileobj is self.wake_r:
                self.wake_r.recv(64)
            else:
                self._read_opening(key.fileobj)
        now = time.monotonic()
        for conn in [c for c, p in self.pending.items() if p.deadline <= now]:
            self.refused["no token in time"] += 1
            self._forget(conn)

    def _admit(self) -> None:
        try:
            conn = self._take_connection()
        except BlockingIOError:
            return  # another wake-up took it
        conn.setblocking(False)
        if len(self.pending) >= MAX_PENDING:  # a flood of silent connections: the oldest goes first
            self.refused["too many waiting"] += 1
            self._forget(next(iter(self.pending)))
        self.pending[conn] = Pending(time.monotonic() + self.auth_timeout_s)
        self.selector.register(conn, selectors.EVENT_READ)

    def _take_connection(self) -> socket.socket:
        return self.listener.accept()[0]

    def _read_opening(self, conn: socket.socket) -> None:
        pending = self.pending.get(conn)
        if pending is None:  # dropped for a newer connection earlier in this same pass of the loop
            return
        try:
            data = conn.recv(self.request_bytes - len(pending.received))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._forget(conn)
            return
        pending.received += data
        if len(pending.received) < self.request_bytes:
            return
        self.selector.unregister(conn)
        del self.pending[conn]
        if not self.authentic(bytes(pending.received)):
            self._refuse(
                conn,
                "unauthorized",
                UNAUTHORIZED,
                "the request does not carry this learner's weight token (it travels in the weight "
                "announcements): refused",
            )
            return
        self._dispatch(conn, bytes(pending.received))

    def _dispatch(self, conn: socket.socket, opening: bytes) -> None:
        """An authenticated connection onto a handler thread of its own, while fewer than max_connections run
        (or an idle one of a machine over its share gives way)."""
        machine = _machine(conn)
        if not self.slots.acquire(blocking=False) and not self._make_room(machine):
            self._refuse(
                conn,
                "busy",
                BUSY,
                f"the learner serves {self.max_connections} weight connections already; try again later",
            )
            return
        conn.setblocking(True)
        conn.settimeout(self.timeout_s)  # an actor that stops reading frees its thread
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a reply's header must not wait for an ACK
        keepalive(conn)
        handler = threading.Thread(target=self._serve, args=(conn, opening), name="tidal-weight-send", daemon=True)
        with self.lock:
            self.connections[conn] = machine
            self.handlers.add(handler)
        try:
            handler.start()
        except BaseException:  # no thread left: this connection is closed, the loop serves on
            with self.lock:
                self.connections.pop(conn, None)
                self.handlers.discard(handler)
            self.slots.release()
            conn.close()
            raise

    def _make_room(self, machine: str) -> bool:
        """All slots are taken: if the machine holding the most holds more than one above `machine`, one of
        its idle connections is closed (its actor connects again when it next needs weights) and its slot
        goes to `machine`. Whether a slot was taken."""
        with self.lock:
            held = collections.Counter(self.connections.values())
            heaviest, most = max(held.items(), key=lambda item: item[1], default=("", 0))
            victim = next((c for c in self.idle if self.connections.get(c) == heaviest), None)
            if most <= held[machine] + 1 or victim is None:
                return False
            self.idle.discard(victim)
            self.evicted += 1
            if self.evicted & (self.evicted - 1) == 0:  # the 1st, 2nd, 4th, ...: cannot flood the log
                log.warning(
                    "weight server: %s holds %d of the %d connections; an idle one was closed for %s (%d so far)",
                    heaviest,
                    most,
                    self.max_connections,
                    machine,
                    self.evicted,
                )
        try:
            victim.shutdown(socket.SHUT_RDWR)  # its handler sees the end of the stream and frees its slot
        except OSError:
            pass  # ended by itself meanwhile: its slot frees all the same
        return self.slots.acquire(timeout=EVICT_WAIT_S)

    def next_request(self, conn: socket.socket, nbytes: int, idle_s: float | None) -> bytes | None:
        """The connection's next `nbytes`-byte request: its first byte within `idle_s` (None: as long as
        the peer likes), the rest within weights.tcp_timeout_s. None when the peer closed the connection
        or it was closed to make room. While it waits, the connection may give way to another machine's."""
        with self.lock:
            self.idle.add(conn)
        try:
            conn.settimeout(idle_s)  # None: a dead peer's machine is found by keepalive, not by a timeout
            if not conn.recv(1, socket.MSG_PEEK):
                return None
        finally:
            with self.lock:
                self.idle.discard(conn)
            conn.settimeout(self.timeout_s)
        return recv_exact(conn, nbytes, eof_ok=True)

    def _refuse(self, conn: socket.socket, reason: str, status: int, text: str) -> None:
        self.refused[reason] += 1
        try:
            conn.send(error_reply(status, text))  # a few dozen bytes into an empty send buffer: never blocks
            conn.recv(1 << 16)  # what else already came: closed unread, it would reset the refusal away
        except OSError:
            pass  # gone already, or nothing else came
        conn.close()

    def _forget(self, conn: socket.socket) -> None:
        self.pending.pop(conn, None)
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass  # never registered, or the selector is closed
        conn.close()

    def _serve(self, conn: socket.socket, opening: bytes) -> None:
        try:
            self._handle(conn, opening)
        except OSError:
            pass  # the actor went away or stalled; it reports its own error, and the learner carries on
        except Exception:  # noqa: BLE001 - one actor's connection never takes the learner down
            with self.lock:
                self.errors += 1
            log.exception(
                "weight server: the connection from %s failed; it was closed and the learner carries on", _peer(conn)
            )
        finally:
            with self.lock:
                self.connections.pop(conn, None)
                self.idle.discard(conn)
                self.handlers.discard(threading.current_thread())
            conn.close()
            self.slots.release()

    def _handle(self, conn: socket.socket, opening: bytes) -> None:
        """Answer one actor's requests, `opening` (authenticated) the first, until it goes away."""
        raise NotImplementedError

    def wait_for_handlers(self, timeout_s: float) -> bool:
        """Whether every connection's thread ended within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            handlers = list(self.handlers)
        for handler in handlers:
            handler.join(max(0.0, deadline - time.monotonic()))
        return not any(handler.is_alive() for handler in handlers)

    def close(self) -> None:
        """Stop serving: refuse new connections and cut the open ones (their actors see a reset)."""
        self.closed = True
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass  # closed by an earlier close()
        if self.thread is not threading.current_thread():
            self.thread.join(5.0)
        self.listener.close()
        self.wake_r.close()
        self.wake_w.close()
        with self.lock:
            for conn in list(self.connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # closed by its own thread meanwhile
            self.versions.clear()
            self.retired.clear()


def keepalive(conn: socket.socket) -> None:
    """TCP keepalive on `conn`: a peer whose machine vanished ends an idle connection within minutes
    (no read timeout does it: a healthy connection idles between versions for as long as a step takes)."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_S), ("TCP_KEEPINTVL", KEEPALIVE_S), ("TCP_KEEPCNT", 4)):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _machine(conn: socket.socket) -> str:
    """The peer's address without its port: the machine (or pod) the connection comes from."""
    try:
        return conn.getpeername()[0]
    except OSError:
        return ""


def _peer(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "an actor"


def advertised(cfg: WeightsConfig, port: int) -> str:
    """host:port as the actors dial it."""
    host = cfg.tcp_advertise or (socket.getfqdn() if cfg.tcp_host in ("0.0.0.0", "::", "") else cfg.tcp_host)
    return f"{host}:{port}"


def reply(status: int, body: bytes = b"") -> bytes:
    return REPLY.pack(MAGIC, status, len(body)) + body


def error_reply(status: int, text: str) -> bytes:
    return reply(status, text.encode()[:MAX_ERROR_BYTES])


def read_reply(conn: socket.socket, where: str, max_bytes: int = MAX_ERROR_BYTES) -> bytes:
    """The learner's reply body; its refusal raises ValueError with the learner's reason."""
    magic, status, nbytes = REPLY.unpack(recv_exact(conn, REPLY.size))
    while magic == MAGIC and status == QUEUED and nbytes == 0:  # each one restarts the read's timeout
        magic, status, nbytes = REPLY.unpack(recv_exact(conn, REPLY.size))
    if magic != MAGIC:
        raise ValueError(f"{where}: not a tidal weight server's reply (magic {magic!r})")
    if nbytes > max_bytes:
        raise ValueError(f"{where}: a {nbytes}-byte reply, more than the {max_bytes} expected")
    body = recv_exact(conn, nbytes) if nbytes else b""
    if status != OK:
        raise refusal(where, status, body.decode(errors="replace"))
    return body


def refusal(where: str, status: int, reason: str) -> Exception:
    """The error for a refused request. A learner serving its most connections, or one that no longer
    knows the token (a restarted learner process: its next announcement carries a new one), says
    nothing about this actor: ConnectionError, which an actor does not count toward giving up."""
    message = f"{where}: refused by the learner: {reason}"
    return ConnectionError(message) if status in (BUSY, UNAUTHORIZED) else ValueError(message)


def recv_exact(sock: socket.socket, nbytes: int, eof_ok: bool = False) -> bytes | None:
    """Exactly `nbytes`; None at a clean end of stream when `eof_ok`, else a cut stream raises."""
    buf = bytearray(nbytes)
    if recv_into_exact(sock, memoryview(buf), eof_ok) is None:
        return None
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, eof_ok: bool = False) -> int | None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if eof_ok and got == 0:
                return None
            raise ConnectionError(f"connection closed after {got} of {len(view)} bytes")
        got += n
    return got


def parse_location(location: str) -> tuple[str, int]:
    host, sep, port = location.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"weight location {location!r} is not host:port")
    return host.strip("[]"), int(port)
