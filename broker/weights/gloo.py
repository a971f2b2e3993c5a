"""The gloo data plane of the collective weight channel (`weights.transport: gloo`, CPUs): a torch
gloo process group per actor engine; a version goes out as its buckets (byte ranges of whole
tensors, a sha256 each), and each worker checks and loads every bucket as it lands. gloo's
operations block and raise, so a peer that dies or stalls surfaces as an error after the group's
timeout (weights.tcp_timeout_s). GLOO_SOCKET_IFNAME picks the workers' interface.

A group's rendezvous keys (each rank's gloo address) live in the learner's memory, one store per
group, and no store has a port of its own: the learner's rank reads its group's store directly,
and each worker reaches it through the learner's weight port, one authenticated operation a
connection (`RemoteStore` ─► STORE ─► `GroupStore.serve`). A stranger can neither read nor write a
key, and a group's keys are bounded in bytes and go with the group.
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import socket
import struct
import threading
import uuid

from tidal.broker.schema import WeightUpdate
from tidal.broker.weights import server
from tidal.broker.weights.base import InitInfo, StreamedLoad, digest_problem
from tidal.broker.weights.collective import STORE, CollectiveTransport, Plane, control
from tidal.broker.weights.payload import in_bucket, tensors_of
from tidal.broker.weights.server import Served, error_reply, read_reply, recv_exact, reply

NAME = "gloo"
STORE_OP = struct.Struct("<BHI")  # op, key bytes, value bytes; then the key, then the value
SET, GET, WAIT, ADD, CHECK, DELETE = 1, 2, 3, 4, 5, 6
MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 64 << 10  # a rank's gloo address is a few hundred bytes
MAX_STORE_BYTES = 1 << 20  # all of one group's keys and values: far above what a rendezvous writes


def new_group(store, rank: int, world_size: int, timeout_s: float, host: str = ""):
    """A gloo process group over `store`; blocks until every rank is in, or `timeout_s`. Built
    directly, not through init_process_group: the learner's own default group (its training ranks)
    stays untouched. `host`: the address this rank's gloo listens on (empty: gloo's default)."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [
        dist.ProcessGroupGloo.create_device(hostname=host) if host else dist.ProcessGroupGloo.create_default_device()
    ]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def broadcast(group, tensor) -> None:
    """Rank 0's `tensor` into every other rank's; a peer gone or timed out raises RuntimeError."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def bound_host(host: str) -> str:
    """Where the learner's gloo listens: weights.tcp_host, unless that names every interface."""
    return "" if host in ("", "0.0.0.0", "::") else host


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# ---- a group's rendezvous keys, in the learner's memory ------------------------------------------


class GroupStore:
    """One group's keys: the learner's rank uses `store` (a torch HashStore) directly; each worker's
    operations arrive through `serve`, checked and bounded in bytes."""

    def __init__(self, timeout_s: float):
        import torch.distributed as dist

        self.store = dist.HashStore()
        self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.nbytes = 0  # what the workers have written

    def serve(self, conn: socket.socket) -> None:
        """Read one operation from `conn`, apply it, answer."""
        op, key_bytes, value_bytes = STORE_OP.unpack(recv_exact(conn, STORE_OP.size))
        if not SET <= op <= DELETE or key_bytes > MAX_KEY_BYTES or value_bytes > MAX_VALUE_BYTES:
            conn.sendall(
                error_reply(
                    server.BAD_REQUEST,
                    f"store operation {op} with a {key_bytes}-byte key and a "
                    f"{value_bytes}-byte value (at most {MAX_KEY_BYTES} and "
                    f"{MAX_VALUE_BYTES})",
                )
            )
            return
        key = recv_exact(conn, key_bytes).decode(errors="replace")
        value = recv_exact(conn, value_bytes)
        try:
            conn.sendall(reply(server.OK, self._apply(op, key, value)))
        except (RuntimeError, ValueError) as err:  # a wait that timed out, a store full
            conn.sendall(error_reply(server.FAILED, f"store operation {op} on {key!r}: {err}"))

    def _apply(self, op: int, key: str, value: bytes) -> bytes:
        if op in (SET, ADD):
            self._count(len(key) + len(value))
        if op == SET:
            self.store.set(key, value)
            return b""
        if op == GET:
            return self.store.get(key)
        if op == WAIT:
            wait_ms = min(int.from_bytes(value[:8], "little"), int(self.timeout_s * 1000))
            self.store.wait([key], datetime.timedelta(milliseconds=wait_ms))
            return b""
        if op == ADD:
            total = self.store.add(key, int.from_bytes(value[:8], "little", signed=True))
            return total.to_bytes(8, "little", signed=True)
        if op == CHECK:
            return b"\x01" if self.store.check([key]) else b"\x00"
        return b"\x01" if self.store.delete_key(key) else b"\x00"

    def _count(self, nbytes: int) -> None:
        with self.lock:
            if self.nbytes + nbytes > MAX_STORE_BYTES:
                raise ValueError(f"the group's keys would take more than {MAX_STORE_BYTES} bytes: refused")
            self.nbytes += nbytes


def remote_store_class():
    """`RemoteStore`, a torch.distributed.Store, built on first use (only where torch is imported)."""
    global _remote_store_class
    if _remote_store_class is None:
        import torch.distributed as dist

        class RemoteStore(dist.Store):
            """A worker's view of its group's keys in the learner: each operation one connection to the
            learner's weight port, opened with the announcement's token."""

            def __init__(self, location: str, token: bytes, group_id: int, timeout_s: float):
                super().__init__()
                self.address, self.location = server.parse_location(location), location
                self.token, self.group_id, self.timeout_s = token, group_id, timeout_s

            def _call(self, op: int, key: str, value: bytes = b"") -> bytes:
                where = f"the weight group's rendezvous at {self.location}"
                data = key.encode()
                request = control(self.token, STORE, self.group_id) + STORE_OP.pack(op, len(data), len(value))
                try:
                    with socket.create_connection(self.address, timeout=self.timeout_s + 5) as conn:
                        conn.sendall(request + data + value)
                        return read_reply(conn, where, max_bytes=MAX_VALUE_BYTES)
                except (OSError, ValueError) as err:
                    raise dist.DistStoreError(f"{where}: {err}") from None

            def set(self, key, value) -> None:
                self._call(SET, key, value if isinstance(value, bytes) else str(value).encode())

            def get(self, key) -> bytes:
                return self._call(GET, key)

            def wait(self, keys, timeout=None) -> None:
                wait_s = self.timeout_s if timeout is None else timeout.total_seconds()
                for key in keys:
                    self._call(WAIT, key, int(wait_s * 1000).to_bytes(8, "little"))

            def add(self, key, value) -> int:
                return int.from_bytes(
                    self._call(ADD, key, int(value).to_bytes(8, "little", signed=True)), "little", signed=True
                )

            def check(self, keys) -> bool:
                return all(self._call(CHECK, key) == b"\x01" for key in keys)

            def delete_key(self, key) -> bool:
                return self._call(DELETE, key) == b"\x01"

        _remote_store_class = RemoteStore
    return _remote_store_class


_remote_store_class = None


# ---- the plane ------------------------------------------------------------------------------------


class _LearnerGroup:
    def __init__(self, group, on_end):
        self.group, self.on_end = group, on_end

    def abort(self) -> None:
        self.on_end()
        self.group.abort()


class GlooPlane(Plane):
    name = NAME
    checksums = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.stores: dict[int, GroupStore] = {}  # each forming or formed group's keys, by its number
        self.numbers = itertools.count(1)
        self.lock = threading.Lock()  # actors join on connection threads of their own, maybe at once

    def mint(self, num_workers: int, bucket_bytes: int) -> dict:
        number = next(self.numbers)
        with self.lock:
            self.stores[number] = GroupStore(self.cfg.tcp_timeout_s)
        return {"group_id": number, "group": f"tidal-weights-{uuid.uuid4().hex[:12]}", "world_size": 1 + num_workers}

    def form(self, spec: dict, timeout_s: float) -> _LearnerGroup:
        with self.lock:
            store = self.stores[spec["group_id"]]
        group = new_group(store.store, 0, spec["world_size"], timeout_s, bound_host(self.cfg.tcp_host))
        return _LearnerGroup(group, lambda: self.abandon(spec))

    def abandon(self, spec: dict) -> None:
        with self.lock:
            self.stores.pop(spec["group_id"], None)

    def serve_store(self, conn: socket.socket, group_id: int) -> None:
        with self.lock:
            store = self.stores.get(group_id)
        if store is None:
            conn.sendall(error_reply(server.NOT_SERVED, f"no weight group {group_id} is forming or formed here"))
            return
        store.serve(conn)

    def send(self, group: _LearnerGroup, served: Served, progress) -> None:
        for bucket in served.buckets:
            broadcast(group.group, served.payload[bucket.offset : bucket.offset + bucket.nbytes])
            progress()

    @classmethod
    def join(cls, engine, init: InitInfo) -> GlooMember:
        spec = init.group
        learner_host, _ = server.parse_location(spec["location"])
        store = remote_store_class()(
            spec["location"], bytes.fromhex(spec["token"]), int(spec["group_id"]), init.timeout_s
        )
        # a learner on loopback keeps the whole group there: nothing of it listens on another interface
        host = "127.0.0.1" if is_loopback(learner_host) else ""
        group = new_group(store, 1 + engine.worker_rank, int(spec["world_size"]), init.timeout_s, host)
        return GlooMember(store, group, StreamedLoad(engine.load_target, engine.model_config))


class GlooMember:
    """A worker's side of its engine's group: receives each bucket, checks its sha256 and loads it."""

    def __init__(self, store, group, load: StreamedLoad):
        self.store, self.group, self.load = store, group, load

    def start(self) -> None:
        self.load.start()

    def receive(self, update: WeightUpdate) -> None:
        import torch

        try:
            for index, bucket in enumerate(update.buckets):
                buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
                broadcast(self.group, buffer)
                if problem := digest_problem(buffer.numpy(), bucket, index):
                    raise ValueError(f"weights v{update.version} bucket {index}: {problem} in transit, refused")
                self.load.load(tensors_of(in_bucket(update.manifest, bucket), buffer, base=bucket.offset))
        except BaseException:
            self.load.abandon()
            raise

    def finish(self) -> None:
        self.load.finish()

    def close(self) -> None:
        self.group.abort()


TRANSPORT = CollectiveTransport(GlooPlane)
