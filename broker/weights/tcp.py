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
import socket
import struct
import weakref

from tidal.broker.schema import TOKEN_BYTES, WeightUpdate
from tidal.broker.weights import server
from tidal.broker.weights.base import (
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
REQUEST = struct.Struct(f"<4s{TOKEN_BYTES}sQQ")  # magic, the channel's token, version, bucket index


def bucket_request(token: bytes, version: int, index: int) -> bytes:
    return REQUEST.pack(MAGIC, token, version, index)


# ---- the learner's side ------------------------------------------------------------------------


class TcpServer(WeightServer):
    """A request names (version, bucket) and carries the token; the reply is that bucket's bytes, or
    an error text."""

    request_bytes = REQUEST.size

    def _handle(self, conn: socket.socket, opening: bytes) -> None:
        request: bytes | None = opening
        while request is not None:
            if not self.authentic(request):
                conn.sendall(
                    error_reply(server.UNAUTHORIZED, "not a tidal weight request with this learner's token: refused")
                )
                return
            _, _, version, index = REQUEST.unpack(request)
            self._send_bucket(conn, version, index)
            request = self.next_request(conn, REQUEST.size, idle_s=self.timeout_s)

    def _send_bucket(self, conn: socket.socket, version: int, index: int) -> None:
        served, known = self.lease(version)
        if served is None or index >= len(served.buckets):
            what = f"version {version}" if served is None else f"bucket {index} of version {version}"
            conn.sendall(error_reply(server.NOT_SERVED, f"{what} is not served here (versions served: {known})"))
            if served is not None:
                self.release(served)
            return
        try:
            bucket = served.buckets[index]
            conn.sendall(REPLY.pack(MAGIC, OK, bucket.nbytes))
            conn.sendall(served.view[bucket.offset : bucket.offset + bucket.nbytes])
        finally:
            self.release(served)


class TcpPublisher(WeightPublisher):
    """Keeps the newest `keep` versions in memory and serves them on weights.tcp_host:tcp_port."""

    def __init__(self, cfg: WeightsConfig, incarnation: str = "", dtype: str | None = None):
        self.incarnation = incarnation
        self.dtype = dtype  # what the actors serve: weights travel in it (master weights may be fp32)
        self.bucket_bytes = cfg.bucket_mib << 20
        self.server = TcpServer(cfg.tcp_host, cfg.tcp_port, max(cfg.keep, 2), cfg.tcp_timeout_s, cfg.max_connections)
        self.location = server.advertised(cfg, self.server.port)

    def publish(self, named_tensors, version: int, entries=None) -> WeightUpdate:
        payload, manifest = pack(named_tensors, self.dtype, self.server.buffer_for, entries)
        view = memoryview(payload.numpy())
        buckets = split_buckets(view, self.bucket_bytes)
        self.server.add(version, Served(payload, manifest, buckets, view))
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

    def close(self) -> None:
        self.server.close()


# ---- fetching: in the actor (prefetch) or in each vLLM worker ---------------------------------


def fetch(update: WeightUpdate, into: memoryview, timeout_s: float) -> None:
    """Every bucket of `update` from the learner into `into` (the payload's size), each checked
    against its announced size and sha256. A learner that cannot be reached, or goes away mid-way,
    raises ConnectionError naming the address and version; a damaged bucket raises ValueError."""
    check_token(update)
    host, port = server.parse_location(update.location)
    done = 0
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small requests go out at once
            for index, bucket in enumerate(update.buckets):
                fetch_bucket(sock, update, index, into[bucket.offset : bucket.offset + bucket.nbytes])
                done += 1
    except OSError as err:  # refused, reset, timed out, cut short
        raise ConnectionError(
            f"weights v{update.version} from the learner at {update.location}: {err} "
            f"(after {done} of {len(update.buckets)} buckets)"
        ) from err


def fetch_bucket(sock: socket.socket, update: WeightUpdate, index: int, into: memoryview) -> None:
    sock.sendall(bucket_request(update.token, update.version, index))
    magic, status, nbytes = REPLY.unpack(recv_exact(sock, REPLY.size))
    where = f"weights v{update.version} bucket {index} from {update.location}"
    if magic != MAGIC:
        raise ValueError(f"{where}: not a tidal weight server's reply (magic {magic!r})")
    if status != OK:
        reason = recv_exact(sock, min(nbytes, server.MAX_ERROR_BYTES)).decode(errors="replace")
        raise server.refusal(where, status, reason)
    if nbytes != len(into):
        raise ValueError(f"{where}: the learner sends {nbytes} bytes, the announcement says {len(into)}: refused")
    server.recv_into_exact(sock, into)
    if problem := digest_problem(into, update.buckets[index], index):
        raise ValueError(f"{where}: {problem} in transit, refused")


# ---- the actor's side ------------------------------------------------------------------------


class TcpReceiver(WeightReceiver):
    def __init__(self, cfg: WeightsConfig):
        self.cfg = cfg
        self.staging: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its workers' Staging
        self.lock = asyncio.Lock()  # one version at a time through a staging file

    async def apply(self, update: WeightUpdate, engine) -> float:
        check_transport(update, NAME)
        check_token(update)
        timeout_s = self.cfg.tcp_timeout_s
        total = payload_bytes(update)  # a malformed announcement is refused before anything is fetched
        if not self.cfg.tcp_prefetch:
            return await engine.transfer_weights(update.version, update_info(NAME, update, "", timeout_s))
        async with self.lock:
            staging = self.staging.setdefault(engine, Staging())
            try:
                buffer = staging.buffer_for(total)
                await asyncio.to_thread(fetch, update, memoryview(buffer.numpy()), timeout_s)
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
    import torch

    update = msgspec.convert(info.update, WeightUpdate)
    total = payload_bytes(update)
    if info.staged:
        payload = map_staged(info.staged, total)
    else:
        payload = torch.empty(total, dtype=torch.uint8)
        fetch(update, memoryview(payload.numpy()), info.timeout_s)
    return load_payload(model, model_config, update, payload)


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
