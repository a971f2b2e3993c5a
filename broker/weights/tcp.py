"""The tcp weight channel: the learner serves each version from its own memory and every actor
pulls the version it was told of, so no folder is shared and a slow, dead or joining actor never
holds the learner up. Inside the actor the weights enter vLLM through its weight-transfer API
(`init_weight_transfer_engine` once, `update_weights` per version), with an engine registered
here in every vLLM process.

    learner  TcpPublisher.publish ─► payload (one buffer) + buckets (byte ranges, crc32 each) ─► WeightServer
    actor    TcpReceiver.apply ─► fetch every bucket over TCP, check it ─► staged payload (/dev/shm)
             engine.transfer_weights: pause(keep) ─► AsyncLLM.update_weights ─► TcpWeightTransferEngine
             (in each worker: map the staged payload ─► load in place) ─► version label ─► resume

With `weights.tcp_prefetch` off the workers fetch the buckets themselves, inside the pause. Every
byte is fetched and checked before the load starts: a load cannot be undone halfway, so a failed
fetch leaves the engine on its current weights.
"""
from __future__ import annotations

import asyncio
import math
import os
import socket
import struct
import tempfile
import threading
import time
import uuid
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path

from tidal.broker.schema import TensorSpec, WeightBucket, WeightUpdate
from tidal.broker.weights.base import WeightPublisher, WeightReceiver, load_into_model, split_buckets
from tidal.broker.weights.vllm_engine import VLLM_BACKEND, load_in_worker, update_info
from tidal.config import WeightsConfig

TRANSPORT = "tcp"
__all__ = ["TcpPublisher", "TcpReceiver", "load_in_worker", "load_received", "pack", "payload_bytes", "tensors_of"]
ALIGN_BYTES = 64  # each tensor starts on a 64-byte boundary of the payload, as CPU kernels like
MAGIC = b"TDW1"
REQUEST = struct.Struct("<4sQQ")  # magic, version, bucket index
REPLY = struct.Struct("<4sBQ")  # magic, status, bytes that follow (the bucket, or an error text)
OK, NOT_SERVED, BAD_REQUEST = 0, 1, 2
# safetensors' dtype names, as the file channel's manifest writes them
DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
               "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def torch_dtype(name: str):
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"weight tensor dtype {name!r} is not one the tcp channel carries: {', '.join(DTYPE_NAMES)}")
    return getattr(torch, DTYPE_NAMES[name])


# ---- the payload: one buffer per version ------------------------------------------------------

def layout(tensors) -> tuple[list[TensorSpec], int]:
    """(manifest, payload bytes) of one aligned buffer holding `tensors`, (name, dtype name as the
    manifest writes it, shape) each, in order."""
    specs, offset = [], 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * torch_dtype(dtype).itemsize
        specs.append(TensorSpec(name=name, dtype=dtype, shape=tuple(shape), offset=offset, nbytes=nbytes))
        offset += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return specs, offset


def pack(named_tensors: dict, dtype: str | None = None, device=None):
    """(payload [total] uint8 on `device` (None: the CPU), manifest): every tensor copied once, in
    `dtype` (None: as it is), into one aligned buffer; tied tensors (lm_head = embed_tokens) travel
    under each name."""
    import torch

    target = getattr(torch, dtype) if dtype else None
    names = {v: k for k, v in DTYPE_NAMES.items()}
    entries = []
    for name, tensor in named_tensors.items():
        t_dtype = str(target or tensor.dtype).removeprefix("torch.")
        if t_dtype not in names:
            raise ValueError(f"weight tensor {name!r} is {t_dtype}, which the tcp channel does not carry")
        entries.append((name, names[t_dtype], tuple(tensor.shape)))
    specs, total = layout(entries)
    payload = torch.empty(total, dtype=torch.uint8, device=device)
    for spec, tensor in zip(specs, named_tensors.values()):
        view = payload[spec.offset:spec.offset + spec.nbytes].view(torch_dtype(spec.dtype)).view(spec.shape)
        view.copy_(tensor.detach())  # converts dtype and device on the way
        payload[spec.offset + spec.nbytes:-(-(spec.offset + spec.nbytes) // ALIGN_BYTES) * ALIGN_BYTES] = 0  # padding
    return payload, specs


def payload_bytes(update: WeightUpdate) -> int:
    """The payload's size, after checking that the buckets tile it and every tensor lies inside it."""
    return checked_size(update.version, update.manifest, update.buckets)


def checked_size(version: int, manifest: list[TensorSpec], buckets: list[WeightBucket], where: str = "") -> int:
    """The size of the payload `buckets` tile, after checking that they do and that every tensor of
    `manifest` lies inside it; errors name `where` in the version (a learner rank's part)."""
    end = 0
    for i, bucket in enumerate(buckets):
        if bucket.offset != end:
            raise ValueError(f"weights v{version}{where}: bucket {i} starts at byte {bucket.offset}, expected {end}")
        end += bucket.nbytes
    for spec in manifest:
        size = math.prod(spec.shape) * torch_dtype(spec.dtype).itemsize
        if spec.nbytes != size or spec.offset % ALIGN_BYTES or spec.offset + spec.nbytes > end:
            raise ValueError(f"weights v{version}{where}: tensor {spec.name!r} ({spec.dtype} {list(spec.shape)}) at "
                             f"bytes [{spec.offset}, {spec.offset + spec.nbytes}) does not fit a {end}-byte payload")
    return end


def tensors_of(manifest: list[TensorSpec], payload):
    """(name, view into `payload`) per tensor of the manifest, made as they are asked for (a
    replayed copy plan asks for none): nothing is copied."""
    return ((s.name, payload[s.offset:s.offset + s.nbytes].view(torch_dtype(s.dtype)).view(s.shape))
            for s in manifest)


# ---- the learner's side ------------------------------------------------------------------------

@dataclass(frozen=True)
class Served:
    payload: object  # torch uint8 [total]; kept alive while a connection still sends from it
    view: memoryview | None  # the payload's bytes, where a socket sends them (host memory)
    buckets: list[WeightBucket]


class WeightServer:
    """Serves the newest `keep` versions from memory, one thread per connected actor. A request
    names (version, bucket); the reply is that bucket's bytes, or an error text."""

    def __init__(self, host: str, port: int, keep: int, timeout_s: float):
        self.keep, self.timeout_s = keep, timeout_s
        self.versions: dict[int, Served] = {}
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()
        self.handlers: set[threading.Thread] = set()  # one per connection, while it lasts
        self.listener = socket.create_server((host, port), reuse_port=False)
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._accept, name="tidal-weight-server", daemon=True)
        self.thread.start()

    def add(self, version: int, served: Served) -> None:
        with self.lock:
            self.versions[version] = served
            for old in [v for v in self.versions if v <= version - self.keep]:
                del self.versions[old]  # a connection still sending it holds its own reference

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # the listener was closed: the publisher is done
                return
            conn.settimeout(self.timeout_s)  # an actor that stops reading frees its thread
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a reply's header must not wait for an ACK
            handler = threading.Thread(target=self._serve, args=(conn,), name="tidal-weight-send", daemon=True)
            with self.lock:
                self.connections.add(conn)
                self.handlers.add(handler)
            handler.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._handle(conn)
        except (OSError, RuntimeError):  # RuntimeError: a process group's peer went away or timed out
            pass  # the actor went away or stalled; it reports its own error, and the learner carries on
        finally:
            with self.lock:
                self.connections.discard(conn)
                self.handlers.discard(threading.current_thread())
            conn.close()

    def wait_for_handlers(self, timeout_s: float) -> bool:
        """Whether every connection's thread ended within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            handlers = list(self.handlers)
        for handler in handlers:
            handler.join(max(0.0, deadline - time.monotonic()))
        return not any(handler.is_alive() for handler in handlers)

    def _handle(self, conn: socket.socket) -> None:
        while (request := recv_exact(conn, REQUEST.size, eof_ok=True)) is not None:
            magic, version, index = REQUEST.unpack(request)
            if magic != MAGIC:
                conn.sendall(error_reply(BAD_REQUEST, f"not a tidal weight request (magic {magic!r})"))
                return
            with self.lock:
                served, known = self.versions.get(version), sorted(self.versions)
            if served is None or index >= len(served.buckets):
                what = f"version {version}" if served is None else f"bucket {index} of version {version}"
                conn.sendall(error_reply(NOT_SERVED, f"{what} is not served here (versions served: {known})"))
                continue
            bucket = served.buckets[index]
            conn.sendall(REPLY.pack(MAGIC, OK, bucket.nbytes))
            conn.sendall(served.view[bucket.offset:bucket.offset + bucket.nbytes])

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


def advertised(cfg: WeightsConfig, port: int) -> str:
    """host:port as the actors dial it."""
    host = cfg.tcp_advertise or (socket.getfqdn() if cfg.tcp_host in ("0.0.0.0", "::", "") else cfg.tcp_host)
    return f"{host}:{port}"


def error_reply(status: int, text: str) -> bytes:
    body = text.encode()
    return REPLY.pack(MAGIC, status, len(body)) + body


class TcpPublisher(WeightPublisher):
    """Keeps the newest `keep` versions in memory and serves them on weights.tcp_host:tcp_port."""

    def __init__(self, cfg: WeightsConfig, incarnation: str = "", dtype: str | None = None):
        self.incarnation = incarnation
        self.dtype = dtype  # what the actors serve: weights travel in it (master weights may be fp32)
        self.bucket_bytes = cfg.bucket_mib << 20
        self.server = WeightServer(cfg.tcp_host, cfg.tcp_port, max(cfg.keep, 2), cfg.tcp_timeout_s)
        self.location = advertised(cfg, self.server.port)

    def publish(self, named_tensors: dict, version: int) -> WeightUpdate:
        payload, manifest = pack(named_tensors, self.dtype)
        view = memoryview(payload.numpy())
        buckets = split_buckets(view, self.bucket_bytes)
        self.server.add(version, Served(payload, view, buckets))
        return WeightUpdate(version=version, transport=TRANSPORT, location=self.location, manifest=manifest,
                            checksum="", incarnation=self.incarnation, buckets=buckets)

    def close(self) -> None:
        self.server.close()


# ---- fetching: in the actor (prefetch) or in each vLLM worker ---------------------------------

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
        raise ValueError(f"tcp weight location {location!r} is not host:port")
    return host.strip("[]"), int(port)


def fetch(update: WeightUpdate, into: memoryview, timeout_s: float) -> None:
    """Every bucket of `update` from the learner into `into` (the payload's size), each checked
    against its announced size and crc32. A learner that cannot be reached, or goes away mid-way,
    raises ConnectionError naming the address and version; a damaged bucket raises ValueError."""
    host, port = parse_location(update.location)
    done = 0
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small requests go out at once
            for index, bucket in enumerate(update.buckets):
                fetch_bucket(sock, update, index, into[bucket.offset:bucket.offset + bucket.nbytes])
                done += 1
    except OSError as err:  # refused, reset, timed out, cut short
        raise ConnectionError(f"weights v{update.version} from the learner at {update.location}: {err} "
                              f"(after {done} of {len(update.buckets)} buckets)") from err


def fetch_bucket(sock: socket.socket, update: WeightUpdate, index: int, into: memoryview) -> None:
    sock.sendall(REQUEST.pack(MAGIC, update.version, index))
    magic, status, nbytes = REPLY.unpack(recv_exact(sock, REPLY.size))
    where = f"weights v{update.version} bucket {index} from {update.location}"
    if magic != MAGIC:
        raise ValueError(f"{where}: not a tidal weight server's reply (magic {magic!r})")
    if status != OK:
        reason = recv_exact(sock, min(nbytes, 4096)).decode(errors="replace")
        raise ValueError(f"{where}: refused by the learner: {reason}")
    if nbytes != len(into):
        raise ValueError(f"{where}: the learner sends {nbytes} bytes, the announcement says {len(into)}: refused")
    recv_into_exact(sock, into)
    crc = zlib.crc32(into)
    if crc != update.buckets[index].crc32:
        raise ValueError(f"{where}: crc32 {crc:08x} does not match the announced {update.buckets[index].crc32:08x}: "
                         "damaged in transit, refused")


def staging_dir() -> Path:
    """Where a prefetched payload waits for the workers: memory-backed where there is /dev/shm."""
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


STAGED_PREFIX = "tidal-weights-"  # then the actor's pid, a random part, ".bin"


def orphaned_staging() -> list[Path]:
    """Staged payloads whose actor process is gone: one killed while a file still had its name
    (before its engine's first load) leaves it behind, holding memory in /dev/shm."""
    orphans = []
    for path in staging_dir().glob(f"{STAGED_PREFIX}*.bin"):
        pid = path.name.removeprefix(STAGED_PREFIX).split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            orphans.append(path)
        except PermissionError:
            pass  # alive, another user's
    return orphans


class Staging:
    """Where an actor prefetches each version for one engine's workers: one file, mapped once by the
    actor and once by each worker and reused for every version of the same size. A fresh map costs
    a page fault per 4 KiB on first read (tens of ms for a 400 MB model, inside the engine's pause);
    a reused one costs nothing. The file's name is removed as soon as the workers hold their maps
    (or the first load fails), so nothing is left behind; the memory goes with the last map."""

    def __init__(self):
        self.path: Path | None = None
        self.buffer = None  # torch uint8 [total]: the actor's shared map
        self.held = False  # the workers have mapped it, and its name is gone

    def buffer_for(self, total: int):
        import torch

        if self.buffer is None or self.buffer.numel() != total:
            self.drop()
            self.path = staging_dir() / f"{STAGED_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
            self.buffer = torch.from_file(str(self.path), shared=True, size=total, dtype=torch.uint8)
        return self.buffer

    def loaded(self) -> None:
        """The workers loaded from it: they hold their maps from now on."""
        if not self.held:
            self.path.unlink(missing_ok=True)
            self.held = True

    def failed(self) -> None:
        """A fetch or load failed: a buffer the workers never held is dropped with its name."""
        if not self.held:
            self.drop()

    def drop(self) -> None:
        if self.path is not None and not self.held:
            self.path.unlink(missing_ok=True)
        self.path, self.buffer, self.held = None, None, False


_worker_map: tuple[str, object] | None = None  # in a vLLM worker: (staged path, its map), kept across updates


def map_staged(path: str, total: int):
    """In a worker: the staged payload as a uint8 tensor [total] over a shared map of the file,
    mapped on first sight and reused while the actor stages into the same file."""
    global _worker_map
    import torch

    if _worker_map is None or _worker_map[0] != path:  # the actor stages each size under a new name
        size = os.stat(path).st_size
        if size != total:
            raise ValueError(f"staged weights {path} are {size} bytes, expected {total}")
        _worker_map = (path, torch.from_file(path, shared=True, size=total, dtype=torch.uint8))
    return _worker_map[1]


# ---- the actor's side ------------------------------------------------------------------------

class TcpReceiver(WeightReceiver):
    vllm_backend = VLLM_BACKEND

    def __init__(self, cfg: WeightsConfig):
        self.cfg = cfg
        self.staging: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its workers' Staging
        self.lock = asyncio.Lock()  # one version at a time through a staging file

    async def apply(self, update: WeightUpdate, engine) -> float:
        if update.transport != TRANSPORT:
            raise ValueError(f"weights v{update.version} came by {update.transport!r}; this actor takes {TRANSPORT!r}")
        timeout_s = self.cfg.tcp_timeout_s
        total = payload_bytes(update)  # a malformed announcement is refused before anything is fetched
        if not self.cfg.tcp_prefetch:
            info = update_info(TRANSPORT, update, "", timeout_s)
            return await engine.transfer_weights(update.version, TRANSPORT, info)
        async with self.lock:
            staging = self.staging.setdefault(engine, Staging())
            try:
                buffer = staging.buffer_for(total)
                await asyncio.to_thread(fetch, update, memoryview(buffer.numpy()), timeout_s)
                info = update_info(TRANSPORT, update, str(staging.path), timeout_s)
                paused = await engine.transfer_weights(update.version, TRANSPORT, info)
            except BaseException:
                staging.failed()
                raise
            staging.loaded()
            return paused


# ---- inside each vLLM worker ------------------------------------------------------------------

def load_received(model, model_config, info) -> str:
    """Load one update into `model`: from the staged payload, or fetched here when nothing was
    staged. Returns how it loaded."""
    import msgspec
    import torch

    update = msgspec.convert(info.update, WeightUpdate)
    total = payload_bytes(update)
    if info.staged:
        payload = map_staged(info.staged, total)
    else:
        payload = torch.empty(total, dtype=torch.uint8)
        fetch(update, memoryview(payload.numpy()), info.timeout_s)
    return load_payload(model, model_config, update, payload)


def load_payload(model, model_config, update: WeightUpdate, payload) -> str:
    """`payload`'s tensors into `model` in place; the payload's layout (the manifest) keys the
    recorded copy plan. Returns how it loaded."""
    layout = tuple((s.name, s.dtype, s.shape, s.offset) for s in update.manifest)
    return load_into_model(model, tensors_of(update.manifest, payload), model_config, payload=payload, key=layout)
