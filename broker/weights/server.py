"""The learner's side of the network weight channels: a server that keeps the newest versions'
payloads and answers each connected actor on a thread of its own, and the small framing both
sides of those channels speak (a request struct, a reply header with a status, a body)."""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from tidal.broker.schema import TensorSpec, WeightBucket
from tidal.config import WeightsConfig

MAGIC = b"TDW1"
REPLY = struct.Struct("<4sBQ")  # magic, status, bytes that follow (the body, or an error text)
OK, NOT_SERVED, BAD_REQUEST, FAILED = 0, 1, 2, 3
QUEUED = 4  # no body: the request waits its turn, the answer follows (sent every so often while it waits)
MAX_ERROR_BYTES = 4096
KEEPALIVE_S = 30  # an idle connection's peer is probed after this long, then every this long, 4 times

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Served:
    """One version as the learner serves it."""

    payload: object  # torch uint8 [total] in host memory
    manifest: list[TensorSpec]
    buckets: list[WeightBucket]
    view: memoryview | None = None  # the payload's bytes, where a socket sends them
    users: int = field(default=0)  # connections sending it now (its buffer is reused only at 0)


class WeightServer:
    """Serves the newest `keep` versions from memory, one thread per connected actor (`_handle`).
    A version's buffer is reused for a later one of the same size once it is no longer served and no
    connection still sends it: a pinned buffer costs seconds to allocate for a large model."""

    def __init__(self, host: str, port: int, keep: int, timeout_s: float):
        self.keep, self.timeout_s = keep, timeout_s
        self.versions: dict[int, Served] = {}
        self.retired: list[Served] = []  # no longer served; reusable once no connection sends them
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()
        self.handlers: set[threading.Thread] = set()  # one per connection, while it lasts
        self.errors = 0  # connections ended by something other than the network (a bug: logged with its trace)
        self.listener = socket.create_server((host, port), reuse_port=False)
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._accept, name="tidal-weight-server", daemon=True)
        self.thread.start()

    def add(self, version: int, served: Served) -> None:
        with self.lock:
            self.versions[version] = served
            for old in [v for v in self.versions if v <= version - self.keep]:
                self.retired.append(self.versions.pop(old))

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

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # the listener was closed: the publisher is done
                return
            conn.settimeout(self.timeout_s)  # an actor that stops reading frees its thread
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a reply's header must not wait for an ACK
            keepalive(conn)
            handler = threading.Thread(target=self._serve, args=(conn,), name="tidal-weight-send", daemon=True)
            with self.lock:
                self.connections.add(conn)
                self.handlers.add(handler)
            handler.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._handle(conn)
        except OSError:
            pass  # the actor went away or stalled; it reports its own error, and the learner carries on
        except Exception:  # noqa: BLE001 - one actor's connection never takes the learner down
            with self.lock:
                self.errors += 1
            log.exception("weight server: the connection from %s failed; it was closed and the learner "
                          "carries on", _peer(conn))
        finally:
            with self.lock:
                self.connections.discard(conn)
                self.handlers.discard(threading.current_thread())
            conn.close()

    def _handle(self, conn: socket.socket) -> None:
        """Answer one actor's requests until it goes away."""
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
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass  # not connected: some systems refuse shutdown on a listening socket
        self.listener.close()
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
        raise ValueError(f"{where}: refused by the learner: {body.decode(errors='replace')}")
    return body


def recv_exact(sock: socket.socket, nbytes: int, eof_ok: bool = False) -> bytes | None:
    """Exactly `nbytes`; None at a clean end of stream when `eof_ok`, else a cut stream raises."""
    buf = bytearray(nbytes)
    if recv_into_exact(sock, memoryview(buf), eof_ok) is None:
        return None
    return bytes(buf)


def next_request(conn: socket.socket, nbytes: int, timeout_s: float) -> bytes | None:
    """The next `nbytes`-byte request on a connection that may idle for as long as the peer likes
    (between versions: a training step, an evaluation); once its first byte is in, the rest must
    follow within `timeout_s`. None when the peer closed the connection."""
    conn.settimeout(None)  # a dead peer's machine is found by keepalive, not by a read timeout
    try:
        if not conn.recv(1, socket.MSG_PEEK):
            return None
    finally:
        conn.settimeout(timeout_s)
    return recv_exact(conn, nbytes, eof_ok=True)


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
