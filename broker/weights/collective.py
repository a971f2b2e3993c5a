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

A sharded learner (learner.fsdp) gathers nothing to publish: every rank serves its own rows of each
tensor from a server of its own (`publish_shards`), rank 0 announces the version with each rank's
part (`WeightUpdate.sources`), and each worker forms a group with every rank, receives each part,
and puts the pieces together before the load. No rank holds more than its shard.

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

import msgspec

from tidal.broker.schema import TensorSpec, WeightBucket, WeightSource, WeightUpdate
from tidal.broker.weights import tcp
from tidal.broker.weights.base import WeightPublisher, WeightReceiver, split_buckets
from tidal.broker.weights.tcp import Served, WeightServer, checked_size, layout, load_payload, pack, payload_bytes
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
        self.groups: set = set()  # every worker's group, taken down on close

    def _handle(self, conn: socket.socket) -> None:
        group = None
        try:
            while (request := tcp.recv_exact(conn, CONTROL.size, eof_ok=True)) is not None:
                magic, op, version = CONTROL.unpack(request)
                if magic != CONTROL_MAGIC or op not in (JOIN, FETCH):
                    conn.sendall(tcp.error_reply(tcp.BAD_REQUEST, f"not a tidal group request (magic {magic!r}, "
                                                                  f"op {op})"))
                    return
                if op == JOIN:
                    self._drop(group)
                    group = self._form(conn)
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
                if served.payload.is_cuda:  # NCCL's wait() only orders streams: done before the payload may go
                    import torch

                    torch.cuda.current_stream(served.payload.device).synchronize()
        finally:
            self._drop(group)  # the worker left or failed: its group goes with this thread

    def _form(self, conn: socket.socket):
        """A new group with the worker at the other end of `conn`: its name and the store go to the
        worker, then both sides form it."""
        name = f"tidal-weights-{uuid.uuid4().hex[:12]}"
        spec = json.dumps({"backend": self.backend, "store_port": self.store.port, "group": name}).encode()
        conn.sendall(tcp.REPLY.pack(tcp.MAGIC, tcp.OK, len(spec)) + spec)
        group = new_group(self.backend, self.store, name, 0, self.timeout_s)
        with self.lock:
            self.groups.add(group)
        return group

    def _drop(self, group) -> None:
        with self.lock:
            self.groups.discard(group)

    def close(self) -> None:
        """As the tcp server's close, then wait for every worker's thread to end, so that its group
        is destroyed while the interpreter is whole: one still being torn down as the process exits
        aborts it (gloo's threads outlive Python's). A thread held up in a transfer has its group
        aborted, which fails the transfer at once on both sides."""
        super().close()
        if not self.wait_for_handlers(1.0):
            with self.lock:
                groups = list(self.groups)
            for group in groups:
                group.abort()
            self.wait_for_handlers(self.timeout_s)


class CollectivePublisher(WeightPublisher):
    """Keeps the newest `keep` versions in memory (the GPU's, with NCCL) and serves them to every
    worker that asks, on weights.tcp_host:tcp_port."""

    def __init__(self, cfg: WeightsConfig, incarnation: str = "", dtype: str | None = None, local_rank: int = 0):
        if cfg.transport == "nccl":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("config key 'weights.transport' = 'nccl' needs CUDA on the learner and the actors; "
                                 "on CPU use gloo")
        self.backend, self.incarnation, self.dtype = cfg.transport, incarnation, dtype
        self.bucket_bytes = cfg.bucket_mib << 20
        port = cfg.tcp_port + local_rank if cfg.tcp_port else 0  # one port per rank of a machine
        self.server = GroupServer(cfg.transport, cfg.tcp_host, port, max(cfg.keep, 2), cfg.tcp_timeout_s)
        self.location = tcp.advertised(cfg, self.server.port)

    def publish(self, named_tensors: dict, version: int) -> WeightUpdate:
        manifest, buckets = self._serve(named_tensors, version)
        return WeightUpdate(version=version, transport=self.backend, location=self.location, manifest=manifest,
                            checksum="", incarnation=self.incarnation, buckets=buckets)

    def publish_shards(self, shards: dict, version: int) -> WeightSource:
        """On every rank of a sharded learner: serve this rank's rows of each tensor, `shards` being
        name -> (rows, index of the first row in the whole tensor); returns this rank's part of the
        announcement, for rank 0 to gather (`announce`)."""
        manifest, buckets = self._serve({name: rows for name, (rows, _) in shards.items()}, version)
        manifest = [msgspec.structs.replace(spec, start=shards[spec.name][1]) for spec in manifest]
        return WeightSource(location=self.location, manifest=manifest, buckets=buckets)

    def announce(self, sources: list[WeightSource], version: int) -> WeightUpdate:
        """On rank 0: one announcement of a version every rank serves its part of."""
        return WeightUpdate(version=version, transport=self.backend, location=sources[0].location,
                            manifest=whole_manifest(sources), checksum="", incarnation=self.incarnation,
                            sources=sources)

    def _serve(self, named_tensors: dict, version: int) -> tuple[list[TensorSpec], list[WeightBucket]]:
        payload, manifest = pack(named_tensors, self.dtype, device_for(self.backend))
        if payload.is_cuda:  # a crc32 would mean copying the payload to the host: NCCL's transfers are checked
            buckets = [WeightBucket(offset=o, nbytes=min(self.bucket_bytes, payload.numel() - o), crc32=0)
                       for o in range(0, payload.numel(), self.bucket_bytes)]
        else:
            buckets = split_buckets(memoryview(payload.numpy()), self.bucket_bytes)
        self.server.add(version, Served(payload, None, buckets))
        return manifest, buckets

    def close(self) -> None:
        self.server.close()


def rows(shape) -> int:
    return shape[0] if shape else 1


def whole_manifest(sources: list[WeightSource]) -> list[TensorSpec]:
    """The whole tensors the sources' pieces make, laid out in one buffer as the worker assembles
    them: in the order they first appear, each piece's rows stacked along dim 0."""
    whole: dict[str, list] = {}  # name -> [dtype, a piece's shape, rows of the whole]
    for source in sources:
        for piece in source.manifest:
            entry = whole.setdefault(piece.name, [piece.dtype, piece.shape, 0])
            entry[2] = max(entry[2], piece.start + rows(piece.shape))
    return layout((name, dtype, (n, *shape[1:]) if shape else ()) for name, (dtype, shape, n) in whole.items())[0]


def sharded_size(update: WeightUpdate) -> int:
    """The assembled payload's size, after checking every source's buckets and pieces, and that the
    pieces of each whole tensor in the manifest cover its rows exactly once."""
    specs, total = layout((s.name, s.dtype, s.shape) for s in update.manifest)
    if [(s.offset, s.nbytes) for s in specs] != [(s.offset, s.nbytes) for s in update.manifest]:
        raise ValueError(f"weights v{update.version}: the whole tensors' manifest is not laid out as tidal lays "
                         "out a payload")
    whole, covered = {s.name: s for s in update.manifest}, {s.name: [] for s in update.manifest}
    for source in update.sources:
        where = f" (the part served at {source.location})"
        checked_size(update.version, source.manifest, source.buckets, where)
        for piece in source.manifest:
            spec = whole.get(piece.name)
            if (spec is None or spec.dtype != piece.dtype or tuple(spec.shape[1:]) != tuple(piece.shape[1:])
                    or piece.start + rows(piece.shape) > rows(spec.shape)):
                raise ValueError(f"weights v{update.version}{where}: piece of {piece.name!r} ({piece.dtype} "
                                 f"{list(piece.shape)} from row {piece.start}) is not part of a whole tensor "
                                 "in the manifest")
            covered[piece.name].append((piece.start, rows(piece.shape)))
    for name, pieces in covered.items():
        end, tiled = 0, True
        for start, n in sorted(pieces):
            tiled, end = tiled and start == end, end + n
        if not tiled or end != rows(whole[name].shape):
            raise ValueError(f"weights v{update.version}: the pieces of {name!r} (rows from "
                             f"{sorted(start for start, _ in pieces)}) do not cover its {rows(whole[name].shape)} "
                             "rows exactly once")
    return total


def size_of(update: WeightUpdate) -> int:
    """The payload's size as the worker loads it (assembled, for a sharded learner's), once checked."""
    return sharded_size(update) if update.sources else payload_bytes(update)


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
        size_of(update)  # a malformed announcement is refused before the engine pauses
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


_members: dict[str, Membership] = {}  # by the learner's location: one per rank of a sharded learner
_assembled = None  # a sharded learner's version, its pieces put together: reused while the size holds


def join(location: str, incarnation: str, backend: str, timeout_s: float) -> Membership:
    import datetime

    import torch.distributed as dist

    host, port = tcp.parse_location(location)
    conn = socket.create_connection((host, port), timeout=timeout_s)
    try:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(CONTROL.pack(CONTROL_MAGIC, JOIN, 0))
        spec = json.loads(read_reply(conn, f"joining the learner at {location}"))
        if spec["backend"] != backend:
            raise ValueError(f"the learner at {location} serves weights by {spec['backend']}, not {backend}")
        store = dist.TCPStore(host, spec["store_port"], None, False, timeout=datetime.timedelta(seconds=timeout_s))
        group = new_group(backend, store, spec["group"], 1, timeout_s)
    except BaseException:
        conn.close()
        raise
    return Membership((location, incarnation), conn, store, group)


def leave(location: str | None = None) -> None:
    """Drop this worker's group and connection with the learner process at `location` (None: with
    every one); the learner's thread for it ends."""
    for where in [location] if location is not None else list(_members):
        member = _members.pop(where, None)
        if member is not None:
            member.conn.close()


def receive(update: WeightUpdate, backend: str, timeout_s: float):
    """Every byte of `update` from the learner into this worker's memory (a torch uint8 tensor laid
    out as the manifest says, returned), each bucket checked against its crc32 where it lands in host
    memory. From a sharded learner, each rank's part comes from that rank and the pieces are put
    together. Nothing is loaded: the caller loads once every byte is in hand. A learner that cannot
    be reached, or a group that fails mid-way, raises ConnectionError naming the learner and version
    (that group is dropped and formed again on the next update); a refusal or a damaged bucket
    raises ValueError."""
    global _assembled
    import torch

    if not update.sources:
        payload_bytes(update)
        return receive_part(update.version, update.incarnation, update.location, update.buckets, backend, timeout_s)
    total = sharded_size(update)
    device = device_for(backend)
    if _assembled is None or _assembled.numel() != total or _assembled.device != device:
        _assembled = torch.empty(total, dtype=torch.uint8, device=device)
    whole = {spec.name: spec for spec in update.manifest}
    for source in update.sources:  # one rank after another: the worker's own link is the narrow part
        part = receive_part(update.version, update.incarnation, source.location, source.buckets, backend, timeout_s)
        for piece in source.manifest:
            spec = whole[piece.name]
            begin = spec.offset + piece.start * (spec.nbytes // rows(spec.shape))
            _assembled[begin:begin + piece.nbytes].copy_(part[piece.offset:piece.offset + piece.nbytes])
    return _assembled


def receive_part(version: int, incarnation: str, location: str, buckets: list[WeightBucket], backend: str,
                 timeout_s: float):
    """The payload the learner process at `location` serves for `version`, into this worker's buffer
    for that process."""
    import torch

    total = sum(bucket.nbytes for bucket in buckets)
    where = f"weights v{version} from the learner at {location} by {backend}"
    try:
        member = _members.get(location)
        if member is None or member.learner != (location, incarnation):
            leave(location)
            member = _members[location] = join(location, incarnation, backend, timeout_s)
        member.conn.sendall(CONTROL.pack(CONTROL_MAGIC, FETCH, version))
        read_reply(member.conn, where)
        device = device_for(backend)
        if member.buffer is None or member.buffer.numel() != total or member.buffer.device != device:
            member.buffer = torch.empty(total, dtype=torch.uint8, device=device)
        damaged = []
        for index, bucket in enumerate(buckets):
            part = member.buffer[bucket.offset:bucket.offset + bucket.nbytes]
            broadcast(member.group, part)  # all are received, even after a damaged one: the group stays in step
            if not part.is_cuda and (crc := zlib.crc32(part.numpy())) != bucket.crc32:
                damaged.append(f"bucket {index}: crc32 {crc:08x}, announced {bucket.crc32:08x}")
    except (OSError, RuntimeError) as err:  # refused, reset, timed out; a peer of the group gone
        leave(location)
        raise ConnectionError(f"{where}: {err}") from err
    if damaged:
        raise ValueError(f"{where}: damaged in transit, refused ({'; '.join(damaged)})")
    return member.buffer


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
    update = msgspec.convert(info.update, WeightUpdate)
    pending, _prefetch = _prefetch, None
    if pending is not None and pending.key == (update.location, update.incarnation, update.version):
        payload = pending.result()
    else:
        if pending is not None:
            pending.thread.join()  # another version's receive: done with the group before this one uses it
        payload = receive(update, info.transport, info.timeout_s)
    return load_payload(model, model_config, update, payload)
