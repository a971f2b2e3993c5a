"""The collective weight channel (`weights.transport`: `gloo` on CPU, `nccl` on GPU): each vLLM
worker forms a two-rank process group with the learner and receives every version as a broadcast
of its buckets, straight into its own memory (the GPU's, with NCCL). The same code runs both;
only torch's process group differs.

    learner  CollectivePublisher.publish ─► payload (one buffer on the learner's device) + buckets ─► GroupServer
    worker   in a thread of its own while the engine generates (weights.tcp_prefetch):
               join once: a control connection to the learner ─► a process group over its TCPStore
               ask for version v ─► every bucket by broadcast into a reused buffer (crc32 checked on CPU)
             inside AsyncLLM.update_weights, the engine paused: wait for it ─► load in place (the
             recorded copy plan, as the tcp channel)

A group per worker, not one per actor: a worker that dies or stalls fails only its own group (the
learner's thread for it errors or times out and drops it), never the learner's loop or another
actor; a joining or restarted worker forms a new one on its first update; a new learner process
(a new incarnation) makes every worker form its group again. Pull, not push: a worker asks for the
version it was told of, so an actor that joins late is sent the current one like any other.

The gloo and NCCL groups pick their network interface by the host's name; GLOO_SOCKET_IFNAME and
NCCL_SOCKET_IFNAME choose another.
"""
from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import uuid
import zlib
from dataclasses import dataclass

from tidal.broker.schema import WeightBucket, WeightUpdate
from tidal.broker.weights import tcp
from tidal.broker.weights.base import WeightPublisher, WeightReceiver, split_buckets
from tidal.broker.weights.tcp import Served, WeightServer, load_payload, pack, payload_bytes
from tidal.broker.weights.vllm_engine import VLLM_BACKEND, load_in_worker, update_info
from tidal.config import WeightsConfig

__all__ = ["BACKENDS", "CollectivePublisher", "CollectiveReceiver", "leave", "load_in_worker", "load_received",
           "prefetch", "prefetched", "receive"]

BACKENDS = ("gloo", "nccl")  # the transports this module carries: torch's process-group backends
CONTROL = struct.Struct("<4sBQ")  # magic, op, version
CONTROL_MAGIC = b"TDG1"
JOIN, FETCH = 1, 2


def new_group(backend: str, store, name: str, rank: int, timeout_s: float):
    """A two-rank process group (the learner is rank 0) under `name` in `store`; blocks until both
    ranks are in, or `timeout_s`. Built directly, not through init_process_group: the learner's own
    default group (its training ranks) stays untouched."""
    import datetime

    import torch.distributed as dist

    prefixed, timeout = dist.PrefixStore(name, store), datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)


def device_for(backend: str):
    """Where a version's payload lives for `backend`: this process's GPU for NCCL, else host memory."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def broadcast(group, tensor) -> None:
    """Rank 0's `tensor` into every other rank's; an error (a peer gone, a timeout) raises RuntimeError."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def read_reply(conn: socket.socket, where: str) -> bytes:
    """The learner's reply body; its refusal raises ValueError with the learner's reason."""
    magic, status, nbytes = tcp.REPLY.unpack(tcp.recv_exact(conn, tcp.REPLY.size))
    if magic != tcp.MAGIC:
        raise ValueError(f"{where}: not a tidal weight server's reply (magic {magic!r})")
    body = tcp.recv_exact(conn, nbytes) if nbytes else b""
    if status != tcp.OK:
        raise ValueError(f"{where}: refused by the learner: {body.decode(errors='replace')}")
    return body


# ---- the learner's side ------------------------------------------------------------------------

class GroupServer(WeightServer):
    """Serves the newest `keep` versions to the workers connected to it, one thread and one process
    group per worker. A worker's control connection carries JOIN (the reply names the group; both
    sides then form it) and FETCH version (the reply says yes or why not; on yes every bucket follows
    by broadcast)."""

    def __init__(self, backend: str, host: str, port: int, keep: int, timeout_s: float):
        import datetime

        import torch.distributed as dist

        super().__init__(host, port, keep, timeout_s)
        self.backend = backend
        self.store = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)

    def _handle(self, conn: socket.socket) -> None:
        group = None
        while (request := tcp.recv_exact(conn, CONTROL.size, eof_ok=True)) is not None:
            magic, op, version = CONTROL.unpack(request)
            if magic != CONTROL_MAGIC or op not in (JOIN, FETCH):
                conn.sendall(tcp.error_reply(tcp.BAD_REQUEST, f"not a tidal group request (magic {magic!r}, op {op})"))
                return
            if op == JOIN:
                name = f"tidal-weights-{uuid.uuid4().hex[:12]}"
                spec = json.dumps({"backend": self.backend, "store_port": self.store.port, "group": name}).encode()
                conn.sendall(tcp.REPLY.pack(tcp.MAGIC, tcp.OK, len(spec)) + spec)
                group = new_group(self.backend, self.store, name, 0, self.timeout_s)
                continue
            with self.lock:
                served, known = self.versions.get(version), sorted(self.versions)
            if group is None or served is None:
                why = "join first" if group is None else f"version {version} is not served here (served: {known})"
                conn.sendall(tcp.error_reply(tcp.NOT_SERVED, why))
                continue
            conn.sendall(tcp.REPLY.pack(tcp.MAGIC, tcp.OK, 0))
            for bucket in served.buckets:
                broadcast(group, served.payload[bucket.offset:bucket.offset + bucket.nbytes])
            if served.payload.is_cuda:  # NCCL's wait() only orders streams: done here before the payload may go
                import torch

                torch.cuda.current_stream(served.payload.device).synchronize()


class CollectivePublisher(WeightPublisher):
    """Keeps the newest `keep` versions in memory (the GPU's, with NCCL) and serves them to every
    worker that asks, on weights.tcp_host:tcp_port."""

    def __init__(self, cfg: WeightsConfig, incarnation: str = "", dtype: str | None = None):
        if cfg.transport == "nccl":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("config key 'weights.transport' = 'nccl' needs CUDA on the learner and the actors; "
                                 "on CPU use gloo")
        self.backend, self.incarnation, self.dtype = cfg.transport, incarnation, dtype
        self.bucket_bytes = cfg.bucket_mib << 20
        self.server = GroupServer(cfg.transport, cfg.tcp_host, cfg.tcp_port, max(cfg.keep, 2), cfg.tcp_timeout_s)
        self.location = tcp.advertised(cfg, self.server.port)

    def publish(self, named_tensors: dict, version: int) -> WeightUpdate:
        payload, manifest = pack(named_tensors, self.dtype, device_for(self.backend))
        if payload.is_cuda:  # a crc32 would mean copying the payload to the host: NCCL's transfers are checked
            buckets = [WeightBucket(offset=o, nbytes=min(self.bucket_bytes, payload.numel() - o), crc32=0)
                       for o in range(0, payload.numel(), self.bucket_bytes)]
        else:
            buckets = split_buckets(memoryview(payload.numpy()), self.bucket_bytes)
        self.server.add(version, Served(payload, None, buckets))
        return WeightUpdate(version=version, transport=self.backend, location=self.location, manifest=manifest,
                            checksum="", incarnation=self.incarnation, buckets=buckets)

    def close(self) -> None:
        self.server.close()


# ---- the actor's side ------------------------------------------------------------------------

class CollectiveReceiver(WeightReceiver):
    """The workers receive each version themselves, into the memory the model loads from (no
    staging on the actor's side): by default in a thread of each worker's own while the engine
    generates (`weights.tcp_prefetch`), so the pause holds only the load; else inside the pause."""

    vllm_backend = VLLM_BACKEND

    def __init__(self, cfg: WeightsConfig):
        self.cfg = cfg
        self.lock = asyncio.Lock()  # one version at a time through the workers' buffers

    async def apply(self, update: WeightUpdate, engine) -> float:
        if update.transport != self.cfg.transport:
            raise ValueError(f"weights v{update.version} came by {update.transport!r}; "
                             f"this actor takes {self.cfg.transport!r}")
        payload_bytes(update)  # a malformed announcement is refused before the engine pauses
        info = update_info(update.transport, update, "", self.cfg.tcp_timeout_s)
        async with self.lock:
            if self.cfg.tcp_prefetch:
                await engine.prefetch_weights(info)
            return await engine.transfer_weights(update.version, update.transport, info)


# ---- inside each vLLM worker ------------------------------------------------------------------

@dataclass
class Membership:
    """A worker's place in its group with one learner process: kept across versions."""

    learner: tuple[str, str]  # (location, incarnation)
    conn: socket.socket
    store: object
    group: object
    buffer: object = None  # torch uint8 [payload bytes] on the worker's device, reused while the size holds


_member: Membership | None = None


def join(update: WeightUpdate, backend: str, timeout_s: float) -> Membership:
    import datetime

    import torch.distributed as dist

    host, port = tcp.parse_location(update.location)
    conn = socket.create_connection((host, port), timeout=timeout_s)
    try:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(CONTROL.pack(CONTROL_MAGIC, JOIN, 0))
        spec = json.loads(read_reply(conn, f"joining the learner at {update.location}"))
        if spec["backend"] != backend:
            raise ValueError(f"the learner at {update.location} serves weights by {spec['backend']}, not {backend}")
        store = dist.TCPStore(host, spec["store_port"], None, False, timeout=datetime.timedelta(seconds=timeout_s))
        group = new_group(backend, store, spec["group"], 1, timeout_s)
    except BaseException:
        conn.close()
        raise
    return Membership((update.location, update.incarnation), conn, store, group)


def leave() -> None:
    """Drop this worker's group and connection (the learner's thread for it ends)."""
    global _member
    member, _member = _member, None
    if member is not None:
        member.conn.close()


def receive(update: WeightUpdate, backend: str, timeout_s: float):
    """Every bucket of `update` from the learner into this worker's buffer (a torch uint8 tensor,
    returned), each checked against its crc32 where the buffer is in host memory. Nothing is
    loaded: the caller loads once every byte is in hand. A learner that cannot be reached, or a
    group that fails mid-way, raises ConnectionError naming the learner and version (the group is
    dropped and formed again on the next update); a refusal or damaged bucket raises ValueError."""
    global _member
    import torch

    total = payload_bytes(update)
    where = f"weights v{update.version} from the learner at {update.location} by {backend}"
    try:
        if _member is None or _member.learner != (update.location, update.incarnation):
            leave()
            _member = join(update, backend, timeout_s)
        _member.conn.sendall(CONTROL.pack(CONTROL_MAGIC, FETCH, update.version))
        read_reply(_member.conn, where)
        device = device_for(backend)
        if _member.buffer is None or _member.buffer.numel() != total or _member.buffer.device != device:
            _member.buffer = torch.empty(total, dtype=torch.uint8, device=device)
        damaged = []
        for index, bucket in enumerate(update.buckets):
            part = _member.buffer[bucket.offset:bucket.offset + bucket.nbytes]
            broadcast(_member.group, part)  # all are received, even after a damaged one: the group stays in step
            if not part.is_cuda and (crc := zlib.crc32(part.numpy())) != bucket.crc32:
                damaged.append(f"bucket {index}: crc32 {crc:08x}, announced {bucket.crc32:08x}")
    except (OSError, RuntimeError) as err:  # refused, reset, timed out; a peer of the group gone
        leave()
        raise ConnectionError(f"{where}: {err}") from err
    if damaged:
        raise ValueError(f"{where}: damaged in transit, refused ({'; '.join(damaged)})")
    return _member.buffer


class Prefetch:
    """One version being received in a thread of the worker's own while the engine generates: the
    broadcast releases the GIL, so the model's steps go on; the load waits for it in the pause."""

    def __init__(self, update: WeightUpdate, backend: str, timeout_s: float):
        self.key = (update.location, update.incarnation, update.version)
        self.payload, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(update, backend, timeout_s),
                                       name=f"tidal-weights-v{update.version}", daemon=True)
        self.thread.start()

    def _run(self, update: WeightUpdate, backend: str, timeout_s: float) -> None:
        try:
            self.payload = receive(update, backend, timeout_s)
        except BaseException as err:  # handed to the load, which raises it in the pause
            self.error = err

    def result(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.payload


_prefetch: Prefetch | None = None


def prefetch(info) -> None:
    """In a worker: start receiving `info`'s version in the background (after any receive still
    running: one group, one buffer)."""
    global _prefetch
    import msgspec

    if _prefetch is not None:
        _prefetch.thread.join()
    update = msgspec.convert(info.update, WeightUpdate)
    _prefetch = Prefetch(update, info.transport, info.timeout_s)


def prefetched() -> bool:
    """In a worker: no background receive is still running (done, failed, or none begun)."""
    return _prefetch is None or not _prefetch.thread.is_alive()


def load_received(model, model_config, info) -> str:
    """Load one update into `model`, received in the background beforehand (`prefetch`) or here;
    returns how it loaded."""
    global _prefetch
    import msgspec

    update = msgspec.convert(info.update, WeightUpdate)
    pending, _prefetch = _prefetch, None
    if pending is not None and pending.key == (update.location, update.incarnation, update.version):
        payload = pending.result()
    else:
        if pending is not None:
            pending.thread.join()  # another version's receive: done with the group before this one uses it
        payload = receive(update, info.transport, info.timeout_s)
    return load_payload(model, model_config, update, payload)
