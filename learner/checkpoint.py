"""Checkpoints that survive crashes, unpickle nothing, and are written by every rank at once.

    checkpoints/step-000012/
        model/shard-0000<r+1>-...safetensors      the policy, under the model's own names: each rank's own
        optimizer/shard-0000<r+1>-...safetensors  shards (torch.distributed.checkpoint's safetensors layout)
                                                  and AdamW's state tensors by parameter name
        rng-rank<r>.safetensors   each rank's torch random state (CPU and CUDA generators)
        MANIFEST-rank<r>.json     size and sha256 of each file rank r wrote; written last by that rank
        trainer.json              AdamW's other state, the scheduler, Python and NumPy random states
        tidal_state.json          tidal's own state (version, coordinator, learner totals, MLflow run id)
        MANIFEST.json             size and sha256 of rank 0's JSON files; written last

No rank gathers the model: a sharded learner's ranks each write their own shards, in parallel (a
tensor every rank holds whole is written once, by rank 0). A save goes into `step-N.tmp/`; each
rank fsyncs and hashes what it wrote, then the folder is renamed into place and the parent fsynced,
so a crash leaves either the whole new checkpoint or none of it. On several machines without a
shared disk each machine keeps its own ranks' part under the same name (its first rank renames it),
and a resume on the same layout reads from where each rank wrote. Older checkpoints are pruned
only after that, keeping `checkpoint.keep`. On resume each rank checks the hashes of its own part
once, in parallel, before anything is loaded; a damaged checkpoint is named in one warning line and
the next older one is tried. Everything is read with safetensors and JSON: a planted file cannot
run code.
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
    """A checkpoint whose files do not match its manifests (or that has none)."""


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def rank_manifest(rank: int) -> str:
    return f"MANIFEST-rank{rank}.json"


def verify(path: Path, manifest: str = MANIFEST, hashes: bool = True) -> None:
    """Raise DamagedCheckpoint naming the first file of `manifest` that is missing, short or
    (`hashes`) changed."""
    try:
        listed = json.loads((path / manifest).read_text())
    except (OSError, ValueError) as err:
        raise DamagedCheckpoint(f"{path.name}/{manifest}: {type(err).__name__}") from None
    for name, (size, digest) in listed.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            raise DamagedCheckpoint(f"{path.name}/{name}: missing or {file.stat().st_size if file.is_file() else 0} "
                                    f"bytes, the manifest says {size}")
        if hashes and sha256_file(file) != digest:
            raise DamagedCheckpoint(f"{path.name}/{name}: contents differ from the manifest")


def verify_part(path: Path, rank: int, hashes: bool = True) -> None:
    """What rank `rank` reads of a checkpoint: its own manifest's files, and rank 0's JSON files."""
    if rank == 0:
        verify(path, MANIFEST, hashes)
    verify(path, rank_manifest(rank), hashes)


def candidates(directory: Path, warn: bool = True) -> list[Path]:
    """Finished checkpoints, newest first, whose rank-0 files are all there at their sizes (cheap:
    the hashes are checked once, when a resume chooses one); `warn`: a line for each damaged one."""
    found = []
    for path in sorted(directory.glob("step-*[0-9]"), reverse=True):
        try:
            verify_part(path, 0, hashes=False)
            found.append(path)
        except DamagedCheckpoint as err:
            if warn:
                log.warning("checkpoint %s is damaged (%s); trying the one before", path.name, err)
    return found


def latest_valid(directory: Path) -> Path | None:
    """The newest checkpoint whose rank-0 part verifies, hashes included (one process: the whole of
    it); each damaged newer one gets one warning line."""
    for path in candidates(directory):
        try:
            verify_part(path, 0)
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


def _seal_files(folder: Path, files: list[Path], manifest: str) -> None:
    """fsync `files`, then write `manifest` (their sizes and sha256) and fsync it: the manifest last."""
    for file in files:
        _fsync(file)
    _write_json(folder / manifest, {str(p.relative_to(folder)): [p.stat().st_size, sha256_file(p)] for p in files})
    _fsync(folder / manifest)


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
        """All ranks save together, each writing its own part into this machine's run directory;
        returns when the checkpoint is in place."""
        acc = self.accelerator
        final = self.directory / f"step-{version:06d}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # what a save a crash interrupted left: every rank, then all go on
        acc.wait_for_everyone()
        tmp.mkdir(parents=True, exist_ok=True)
        rest = self.trainer.save_state(tmp)
        rank = acc.process_index
        from safetensors.torch import save_file

        save_file(random_state(), str(tmp / f"rng-rank{rank}.safetensors"))
        mine = [tmp / f"rng-rank{rank}.safetensors",
                *(f for part in ("model", "optimizer") for f in (tmp / part).glob(f"shard-{rank + 1:05d}-*"))]
        _seal_files(tmp, mine, rank_manifest(rank))
        if acc.is_main_process:
            rest |= {"python_random": _python_random(), "numpy_random": _numpy_random()}
            _write_json(tmp / "trainer.json", rest)
            _write_json(tmp / STATE_FILE, {"version": version, **state})
            _seal_files(tmp, [tmp / "trainer.json", tmp / STATE_FILE], MANIFEST)
        acc.wait_for_everyone()
        # the folder's owner renames it: the lowest rank that wrote into it (rank 0; on a machine that shares
        # no disk with it, that machine's first)
        owner = rank == min(int(p.name.removeprefix("MANIFEST-rank").removesuffix(".json"))
                            for p in tmp.glob("MANIFEST-rank*.json"))
        acc.wait_for_everyone()
        if owner:
            self._seal(tmp, final)
            self._prune()
        acc.wait_for_everyone()
        return final

    def _seal(self, tmp: Path, final: Path) -> None:
        """fsync the folder, rename it into place, fsync the parent."""
        for sub in (tmp / "model", tmp / "optimizer", tmp):
            if sub.is_dir():
                _fsync(sub)
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

    def agree(self, path: Path | None) -> Path | None:
        """The checkpoint every rank continues from: rank 0's choice `path` (its disk may be the only one
        that holds its list), or the next older one, as long as some rank finds its own part damaged.
        Each rank hashes only its own part, once, all at the same time."""
        from tidal.learner.ranks import broadcast_bytes

        acc, device = self.accelerator, self.accelerator.device
        # rank 0's choice was found among these, each damaged one named once then
        listed = [p.name for p in candidates(self.directory, warn=False) if path is not None and p.name <= path.name] \
            if acc.is_main_process else []
        names = json.loads(broadcast_bytes(json.dumps(listed).encode() if acc.is_main_process else None, device))
        for name in names:
            try:
                verify_part(self.directory / name, acc.process_index)
                ok = 1.0
            except DamagedCheckpoint as err:
                log.warning("checkpoint %s is damaged on rank %d (%s); trying the one before", name,
                            acc.process_index, err)
                ok = 0.0
            if self._all_ok(ok):
                return self.directory / name
        if path is not None:
            raise DamagedCheckpoint(f"no checkpoint in {self.directory} up to {path.name} is whole on every rank")
        return None

    def _all_ok(self, ok: float) -> bool:
        if self.accelerator.num_processes == 1:
            return ok == 1.0
        flag = torch.tensor([ok], device=self.accelerator.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return float(flag) == 1.0

    def load(self, path: Path) -> dict:
        """Restore model, optimizer, scheduler and random states in place on every rank (all call it,
        with the checkpoint `agree` chose); rank 0 reads the JSON files and sends them to the others.
        Returns tidal's state."""
        from safetensors.torch import load_file

        from tidal.learner.ranks import broadcast_bytes

        acc = self.accelerator
        header = {"meta": json.loads((path / "trainer.json").read_text()), "state": read_state(path)} \
            if acc.is_main_process else None
        header = json.loads(broadcast_bytes(json.dumps(header).encode() if header else None, acc.device))
        meta = header["meta"]
        self.trainer.load_state(path, meta)
        rng = path / f"rng-rank{acc.process_index}.safetensors"  # a checkpoint of fewer ranks: rank 0's
        set_random_state(load_file(str(rng if rng.exists() else path / "rng-rank0.safetensors")))
        random.setstate(_as_tuple(meta["python_random"]))
        np.random.set_state(tuple(meta["numpy_random"][:1]) + (np.asarray(meta["numpy_random"][1], dtype=np.uint32),)
                            + tuple(meta["numpy_random"][2:]))
        return header["state"]


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
