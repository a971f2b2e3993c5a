"""The weight channel, file transport: the learner writes a safetensors file atomically and
announces it; actors reload it layer-wise. Works on CPU and on a shared volume.

One interface (`WeightChannel`) so a GPU transport (NCCL) can sit beside it.
"""
from __future__ import annotations

import abc
import hashlib
import json
import os
import struct
from pathlib import Path

from tidal.broker.schema import TensorSpec, WeightUpdate


class WeightChannel(abc.ABC):
    @abc.abstractmethod
    def publish(self, named_tensors: dict, version: int) -> WeightUpdate:
        """Make the tensors available to actors; returns the announcement to broadcast."""


def _unshared(named_tensors: dict) -> dict:
    """Contiguous CPU tensors, tied ones (lm_head = embed_tokens) copied: safetensors refuses
    shared storage, and the engine must receive every name it serves (on vLLM's CPU backend
    a tied LM head is repacked on its own and keeps stale values if only the embedding is sent)."""
    seen, out = set(), {}
    for name, tensor in named_tensors.items():
        t = tensor.detach().contiguous().cpu()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path: Path) -> list[TensorSpec]:
    """Tensor names, dtypes, shapes and absolute byte offsets from a safetensors header."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    return [TensorSpec(name=name, dtype=meta["dtype"], shape=tuple(meta["shape"]),
                       offset=base + meta["data_offsets"][0],
                       nbytes=meta["data_offsets"][1] - meta["data_offsets"][0])
            for name, meta in header.items() if name != "__metadata__"]


class FileWeightChannel(WeightChannel):
    """Writes `weights-v{version:06d}.safetensors` under `directory`, temp file + rename."""

    def __init__(self, directory: str | Path, keep: int = 3, incarnation: str = ""):
        self.incarnation = incarnation
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = max(keep, 2)  # an actor may still be reading the previous file

    def publish(self, named_tensors: dict, version: int) -> WeightUpdate:
        from safetensors.torch import save_file

        path = self.directory / f"weights-v{version:06d}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(_unshared(named_tensors), str(tmp), metadata={"version": str(version)})
        os.replace(tmp, path)  # atomic: readers see the whole file or none
        self._prune(version)
        return WeightUpdate(version=version, transport="file", location=str(path),
                            manifest=read_manifest(path), checksum=_sha256(path), incarnation=self.incarnation)

    def _prune(self, version: int) -> None:
        for old in self.directory.glob("weights-v*.safetensors"):
            if int(old.stem.split("-v")[1]) <= version - self.keep:
                old.unlink(missing_ok=True)


def verify_weight_file(update: WeightUpdate) -> Path:
    """Check that the announced file is there, complete and unchanged; returns its path."""
    path = Path(update.location)
    if not path.is_file():
        raise FileNotFoundError(f"weight file for version {update.version} is missing: {path}")
    expected = max((t.offset + t.nbytes for t in update.manifest), default=0)
    if path.stat().st_size != expected:
        raise ValueError(f"weight file {path} is {path.stat().st_size} bytes, manifest says {expected}")
    if _sha256(path) != update.checksum:
        raise ValueError(f"weight file {path} does not match the announced sha256 (version {update.version})")
    return path
