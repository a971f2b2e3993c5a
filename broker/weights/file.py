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
import os
import shutil
import stat
import struct
import weakref
from pathlib import Path

from tidal.broker.schema import TensorSpec, WeightUpdate
from tidal.broker.weights.base import (
    Transport,
    UpdateInfo,
    WeightPublisher,
    WeightReceiver,
    bucket_problem,
    check_transport,
    split_buckets,
    update_info,
)
from tidal.broker.weights.staging import Staging, load_payload, map_staged
from tidal.config import WeightsConfig

NAME = "file"


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
    """Tensor names, dtypes, shapes and absolute byte offsets from a safetensors header."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
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

    def publish(self, named_tensors, version: int, entries=None) -> WeightUpdate:
        import torch
        from safetensors.torch import save

        path = self.directory / f"weights-v{version:06d}.safetensors"
        tmp = path.with_suffix(".tmp")
        dtype = getattr(torch, self.dtype) if self.dtype else None
        # serialized in memory, so the ranges' checksums come from the bytes written, not a second read;
        # pairs made one at a time (a sharded learner's gathers) reach host memory one at a time
        data = save(unshared(named_tensors, dtype), metadata={"version": str(version)})
        write_new(tmp, data)
        os.replace(tmp, path)  # atomic: readers see the whole file or none (a link at `path` is replaced, not followed)
        self._prune(version)
        return WeightUpdate(
            version=version,
            transport=NAME,
            location=str(path),
            manifest=read_manifest(path),
            checksum="",
            incarnation=self.incarnation,
            buckets=split_buckets(memoryview(data), self.bucket_bytes),
        )

    def retain(self, version: int) -> None:
        self.retained = version

    def _prune(self, version: int) -> None:
        for old in self.directory.glob("weights-v*.safetensors"):
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

    async def apply(self, update: WeightUpdate, engine) -> float:
        check_transport(update, NAME)
        async with self.lock:
            staging = self.staging.setdefault(engine, Staging())
            try:
                await asyncio.to_thread(stage_weight_file, update, self.cfg.dir, staging)
                paused = await engine.transfer_weights(update.version, update_info(NAME, update, str(staging.path)))
            except BaseException:
                staging.failed()
                raise
            staging.loaded()
            return paused


def stage_weight_file(update: WeightUpdate, weights_dir: str, staging: Staging) -> None:
    """Copy the announced file into `staging` and check the copy against the announced digests: the
    workers load these very bytes, so a file rewritten after the check changes nothing."""
    path = weight_file(update, weights_dir)
    if not update.buckets:
        raise ValueError(f"weights v{update.version}: the announcement carries no digests for {path}: refused")
    total = announced_size(update)  # the file may change after its size was checked: read no further
    buffer = staging.buffer_for(total)
    view = memoryview(buffer.numpy())
    with open(path, "rb") as f:
        got = f.readinto(view)
        grew = f.read(1)
    problem = (f"{got} bytes read of {total}" if got != total or grew else None) or bucket_problem(view, update)
    view.release()
    if problem:
        raise ValueError(f"weight file {path} (version {update.version}): {problem}, refused")


def weight_file(update: WeightUpdate, weights_dir: str) -> Path:
    """The announced file, once it is known to lie inside weights_dir (symbolic links resolved) and to
    have the announced size."""
    path, root = Path(update.location).resolve(), Path(weights_dir).resolve()
    if not path.is_relative_to(root):
        raise ValueError(
            f"weight file {update.location!r} (version {update.version}) is outside weights.dir {str(root)!r}: refused"
        )
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
