"""The file weight channel: the learner writes a safetensors file per version (temp file, then
rename) into a folder the actors can read (/dev/shm on one machine, a shared volume on a
cluster) and announces it with a sha256 per byte range (`weights.bucket_mib`), never one hash of
the whole file, over the authenticated broker. Each actor copies the file once into memory of its
own (tcp's staging), checks the copy's ranges on several threads, and its workers load that copy
in place: what was checked is what loads, whatever a writer of the folder does meanwhile.

The run's own folder (weights.dir empty: a name in /dev/shm anyone can work out from the run folder)
is made 0700 by the learner, or taken back from an earlier run of the same user; one another user
made first is refused, since whoever owns it reads every version and can plant links in it. Files
are written without following a link, so a link planted in a configured folder is never written
through.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import stat
import struct
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tidal.broker.schema import DeltaPart, TensorSpec, WeightBucket, WeightUpdate
from tidal.broker.weights import delta
from tidal.broker.weights.base import (
    Received,
    Transport,
    UpdateInfo,
    WeightPublisher,
    WeightReceiver,
    bucket_problem,
    check_transport,
    digest_problem,
    split_buckets,
    update_info,
)
from tidal.broker.weights.payload import checked_size
from tidal.broker.weights.staging import Staging, load_payload, map_staged
from tidal.config import WeightsConfig

NAME = "file"
log = logging.getLogger(__name__)


def unshared(named_tensors, dtype=None) -> dict:
    """Contiguous CPU tensors in `dtype` (None: as they are), tied ones (lm_head = embed_tokens)
    copied: safetensors refuses shared storage, and the engine must receive every name it serves
    (on vLLM's CPU backend a tied LM head is repacked on its own and keeps stale values if only the
    embedding is sent). `named_tensors`: a mapping, or (name, tensor) pairs."""
    seen, out = set(), {}
    pairs = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    for name, tensor in pairs:
        t = tensor.detach().to(dtype or tensor.dtype).contiguous().cpu()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out


def read_manifest(path: Path) -> list[TensorSpec]:
    """Tensor names, dtypes, shapes and absolute byte offsets from a safetensors file's header."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        return read_manifest_bytes(struct.pack("<Q", header_len) + f.read(header_len))


def read_manifest_bytes(data: bytes) -> list[TensorSpec]:
    """The same, from the file's bytes (its header at least)."""
    (header_len,) = struct.unpack_from("<Q", data)
    header = json.loads(bytes(memoryview(data)[8 : 8 + header_len]))
    base = 8 + header_len
    return [
        TensorSpec(
            name=name,
            dtype=meta["dtype"],
            shape=tuple(meta["shape"]),
            offset=base + meta["data_offsets"][0],
            nbytes=meta["data_offsets"][1] - meta["data_offsets"][0],
        )
        for name, meta in header.items()
        if name != "__metadata__"
    ]


class FilePublisher(WeightPublisher):
    """Writes `weights-v{version:06d}.safetensors` under weights.dir, keeping the newest `keep`."""

    def __init__(self, cfg: WeightsConfig, incarnation: str = "", owns_dir: bool = False, dtype: str | None = None):
        self.incarnation = incarnation
        self.bucket_bytes = cfg.bucket_mib << 20
        self.dtype = dtype  # what the actors serve: weights travel in it (master weights may be fp32)
        self.owns_dir = owns_dir  # the run's own folder (the default): removed by close()
        self.directory = Path(cfg.dir)
        if owns_dir:
            own_folder(self.directory)
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = max(cfg.keep, 2)  # an actor may still be reading the previous file
        self.retained: int | None = None  # the version the actors are told of, kept whatever `keep` says
        # weights.delta: the previous version's bytes, each new one written also as a delta from them
        self.delta = cfg.delta
        self.previous: tuple[int, bytes] | None = None
        self.written = {"whole": 0, "delta": 0}  # bytes of version files and delta files written

    def publish(self, named_tensors, version: int, entries=None) -> WeightUpdate:
        import torch
        from safetensors.torch import save

        path = self.directory / f"weights-v{version:06d}.safetensors"
        dtype = getattr(torch, self.dtype) if self.dtype else None
        # serialized in memory, so the ranges' checksums come from the bytes written, not a second read;
        # pairs made one at a time (a sharded learner's gathers) reach host memory one at a time. The
        # version is written at a fixed width, so that every version's file has one layout (a delta's)
        data = save(unshared(named_tensors, dtype), metadata={"version": f"{version:010d}"})
        buckets = split_buckets(memoryview(data), self.bucket_bytes)
        manifest = read_manifest_bytes(data)
        deltas = self._delta(version, data, buckets, manifest) if self.delta else {}
        replace_with(path, data)
        self.written["whole"] += len(data)
        self.previous = (version, data) if self.delta else None
        self._prune(version)
        return WeightUpdate(
            version=version,
            transport=NAME,
            location=str(path),
            manifest=manifest,
            checksum="",
            incarnation=self.incarnation,
            buckets=buckets,
            **deltas,
        )

    def _delta(self, version: int, data: bytes, buckets: list[WeightBucket], manifest: list[TensorSpec]) -> dict:
        """The announcement's delta fields, once the delta file from the previous version is written: each
        bucket encoded on a thread of its own (numpy and zstd let go of the GIL); none where there is no
        previous version of the same size or no bucket shrank."""
        if self.previous is None or len(self.previous[1]) != len(data):
            return {}
        base, new, width = memoryview(self.previous[1]), memoryview(data), delta.word_width(manifest)

        def encode(b: WeightBucket) -> bytes | None:
            return delta.encode(new[b.offset : b.offset + b.nbytes], base[b.offset : b.offset + b.nbytes], width)

        with ThreadPoolExecutor(max_workers=delta.ENCODERS) as pool:
            encoded = list(pool.map(encode, buckets))
        if not any(encoded):
            return {}
        parts, offset = [], 0
        for part in encoded:
            parts.append(DeltaPart(offset=offset, nbytes=len(part) if part else 0))
            offset += len(part) if part else 0
        path = self.directory / f"weights-v{version:06d}.delta"
        replace_with(path, b"".join(part for part in encoded if part))
        self.written["delta"] += offset
        return {"delta_of": self.previous[0], "delta_location": str(path), "delta_parts": parts}

    def retain(self, version: int) -> None:
        self.retained = version

    def metrics(self) -> dict[str, float]:
        """Bytes written for the actors in all: version files and delta files (weights.delta)."""
        return {f"weights/written_bytes/{kind}": float(n) for kind, n in self.written.items()}

    def _prune(self, version: int) -> None:
        for old in [*self.directory.glob("weights-v*.safetensors"), *self.directory.glob("weights-v*.delta")]:
            number = int(old.stem.split("-v")[1])
            if number <= version - self.keep and number != self.retained:
                old.unlink(missing_ok=True)

    def close(self) -> None:
        """The default folder lives in /dev/shm: give its memory back. A configured one is left alone."""
        if self.owns_dir:
            shutil.rmtree(self.directory, ignore_errors=True)


class ForeignFolder(PermissionError):
    """The run's own weights folder exists and is not this user's."""


def own_folder(path: Path) -> None:
    """Make `path` 0700, or take it back from an earlier run of this user (a crash leaves it); a folder
    (or a link) another user put there first is refused, naming its owner."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid():
        what = "a directory" if stat.S_ISDIR(found.st_mode) else "not a directory"
        raise ForeignFolder(
            f"the run's weights folder {path} exists, {what} of uid {found.st_uid}, not this "
            f"process's user (uid {os.geteuid()}): whoever made it could read every version; remove "
            "it or set weights.dir"
        )
    os.chmod(path, 0o700)


def replace_with(path: Path, data: bytes) -> None:
    """`data` at `path`, atomically: readers see the whole file or none, and a link at `path` is
    replaced, not followed."""
    tmp = path.with_suffix(".tmp")
    write_new(tmp, data)
    os.replace(tmp, path)


def write_new(path: Path, data: bytes) -> None:
    """`data` into a new file at `path`: a file or link left there is removed first, and the open neither
    follows a link nor reuses a file another process made in between."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


class FileReceiver(WeightReceiver):
    def __init__(self, cfg: WeightsConfig):
        self.cfg = cfg
        self.staging: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its workers' Staging
        self.lock = asyncio.Lock()  # one version at a time through a staging file
        self.received = Received()  # bytes read (and ranges read again), over its updates

    async def apply(self, update: WeightUpdate, engine) -> float:
        check_transport(update, NAME)
        async with self.lock:
            staging = self.staging.setdefault(engine, Staging())
            try:
                read = await asyncio.to_thread(stage_weight_file, update, self.cfg.dir, staging)
                paused = await engine.transfer_weights(update.version, update_info(NAME, update, str(staging.path)))
            except BaseException:
                staging.failed()
                raise
            staging.loaded()
            self.received.add(read)
            return paused


def stage_weight_file(update: WeightUpdate, weights_dir: str, staging: Staging) -> Received:
    """Copy the announced file into `staging` (or, where `staging` holds the version the announcement's
    delta is from, rebuild it from that delta) and check the copy against the announced digests: the
    workers load these very bytes, so a file rewritten after the check changes nothing. Returns the
    bytes read."""
    path = weight_file(update, weights_dir)
    if not update.buckets:
        raise ValueError(f"weights v{update.version}: the announcement carries no digests for {path}: refused")
    total = announced_size(update)  # the file may change after its size was checked: read no further
    buffer = staging.buffer_for(total)
    based = update.delta_parts and staging.base_for(update) == update.delta_of
    staging.holds = None  # overwritten in place from here on
    view = memoryview(buffer.numpy())
    try:
        read = None
        if based:
            try:
                read = rebuild(update, weights_dir, path, view)
            except (OSError, delta.DeltaError) as err:  # the delta file is gone or unusable: the version whole
                log.warning(
                    "weights v%d: the delta from v%d cannot be read (%s); reading the whole file",
                    update.version,
                    update.delta_of,
                    err,
                )
        if read is None:
            read = read_whole(path, view, update)
    finally:
        view.release()
    staging.holds = (update.incarnation, update.version)
    return read


def read_whole(path: Path, view: memoryview, update: WeightUpdate) -> Received:
    with open(path, "rb") as f:
        got = f.readinto(view)
        grew = f.read(1)
    problem = (f"{got} bytes read of {len(view)}" if got != len(view) or grew else None) or bucket_problem(view, update)
    if problem:
        raise ValueError(f"weight file {path} (version {update.version}): {problem}, refused")
    return Received(whole=got)


def rebuild(update: WeightUpdate, weights_dir: str, path: Path, view: memoryview) -> Received:
    """`view`, holding version `update.delta_of`, made version `update.version`: each bucket's delta
    applied and checked, a bucket without one (or whose delta does not rebuild it) read from the file."""
    if len(update.delta_parts) != len(update.buckets):
        raise ValueError(
            f"weights v{update.version}: {len(update.delta_parts)} delta parts for {len(update.buckets)} "
            "buckets: refused"
        )
    if checked_size(update.version, [], update.buckets) != len(view):  # every byte rebuilt, or read, and checked
        raise ValueError(f"weights v{update.version}: the announced ranges do not cover the {len(view)}-byte file")
    try:
        delta_path = inside(update.delta_location, weights_dir, update.version)
    except ValueError as err:
        raise delta.DeltaError(str(err)) from None
    read = Received()
    with open(delta_path, "rb") as deltas, open(path, "rb") as whole:
        for index, (bucket, part) in enumerate(zip(update.buckets, update.delta_parts)):
            into = view[bucket.offset : bucket.offset + bucket.nbytes]
            if part.nbytes and part.nbytes <= bucket.nbytes:
                deltas.seek(part.offset)
                encoded = deltas.read(part.nbytes)
                read.delta += len(encoded)
                try:
                    delta.apply(encoded, into)
                    if digest_problem(into, bucket, index) is None:
                        continue
                except delta.DeltaError:
                    pass
                read.refetched += 1
            whole.seek(bucket.offset)
            got = whole.readinto(into)
            read.whole += got
            if problem := (f"{got} bytes read of {len(into)}" if got != len(into) else None) or digest_problem(
                into, bucket, index
            ):
                raise ValueError(f"weight file {path} (version {update.version}): {problem}, refused")
    return read


def inside(location: str, weights_dir: str, version: int) -> Path:
    """`location` once it is known to lie inside weights_dir (symbolic links resolved)."""
    path, root = Path(location).resolve(), Path(weights_dir).resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"weight file {location!r} (version {version}) is outside weights.dir {str(root)!r}: refused")
    return path


def weight_file(update: WeightUpdate, weights_dir: str) -> Path:
    """The announced file, once it is known to lie inside weights_dir (symbolic links resolved) and to
    have the announced size."""
    path = inside(update.location, weights_dir, update.version)
    if not path.is_file():
        raise FileNotFoundError(f"weight file for version {update.version} is missing: {path}")
    expected = announced_size(update)
    if path.stat().st_size != expected:
        raise ValueError(f"weight file {path} is {path.stat().st_size} bytes, manifest says {expected}")
    return path


def load_received(model, model_config, info: UpdateInfo) -> str:
    """In a vLLM worker: load every tensor of the checked copy `info.staged` (the whole file, the
    manifest's offsets into it); returns how it loaded."""
    import msgspec

    update = msgspec.convert(info.update, WeightUpdate)
    return load_payload(model, model_config, update, map_staged(info.staged, announced_size(update)))


def announced_size(update: WeightUpdate) -> int:
    """The file's size as the announcement's manifest says: its last tensor's end."""
    return max((t.offset + t.nbytes for t in update.manifest), default=0)


class _File(Transport):
    name = NAME

    def publisher(
        self, cfg: WeightsConfig, incarnation: str, dtype: str | None, owns_dir: bool = False
    ) -> WeightPublisher:
        return FilePublisher(cfg, incarnation, owns_dir=owns_dir, dtype=dtype)

    def receiver(self, cfg: WeightsConfig) -> WeightReceiver:
        return FileReceiver(cfg)

    def load(self, model, model_config, info: UpdateInfo) -> str:
        return load_received(model, model_config, info)


TRANSPORT = _File()
