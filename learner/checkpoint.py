"""Checkpoints that survive crashes and unpickle nothing.

    checkpoints/step-000012/
        model.safetensors       the policy's parameters, under the model's own names
        optimizer.safetensors   AdamW's state tensors
        rng-rank<r>.safetensors every rank's torch random state (CPU and CUDA generators)
        trainer.json            optimizer hyperparameters, scheduler, Python and NumPy random states
        tidal_state.json        tidal's own state (version, coordinator, learner totals, MLflow run id)
        MANIFEST.json           size and sha256 of every file above; written last

A save goes into `step-N.tmp/`; every file and the folder are fsynced, then the folder is renamed
into place and the parent fsynced, so a crash leaves either the whole new checkpoint or none of it.
Older checkpoints are pruned only after that, keeping `checkpoint.keep`. On resume the newest
checkpoint whose files all match their manifest is used; a damaged one is named in one warning
line and the next older one is tried. Everything is read with safetensors and JSON: a planted
file cannot run code.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from tidal.config import CheckpointConfig
from tidal.files import sha256_file

log = logging.getLogger(__name__)

STATE_FILE = "tidal_state.json"
MANIFEST = "MANIFEST.json"


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files do not match its manifest (or that has none)."""


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def verify(path: Path) -> None:
    """Raise DamagedCheckpoint naming the first file that is missing, short or changed."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise DamagedCheckpoint(f"{path.name}/{MANIFEST}: {type(err).__name__}") from None
    for name, (size, digest) in manifest.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            raise DamagedCheckpoint(f"{path.name}/{name}: missing or {file.stat().st_size if file.is_file() else 0} "
                                    f"bytes, the manifest says {size}")
        if sha256_file(file) != digest:
            raise DamagedCheckpoint(f"{path.name}/{name}: contents differ from the manifest")


def latest_valid(directory: Path) -> Path | None:
    """The newest checkpoint that verifies; each damaged newer one gets one warning line."""
    for path in sorted(directory.glob("step-*[0-9]"), reverse=True):
        try:
            verify(path)
            return path
        except DamagedCheckpoint as err:
            log.warning("checkpoint %s is damaged (%s); trying the one before", path.name, err)
    return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value))


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, directory: Path, accelerator, trainer):
        self.cfg = cfg
        self.directory = directory
        self.accelerator = accelerator
        self.trainer = trainer

    @property
    def periodic(self) -> bool:
        return self.cfg.every > 0

    def due(self, version: int) -> bool:
        return self.periodic and version % self.cfg.every == 0

    def save(self, version: int, state: dict) -> Path:
        """All ranks save together (a sharded model is gathered, every rank's random state too); rank 0
        alone writes, so the ranks need no shared disk. Returns when the checkpoint is in place."""
        from safetensors.torch import save_file

        from tidal.learner.ranks import gather_tensors

        final = self.directory / f"step-{version:06d}"
        tmp = final.with_name(final.name + ".tmp")
        rngs = gather_tensors(random_state(), self.accelerator.device)
        whole = self.trainer.checkpoint_state()
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for rank, rng in enumerate(rngs):
                save_file(rng, str(tmp / f"rng-rank{rank}.safetensors"))
            tensors, meta = whole
            save_file(tensors["model"], str(tmp / "model.safetensors"))
            save_file(tensors["optimizer"], str(tmp / "optimizer.safetensors"))
            meta |= {"python_random": _python_random(), "numpy_random": _numpy_random()}
            _write_json(tmp / "trainer.json", meta)
            _write_json(tmp / STATE_FILE, {"version": version, **state})
            self._seal(tmp, final)
            self._prune()
        self.accelerator.wait_for_everyone()
        return final

    def _seal(self, tmp: Path, final: Path) -> None:
        """Manifest, fsync every file and the folder, rename into place, fsync the parent."""
        files = sorted(p for p in tmp.iterdir() if p.is_file())
        for file in files:
            _fsync(file)
        _write_json(tmp / MANIFEST, {p.name: [p.stat().st_size, sha256_file(p)] for p in files})
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        if final.exists():  # saved again at this version (the final save): swap, the old one last to go
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync(self.directory)

    def _prune(self) -> None:
        for old in sorted(self.directory.glob("step-*[0-9]"))[:-max(self.cfg.keep, 1)]:
            shutil.rmtree(old, ignore_errors=True)
        for leftover in self.directory.glob("step-*.tmp"):  # a save a crash interrupted
            shutil.rmtree(leftover, ignore_errors=True)

    def agree(self, path: Path | None) -> Path | None:
        """Rank 0's choice of checkpoint to continue from, on every rank: the others' disks may not hold it."""
        from tidal.learner.ranks import broadcast_bytes

        main = self.accelerator.is_main_process
        name = broadcast_bytes((path.name if path else "").encode() if main else None, self.accelerator.device)
        return self.directory / name.decode() if name else None

    def load(self, path: Path) -> dict:
        """Restore model, optimizer, scheduler and random states in place on every rank (all call it);
        rank 0 reads the files and sends the others what they need. Returns tidal's state."""
        from tidal.learner.ranks import broadcast_bytes, broadcast_tensors

        acc, device = self.accelerator, self.accelerator.device
        read = self._read(path) if acc.is_main_process else None
        header, tensors, rngs = read or (None, None, None)
        header = json.loads(broadcast_bytes(json.dumps(header).encode() if read else None, device))
        rngs = broadcast_tensors(rngs, device)
        if not self.trainer.sharded:  # sharded, rank 0 keeps them and sends each rank its shard
            tensors = {key: broadcast_tensors(tensors[key] if tensors else None, device)
                       for key in ("model", "optimizer")}
        meta = header["meta"]
        self.trainer.load_checkpoint_state(tensors, meta)
        prefix = f"{acc.process_index}/"
        set_random_state({k.removeprefix(prefix): v for k, v in rngs.items() if k.startswith(prefix)})
        random.setstate(_as_tuple(meta["python_random"]))
        np.random.set_state(tuple(meta["numpy_random"][:1]) + (np.asarray(meta["numpy_random"][1], dtype=np.uint32),)
                            + tuple(meta["numpy_random"][2:]))
        return header["state"]

    def _read(self, path: Path) -> tuple[dict, dict, dict]:
        """Rank 0: ({meta, state}, {model, optimizer} tensors, every rank's random state as "<rank>/<name>")."""
        from safetensors.torch import load_file

        verify(path)
        header = {"meta": json.loads((path / "trainer.json").read_text()), "state": read_state(path)}
        tensors = {key: load_file(str(path / f"{key}.safetensors")) for key in ("model", "optimizer")}
        rngs = {}
        for rank in range(self.accelerator.num_processes):
            rng = path / f"rng-rank{rank}.safetensors"  # a checkpoint of fewer ranks: the others start from rank 0's
            rngs |= {f"{rank}/{k}": v for k, v in load_file(str(rng if rng.exists() else
                                                                 path / "rng-rank0.safetensors")).items()}
        return header, tensors, rngs


def random_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state |= {f"cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return state


def set_random_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    cuda = [state[k] for k in sorted(k for k in state if k.startswith("cuda_"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _python_random() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _numpy_random() -> list:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _as_tuple(value: list) -> tuple:
    return (value[0], tuple(value[1]), value[2])
