"""The tcp weight channel: the learner serves each version from its own memory and every actor
pulls the version it was told of, so no folder is shared and a slow, dead or joining actor never
holds the learner up. Inside the actor the weights enter vLLM through its weight-transfer API
(`init_weight_transfer_engine` once, `update_weights` per version), with an engine registered
here in every vLLM process.

    learner  TcpPublisher.publish ─► payload (one buffer) + buckets (byte ranges, sha256 each) ─► WeightServer
    actor    TcpReceiver.apply ─► fetch every bucket over TCP (each request carries the announcement's
             token), check its sha256 ─► staged payload (/dev/shm)
             engine.transfer_weights: pause(keep) ─► AsyncLLM.update_weights ─► TcpWeightTransferEngine
             (in each worker: map the staged payload ─► load in place) ─► version label ─► resume

With `weights.tcp_prefetch` off the workers fetch the buckets themselves, inside the pause. Every
byte is fetched and checked before the load starts: a load cannot be undone halfway, so a failed
fetch leaves the engine on its current weights. The token and the digests travel only in the
announcement, over the authenticated broker: a peer without it is refused before it learns anything.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import struct
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tidal.broker.schema import TOKEN_BYTES, WeightUpdate
from tidal.broker.weights import delta, server
from tidal.broker.weights.base import (
    Received,
    Transport,
    UpdateInfo,
    WeightPublisher,
    WeightReceiver,
    check_token,
    check_transport,
    digest_problem,
    split_buckets,
    update_info,
)
from tidal.broker.weights.payload import pack, payload_bytes
from tidal.broker.weights.server import MAGIC, OK, REPLY, Served, WeightServer, error_reply, recv_exact
from tidal.broker.weights.staging import Staging, load_payload, map_staged
from tidal.config import WeightsConfig

NAME = "tcp"
log = logging.getLogger(__name__)
REQUEST_MAGIC = b"TDW3"  # 3: a request names the version the actor holds (a delta's base)
# magic, the channel's token, version, bucket index, the version whose bytes the actor holds there (NO_BASE: none)
REQUEST = struct.Struct(f"<4s{TOKEN_BYTES}sQQQ")


def bucket_request(token: bytes, version: int, index: int, base: int = delta.NO_BASE) -> bytes:
    return REQUEST.pack(REQUEST_MAGIC, token, version, index, base)


# ---- the learner's side ------------------------------------------------------------------------


class TcpServer(WeightServer):
    """A request names (version, bucket, the version the actor holds) and carries the token; the reply
    is that bucket's bytes, what changed since the held version (`delta`, where that is clearly
    smaller), or an error text."""

    magic = REQUEST_MAGIC
    request_bytes = REQUEST.size

    def __init__(self, *args, delta: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.deltas = DeltaCache() if delta else None
        self.sent = {"whole": 0, "delta": 0}  # bytes of bucket bodies sent, by kind

    def add(self, version: int, served: Served) -> None:
        super().add(version, served)
        if self.deltas is not None:
            with self.lock:
                kept = set(self.versions)
            self.deltas.keep_only(kept)

    def _handle(self, conn: socket.socket, opening: bytes) -> None:
        request: bytes | None = opening
        while request is not None:
            if not self.authentic(request):
                conn.sendall(
                    error_reply(server.UNAUTHORIZED, "not a tidal weight request with this learner's token: refused")
                )
                return
            _, _, version, index, base = REQUEST.unpack(request)
            self._send_bucket(conn, version, index, base)
            request = self.next_request(conn, REQUEST.size, idle_s=self.timeout_s)

    def _send_bucket(self, conn: socket.socket, version: int, index: int, base: int) -> None:
        served, known = self.lease(version)
        if served is None or index >= len(served.buckets):
            what = f"version {version}" if served is None else f"bucket {index} of version {version}"
            conn.sendall(error_reply(server.NOT_SERVED, f"{what} is not served here (versions served: {known})"))
            if served is not None:
                self.release(served)
            return
        try:
            encoded = self._delta(served, version, index, base)
            if encoded is not None:
                conn.sendall(REPLY.pack(MAGIC, server.DELTA, len(encoded)))
                conn.sendall(encoded)
                self._count("delta", len(encoded))
                return
            bucket = served.buckets[index]
            conn.sendall(REPLY.pack(MAGIC, OK, bucket.nbytes))
            conn.sendall(served.view[bucket.offset : bucket.offset + bucket.nbytes])
            self._count("whole", bucket.nbytes)
        finally:
            self.release(served)

    def _count(self, kind: str, nbytes: int) -> None:
        with self.lock:
            self.sent[kind] += nbytes

    def prepare(self, version: int, base: int) -> None:
        """Encode every bucket of `version` as a delta from `base` in the background (a thread, and a small
        pool under it), so that the actors holding `base` (those in step) find their deltas made when they ask."""
        if self.deltas is None:
            return
        served, _ = self.lease(version)
        held, _ = self.lease(base)
        if served is None or held is None or not same_layout(served, held):
            for leased in (served, held):
                if leased is not None:
                    self.release(leased)
            return
        claims = [(index, *self.deltas.claim((version, base, index))) for index in range(len(served.buckets))]
        claimed = [(index, entry) for index, entry, mine in claims if mine]
        deltas = self.deltas

        def encode_all() -> None:
            try:
                with ThreadPoolExecutor(delta.ENCODERS, thread_name_prefix="tidal-weight-delta") as pool:
                    for index, entry in claimed:
                        if deltas.live((version, base, index)):  # not forgotten meanwhile (a version retired)
                            pool.submit(fill, entry, functools.partial(_encode_bucket, served, held, index))
            finally:
                finish()

        def finish() -> None:
            for _, entry in claimed:  # whatever was not encoded (no thread left, forgotten) goes whole
                entry.done.set()
            self.release(served)
            self.release(held)

        try:
            threading.Thread(target=encode_all, name="tidal-weight-delta", daemon=True).start()
        except RuntimeError:  # no thread left: the actors get whole buckets, the learner serves on
            finish()

    def _delta(self, served: Served, version: int, index: int, base: int) -> bytes | None:
        """Bucket `index` of `served` as a delta from version `base`, where deltas are on, the base is
        served with the same layout and the delta is clearly smaller; else None (the whole bucket)."""
        if self.deltas is None or base == delta.NO_BASE or base == version:
            return None
        held, _ = self.lease(base)
        if held is None:
            return None
        try:
            if not same_layout(served, held):
                return None
            make = functools.partial(_encode_bucket, served, held, index)
            return self.deltas.get((version, base, index), make, wait_s=self.timeout_s / 2)
        finally:
            self.release(held)


def same_layout(served: Served, base: Served) -> bool:
    return [(b.offset, b.nbytes) for b in served.buckets] == [(b.offset, b.nbytes) for b in base.buckets]


def _encode_bucket(served: Served, base: Served, index: int) -> bytes | None:
    bucket = served.buckets[index]
    window = slice(bucket.offset, bucket.offset + bucket.nbytes)
    return delta.encode(served.view[window], base.view[window], delta.word_width(served.manifest))


@dataclass
class _Encoding:
    done: threading.Event
    encoded: bytes | None = None


class DeltaCache:
    """Each (version, base, bucket) encoded once, ahead by the publisher or by the first connection
    that asks for it, and sent from memory to every other actor holding that base; forgotten once
    either version is no longer served."""

    def __init__(self):
        self.lock = threading.Lock()
        self.entries: dict[tuple[int, int, int], _Encoding] = {}

    def claim(self, key: tuple[int, int, int]) -> tuple[_Encoding, bool]:
        """(the entry for `key`, whether the caller is to encode it)."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None:
                return entry, False
            entry = self.entries[key] = _Encoding(threading.Event())
            return entry, True

    def get(self, key: tuple[int, int, int], make, wait_s: float) -> bytes | None:
        """The encoding of `key`, made by `make` here if no one else makes it; None (the whole bucket)
        where it does not shrink, or another's encoding is not done within `wait_s`."""
        entry, mine = self.claim(key)
        if mine:
            fill(entry, make)
        elif not entry.done.wait(wait_s):
            return None
        return entry.encoded

    def live(self, key: tuple[int, int, int]) -> bool:
        with self.lock:
            return key in self.entries

    def keep_only(self, versions: set[int]) -> None:
        with self.lock:
            for key in [k for k in self.entries if k[0] not in versions or k[1] not in versions]:
                del self.entries[key]


def fill(entry: _Encoding, make) -> None:
    """`entry` encoded by `make`; one that fails is logged and left None: its bucket goes whole."""
    try:
        entry.encoded = make()
    except Exception:  # noqa: BLE001 - a delta is an optimization: the whole bucket is always there
        log.exception("weight server: encoding a delta failed; that bucket is sent whole")
    finally:
        entry.done.set()


class TcpPublisher(WeightPublisher):
    """Keeps the newest `keep` versions in memory and serves them on weights.tcp_host:tcp_port."""

    def __init__(self, cfg: WeightsConfig, incarnation: str = "", dtype: str | None = None):
        self.incarnation = incarnation
        self.dtype = dtype  # what the actors serve: weights travel in it (master weights may be fp32)
        self.bucket_bytes = cfg.bucket_mib << 20
        self.server = TcpServer(
            cfg.tcp_host, cfg.tcp_port, max(cfg.keep, 2), cfg.tcp_timeout_s, cfg.max_connections, delta=cfg.delta
        )
        self.location = server.advertised(cfg, self.server.port)
        self.previous: int | None = None  # the version published last

    def publish(self, named_tensors, version: int, entries=None) -> WeightUpdate:
        payload, manifest = pack(named_tensors, self.dtype, self.server.buffer_for, entries)
        view = memoryview(payload.numpy())
        buckets = split_buckets(view, self.bucket_bytes)
        self.server.add(version, Served(payload, manifest, buckets, view))
        if self.previous is not None:
            self.server.prepare(version, self.previous)  # the deltas the actors in step will ask for
        self.previous = version
        return WeightUpdate(
            version=version,
            transport=NAME,
            location=self.location,
            manifest=manifest,
            checksum="",
            incarnation=self.incarnation,
            buckets=buckets,
            token=self.server.token,
        )

    def retain(self, version: int) -> None:
        self.server.retain(version)

    def metrics(self) -> dict[str, float]:
        """Bucket bytes sent to the actors in all, whole and as deltas (weights.delta)."""
        with self.server.lock:
            return {f"weights/sent_bytes/{kind}": float(n) for kind, n in self.server.sent.items()}

    def close(self) -> None:
        self.server.close()


# ---- fetching: in the actor (prefetch) or in each vLLM worker ---------------------------------


def fetch(update: WeightUpdate, into: memoryview, timeout_s: float, base: int = delta.NO_BASE) -> Received:
    """Every bucket of `update` from the learner into `into` (the payload's size), each checked
    against its announced size and sha256. `base`: the version whose bytes `into` holds (from this
    learner), so a bucket may come as what changed since. A learner that cannot be reached, or goes
    away mid-way, raises ConnectionError naming the address and version; a damaged bucket raises
    ValueError."""
    check_token(update)
    host, port = server.parse_location(update.location)
    fetched = Received()
    done = 0
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small requests go out at once
            for index, bucket in enumerate(update.buckets):
                fetch_bucket(sock, update, index, into[bucket.offset : bucket.offset + bucket.nbytes], base, fetched)
                done += 1
    except OSError as err:  # refused, reset, timed out, cut short
        raise ConnectionError(
            f"weights v{update.version} from the learner at {update.location}: {err} "
            f"(after {done} of {len(update.buckets)} buckets)"
        ) from err
    return fetched


def fetch_bucket(
    sock: socket.socket,
    update: WeightUpdate,
    index: int,
    into: memoryview,
    base: int = delta.NO_BASE,
    fetched: Received | None = None,
) -> None:
    """One bucket into `into`, which holds version `base`'s bytes of it where `base` is named: a delta
    is applied there and the result checked like a whole bucket; one that does not rebuild the bucket
    (`into` did not hold that base) is followed by the whole bucket."""
    fetched = fetched if fetched is not None else Received()
    where = f"weights v{update.version} bucket {index} from {update.location}"
    status, nbytes = ask_bucket(sock, update, index, base, where)
    if status == server.DELTA:
        if base == delta.NO_BASE or nbytes > len(into):
            raise ValueError(f"{where}: a {nbytes}-byte delta the request did not ask for: refused")
        encoded = recv_exact(sock, nbytes)
        fetched.delta += nbytes
        try:
            delta.apply(encoded, into)
            problem = digest_problem(into, update.buckets[index], index)
        except delta.DeltaError as err:
            problem = str(err)
        if problem is None:
            return
        fetched.refetched += 1
        status, nbytes = ask_bucket(sock, update, index, delta.NO_BASE, where)
    if status != OK:
        reason = recv_exact(sock, min(nbytes, server.MAX_ERROR_BYTES)).decode(errors="replace")
        raise server.refusal(where, status, reason)
    if nbytes != len(into):
        raise ValueError(f"{where}: the learner sends {nbytes} bytes, the announcement says {len(into)}: refused")
    server.recv_into_exact(sock, into)
    fetched.whole += nbytes
    if problem := digest_problem(into, update.buckets[index], index):
        raise ValueError(f"{where}: {problem} in transit, refused")


def ask_bucket(sock: socket.socket, update: WeightUpdate, index: int, base: int, where: str) -> tuple[int, int]:
    """(status, body bytes) of the learner's reply to a request for bucket `index`."""
    sock.sendall(bucket_request(update.token, update.version, index, base))
    magic, status, nbytes = REPLY.unpack(recv_exact(sock, REPLY.size))
    if magic != MAGIC:
        raise ValueError(f"{where}: not a tidal weight server's reply (magic {magic!r})")
    if status == server.DELTA and base == delta.NO_BASE:
        raise ValueError(f"{where}: a delta the request did not ask for: refused")
    return status, nbytes


# ---- the actor's side ------------------------------------------------------------------------


class TcpReceiver(WeightReceiver):
    def __init__(self, cfg: WeightsConfig):
        self.cfg = cfg
        self.staging: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its workers' Staging
        self.lock = asyncio.Lock()  # one version at a time through a staging file
        self.received = Received()  # in all, over this actor's updates (its metrics)

    async def apply(self, update: WeightUpdate, engine) -> float:
        check_transport(update, NAME)
        check_token(update)
        timeout_s = self.cfg.tcp_timeout_s
        total = payload_bytes(update)  # a malformed announcement is refused before anything is fetched
        if not self.cfg.tcp_prefetch:
            info = update_info(NAME, update, "", timeout_s, delta=self.cfg.delta)
            return await engine.transfer_weights(update.version, info)
        async with self.lock:
            staging = self.staging.setdefault(engine, Staging())
            try:
                buffer, base = staging.buffer_for(total), staging.base_for(update)
                staging.holds = None  # overwritten in place from here on
                fetched = await asyncio.to_thread(fetch, update, memoryview(buffer.numpy()), timeout_s, base)
                staging.holds = (update.incarnation, update.version)
                self.received.add(fetched)
                paused = await engine.transfer_weights(
                    update.version, update_info(NAME, update, str(staging.path), timeout_s)
                )
            except BaseException:
                staging.failed()
                raise
            staging.loaded()
            return paused


# ---- inside each vLLM worker ------------------------------------------------------------------


def load_received(model, model_config, info: UpdateInfo) -> str:
    """Load one update into `model`: from the staged payload, or fetched here when nothing was
    staged. Returns how it loaded."""
    import msgspec

    update = msgspec.convert(info.update, WeightUpdate)
    total = payload_bytes(update)
    if info.staged:
        payload = map_staged(info.staged, total)
    else:
        payload = _fetched_here(update, total, info.timeout_s, keep=info.delta)
    return load_payload(model, model_config, update, payload)


_held: tuple[str, int, object] | None = None  # in a worker fetching for itself: (incarnation, version, payload)


def _fetched_here(update: WeightUpdate, total: int, timeout_s: float, keep: bool):
    """In a worker: `update` fetched into a buffer of its own. With `keep` (weights.delta) the buffer
    stays, holding this version: a delta's base for the next one from the same learner process."""
    global _held
    import torch

    held, _held = _held, None  # overwritten in place from here on
    if keep and held is not None and held[2].numel() == total:
        payload, base = held[2], held[1] if held[0] == update.incarnation else delta.NO_BASE
    else:
        payload, base = torch.empty(total, dtype=torch.uint8), delta.NO_BASE
    fetch(update, memoryview(payload.numpy()), timeout_s, base)
    if keep:
        _held = (update.incarnation, update.version, payload)
    return payload


class _Tcp(Transport):
    name = NAME

    def publisher(
        self, cfg: WeightsConfig, incarnation: str, dtype: str | None, owns_dir: bool = False
    ) -> WeightPublisher:
        return TcpPublisher(cfg, incarnation, dtype)

    def receiver(self, cfg: WeightsConfig) -> WeightReceiver:
        return TcpReceiver(cfg)

    def load(self, model, model_config, info: UpdateInfo) -> str:
        return load_received(model, model_config, info)


TRANSPORT = _Tcp()
