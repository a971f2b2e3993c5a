"""Checkpoints that survive crashes, unpickle nothing, and are written by every rank at once.

    checkpoints/step-000012/
        model/shard-0000<r+1>-...safetensors      the policy's trained parameters (under learner.lora the
        optimizer/shard-0000<r+1>-...safetensors  adapter alone; the frozen base comes from model.path) and
                                                  AdamW's state tensors, by parameter name: each rank's own
                                                  shards (torch.distributed.checkpoint's safetensors layout)
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
only after that, keeping the `checkpoint.keep` newest of the learner's own lineage: the one it
resumed from stays until newer ones are complete, and a newer folder it could not resume from is
left alone until a save takes its name.

On resume each rank checks its own part once, in parallel, before anything is loaded: every file a
load reads is listed in a manifest of the right shape, at its size and hash, and holds what the
loader expects (safetensors headers that fit their files, JSON of the shape it was written in, the
policy's names and shapes). A damaged checkpoint is named in one warning line and the next older one
is tried; when none verifies the learner refuses to start (NoValidCheckpoint), unless told to start
fresh, which sets them aside. Everything is read with safetensors and JSON: a planted file cannot
run code.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tidal.config import CheckpointConfig
from tidal.files import sha256_file
from tidal.learner.every_rank.lora import is_adapter
from tidal.learner.every_rank.ranks import broadcast_bytes

if TYPE_CHECKING:  # types only: a checkpoint is verified (tidal export) without building a trainer
    from accelerate import Accelerator

    from tidal.learner.every_rank.trainer import Trainer

log = logging.getLogger(__name__)

STATE_FILE = "tidal_state.json"
MANIFEST = "MANIFEST.json"


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files do not match its manifests (or that has none), or do not hold what a
    resume reads."""


class NoValidCheckpoint(DamagedCheckpoint):
    """Checkpoints are there but none verifies: a resume refuses to start over them, naming each."""

    def __init__(self, directory: Path, damage: list[str]):
        self.damage = damage
        super().__init__(
            f"no checkpoint in {directory} verifies ({'; '.join(damage)}); a run over them would "
            "start again from step 0, clearing its broker streams and ledger: repair or remove them, "
            "or pass --resume fresh to do that"
        )


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def rank_manifest(rank: int) -> str:
    return f"MANIFEST-rank{rank}.json"


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def verify(path: Path, manifest: str = MANIFEST, hashes: bool = True) -> None:
    """Raise DamagedCheckpoint naming the first file of `manifest` that is missing, short or unlisted,
    or (`hashes`) changed or not what the loader reads."""
    listed = _read_manifest(path, manifest)
    for name, (size, _) in listed.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            raise DamagedCheckpoint(
                f"{path.name}/{name}: missing or {file.stat().st_size if file.is_file() else 0} "
                f"bytes, the manifest says {size}"
            )
    for name in _required(path, manifest):
        if name not in listed:
            raise DamagedCheckpoint(f"{path.name}/{name}: not listed in {manifest}")
    for name, (_, digest) in listed.items() if hashes else ():
        if sha256_file(path / name) != digest:
            raise DamagedCheckpoint(f"{path.name}/{name}: contents differ from the manifest")
        try:
            _check_contents(path, name)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as err:
            raise DamagedCheckpoint(f"{path.name}/{name}: {err}") from None


def verify_part(path: Path, rank: int, hashes: bool = True) -> None:
    """What rank `rank` reads of a checkpoint: its own manifest's files, and rank 0's JSON files."""
    if rank == 0:
        verify(path, MANIFEST, hashes)
    verify(path, rank_manifest(rank), hashes)


def _read_manifest(path: Path, manifest: str) -> dict[str, tuple[int, str]]:
    """`manifest` as {file: (size, sha256)}, every entry a relative path inside the checkpoint."""
    try:
        listed = json.loads((path / manifest).read_bytes())
    except (OSError, ValueError, RecursionError) as err:  # a JSON nested too deep is damage too
        raise DamagedCheckpoint(f"{path.name}/{manifest}: {type(err).__name__}") from None
    if not isinstance(listed, dict):
        raise DamagedCheckpoint(f"{path.name}/{manifest}: not a table of files (a JSON {type(listed).__name__})")
    if not listed:
        raise DamagedCheckpoint(f"{path.name}/{manifest}: lists no files")
    for name, entry in listed.items():
        if Path(name).is_absolute() or ".." in Path(name).parts or not name:
            raise DamagedCheckpoint(f"{path.name}/{manifest}: {name!r} is not a file inside the checkpoint")
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and type(entry[0]) is int
            and entry[0] >= 0
            and isinstance(entry[1], str)
            and len(entry[1]) == 64
        ):
            raise DamagedCheckpoint(f"{path.name}/{manifest}: the entry of {name!r} is not [size, sha256]")
    return listed


def _required(path: Path, manifest: str) -> list[str]:
    """What `manifest` must list: rank 0's JSON files; a rank's random state and every shard of its
    own on disk (each is read on resume); rank 0 holds the first shard of the model and of AdamW."""
    if manifest == MANIFEST:
        return ["trainer.json", STATE_FILE]
    rank = manifest.removeprefix("MANIFEST-rank").removesuffix(".json")
    if not rank.isdigit():
        raise DamagedCheckpoint(f"{path.name}/{manifest}: not a rank's manifest")
    rank = int(rank)
    shards = sorted(
        str(p.relative_to(path))
        for part in ("model", "optimizer")
        for p in (path / part).glob(f"shard-{rank + 1:05d}-*")
    )
    if rank == 0:
        for part in ("model", "optimizer"):
            if not any(s.startswith(part + "/") for s in shards):
                raise DamagedCheckpoint(f"{path.name}/{part}/: rank 0's shard is missing")
        _check_all_listed(path)
    return [f"rng-rank{rank}.safetensors", *shards]


def _check_all_listed(path: Path) -> None:
    """Every file under model/ and optimizer/ is some rank's (the loader reads them all)."""
    listed = set()
    for manifest in path.glob("MANIFEST-rank*.json"):
        try:
            listed |= set(json.loads(manifest.read_bytes()))
        except (OSError, ValueError, TypeError, RecursionError):
            pass  # that rank's check names it
    for part in ("model", "optimizer"):
        for file in sorted((path / part).glob("*")):
            if str(file.relative_to(path)) not in listed:
                raise DamagedCheckpoint(f"{path.name}/{file.relative_to(path)}: listed in no rank's manifest")


def _check_contents(path: Path, name: str) -> None:
    """A verified file holds what the loader reads from it (a manifest rewritten with the file still
    stops here, not halfway through a load)."""
    file = path / name
    if name == "trainer.json":
        check_trainer_meta(json.loads(file.read_bytes()))
    elif name == STATE_FILE:
        state = json.loads(file.read_bytes())
        if not isinstance(state, dict) or type(state.get("version")) is not int or state["version"] != step_of(path):
            raise ValueError(f"holds no version {step_of(path)}")
    elif name.endswith(".safetensors"):
        tensors = safetensors_header(file)
        if name.startswith("rng-rank"):
            cpu = tensors.get("torch_cpu", {})
            if cpu.get("dtype") != "U8" or cpu.get("shape") != [torch.get_rng_state().numel()]:
                raise ValueError("holds no CPU random state")


SAFETENSORS_ITEM_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def safetensors_header(file: Path) -> dict:
    """A safetensors file's tensors {name: {dtype, shape, data_offsets}}, each checked to lie inside
    the file at its size; ValueError naming what is not."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= length <= size - 8:
            raise ValueError(f"not a safetensors file (header of {length} bytes in {size})")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (its header is no table)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, tensor in tensors.items():
        if not _lies_within(tensor, size - 8 - length):
            raise ValueError(f"tensor {name!r} does not lie in the file as its header says")
    return tensors


def _lies_within(tensor, data_bytes: int) -> bool:
    """A safetensors header entry of a known dtype whose bytes, as many as its shape needs, lie in the data."""
    if not (
        isinstance(tensor, dict)
        and tensor.get("dtype") in SAFETENSORS_ITEM_BYTES
        and _sizes(tensor.get("shape"))
        and _sizes(tensor.get("data_offsets"))
        and len(tensor["data_offsets"]) == 2
    ):
        return False
    start, end = tensor["data_offsets"]
    item_bytes = SAFETENSORS_ITEM_BYTES[tensor["dtype"]]
    return start <= end <= data_bytes and end - start == math.prod(tensor["shape"]) * item_bytes


def _sizes(value) -> bool:
    return isinstance(value, list) and all(type(d) is int and d >= 0 for d in value)


def check_trainer_meta(meta) -> None:
    """trainer.json holds AdamW's hyperparameters, every tensor's whole shape, the scheduler and the
    Python and NumPy random states, each of a shape they load from; ValueError naming the first that is not."""
    if not isinstance(meta, dict):
        raise ValueError(f"a JSON {type(meta).__name__}, not a table")
    for key, kind in (
        ("optimizer", dict),
        ("shapes", dict),
        ("scheduler", dict),
        ("python_random", list),
        ("numpy_random", list),
    ):
        if not isinstance(meta.get(key), kind):
            raise ValueError(f"{key!r} is missing or not a JSON {kind.__name__}")
    for name, shape in meta["shapes"].items():
        if not _sizes(shape):
            raise ValueError(f"shapes[{name!r}] is not a list of sizes")
    for key, value in meta["optimizer"].items():
        if key.endswith(".betas") and not (isinstance(value, list) and len(value) == 2 and all(map(_number, value))):
            raise ValueError(f"optimizer[{key!r}] is not two numbers")
        if key.endswith((".lr", ".eps", ".weight_decay")) and not _number(value):
            raise ValueError(f"optimizer[{key!r}] is not a number")
    scheduler = meta["scheduler"]
    base_lrs = scheduler.get("base_lrs")
    if type(scheduler.get("last_epoch")) is not int or not (isinstance(base_lrs, list) and all(map(_number, base_lrs))):
        raise ValueError("the scheduler's state holds no step or learning rates")
    try:
        random.Random().setstate(_as_tuple(meta["python_random"]))
        np.random.RandomState().set_state(_numpy_state(meta["numpy_random"]))
    except (TypeError, ValueError, IndexError, OverflowError) as err:
        raise ValueError(f"a random state that does not load ({err})") from None


def folders(directory: Path) -> list[Path]:
    """The finished checkpoint folders `step-<digits>` in `directory`, oldest first."""
    found = [p for p in directory.glob("step-*") if p.name.removeprefix("step-").isdigit() and p.is_dir()]
    return sorted(found, key=step_of)


def survey(directory: Path, warn: bool = True) -> tuple[list[Path], list[str]]:
    """(finished checkpoints, newest first, whose rank-0 files are all listed and there at their sizes;
    what is wrong with each of the others). Cheap: the hashes are checked once, when a resume chooses
    one. `warn`: a line for each damaged one."""
    found, damage = [], []
    for path in reversed(folders(directory)):
        try:
            verify_part(path, 0, hashes=False)
            found.append(path)
        except DamagedCheckpoint as err:
            damage.append(str(err))
            if warn:
                log.warning("checkpoint %s is damaged (%s); trying the one before", path.name, err)
    return found, damage


def candidates(directory: Path, warn: bool = True) -> list[Path]:
    return survey(directory, warn)[0]


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


def set_aside(directory: Path, names: list[str]) -> list[Path]:
    """Rename damaged checkpoints out of the way of a fresh start (kept, for a look, never read again)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for name in names:
        if (directory / name).is_dir():
            moved.append((directory / name).rename(directory / f"damaged-{stamp}-{name}"))
    return moved


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
    def __init__(self, cfg: CheckpointConfig, directory: Path, accelerator: Accelerator, trainer: Trainer):
        self.cfg = cfg
        self.directory = directory
        self.accelerator = accelerator
        self.trainer = trainer
        # what pruning keeps apart (set by `agree`): the checkpoint this learner continues from and the ones
        # it saved since, oldest first; and the folders newer than where it continues (damaged, or
        # another lineage's), which pruning leaves alone until a save takes their name
        self.lineage: list[str] = []
        self.stale: set[str] = set()

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
        mine = [
            tmp / f"rng-rank{rank}.safetensors",
            *(f for part in ("model", "optimizer") for f in (tmp / part).glob(f"shard-{rank + 1:05d}-*")),
        ]
        _seal_files(tmp, mine, rank_manifest(rank))
        if acc.is_main_process:
            rest |= {"python_random": _python_random(), "numpy_random": _numpy_random()}
            _write_json(tmp / "trainer.json", rest)
            _write_json(tmp / STATE_FILE, {"version": version, **state})
            _seal_files(tmp, [tmp / "trainer.json", tmp / STATE_FILE], MANIFEST)
        acc.wait_for_everyone()
        # the folder's owner renames it: the lowest rank that wrote into it (rank 0; on a machine that shares
        # no disk with it, that machine's first)
        owner = rank == min(
            int(p.name.removeprefix("MANIFEST-rank").removesuffix(".json")) for p in tmp.glob("MANIFEST-rank*.json")
        )
        acc.wait_for_everyone()
        self.lineage = [name for name in self.lineage if name != final.name] + [final.name]
        self.stale.discard(final.name)
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
        """Keep the `checkpoint.keep` newest of this learner's lineage (the one it resumed from stays until
        that many newer ones are complete); older folders go, the stale ones stay."""
        kept = self.lineage[-max(self.cfg.keep, 1) :]
        for old in folders(self.directory):
            if step_of(old) < step_of(self.directory / kept[0]) and old.name not in self.stale:
                shutil.rmtree(old, ignore_errors=True)

    def agree(self, path: Path | None, fresh_if_damaged: bool = False, check_state=None) -> Path | None:
        """The checkpoint every rank continues from: rank 0's choice `path` (its disk may be the only one
        that holds its list), or the next older one, as long as some rank finds its own part damaged.
        Each rank hashes only its own part, once, all at the same time; rank 0 also runs `check_state` on
        tidal's state (a ValueError names what a resume could not read). When none verifies, every rank
        raises NoValidCheckpoint, or with rank 0's `fresh_if_damaged` starts fresh, the damaged ones set aside."""
        acc, device = self.accelerator, self.accelerator.device
        damage: list[str] = []
        plan = None
        if acc.is_main_process:  # rank 0's choice was found among these, each damaged one named once then
            found, damage = survey(self.directory, warn=False)
            plan = {
                "names": [p.name for p in found if path is not None and step_of(p) <= step_of(path)],
                "fresh": fresh_if_damaged,
            }
        plan = json.loads(broadcast_bytes(json.dumps(plan).encode() if plan else None, device))
        for name in plan["names"]:
            ok = self._verify(self.directory / name, check_state, damage)
            if self._all_ok(ok):
                return self._continue_from(self.directory / name)
            if ok:
                damage.append(f"{name}: damaged on another rank (named in that rank's log)")
        if not plan["names"]:
            return self._continue_from(None)
        if not plan["fresh"]:
            raise NoValidCheckpoint(self.directory, damage if acc.is_main_process else ["see rank 0's log"])
        if acc.is_main_process:
            moved = set_aside(self.directory, [p.name for p in folders(self.directory)])
            log.warning(
                "--resume fresh: no checkpoint in %s verifies; set aside as %s, starting at step 0 with "
                "empty broker streams and ledger",
                self.directory,
                ", ".join(p.name for p in moved),
            )
        acc.wait_for_everyone()
        return self._continue_from(None)

    def _verify(self, path: Path, check_state, damage: list[str]) -> float:
        """1.0 if this rank's part of `path` verifies (rank 0's: and fits this trainer and `check_state`),
        else 0.0 with one warning naming the damage."""
        rank = self.accelerator.process_index
        try:
            verify_part(path, rank)
            if rank == 0:
                self._check_fits(path)
                _check_state(path, check_state)
            return 1.0
        except DamagedCheckpoint as err:
            log.warning("checkpoint %s is damaged on rank %d (%s); trying the one before", path.name, rank, err)
            damage.append(str(err))
            return 0.0

    def _check_fits(self, path: Path) -> None:
        """The checkpoint's tensors have this policy's names and shapes, and its shards hold parts of
        them that fit (one process: all of them); a checkpoint of another model, or a shard rewritten
        with its manifest, stops here, not halfway through a load."""
        from tidal.learner.every_rank.state_files import trained_state

        shapes = json.loads((path / "trainer.json").read_bytes())["shapes"]
        adapter = self.trainer.lora
        if any(is_adapter(name) for name in shapes) != (adapter is not None):
            raise DamagedCheckpoint(
                f"{path.name}: saved by a run {'without' if adapter else 'with'} a LoRA adapter, "
                f"this learner has learner.lora.rank = {adapter.rank if adapter else 0}: resume "
                "with the run's own learner.lora"
            )
        for name, tensor in trained_state(self.trainer.policy).items():
            if shapes.get(name) != list(tensor.shape):
                raise DamagedCheckpoint(
                    f"{path.name}/trainer.json: {name!r} has shape {shapes.get(name)}, this "
                    f"model's is {list(tensor.shape)}"
                )
        held: dict[str, int] = {}
        for file in sorted(f for part in ("model", "optimizer") for f in (path / part).glob("*")):
            try:
                header = safetensors_header(file)
            except (ValueError, RecursionError) as err:  # another rank's file, that rank's check has yet to come
                raise DamagedCheckpoint(f"{path.name}/{file.relative_to(path)}: {err}") from None
            for name, tensor in header.items():
                whole = shapes.get(name)
                if (
                    whole is None
                    or len(whole) != len(tensor["shape"])
                    or any(d > w for d, w in zip(tensor["shape"], whole))
                ):
                    raise DamagedCheckpoint(
                        f"{path.name}/{file.relative_to(path)}: {name!r} of shape "
                        f"{tensor['shape']} is no part of a tensor of shape {whole}"
                    )
                held[name] = held.get(name, 0) + math.prod(tensor["shape"])
        missing = [name for name, whole in shapes.items() if held.get(name, 0) != math.prod(whole)]
        if self.accelerator.num_processes == 1 and missing:
            raise DamagedCheckpoint(
                f"{path.name}: its shards hold {held.get(missing[0], 0)} of the "
                f"{math.prod(shapes[missing[0]])} elements of {missing[0]!r}"
            )

    def _continue_from(self, path: Path | None) -> Path | None:
        """Pruning from here on keeps `path` until newer ones are complete, and leaves what is newer alone."""
        self.lineage = [path.name] if path is not None else []
        self.stale = {p.name for p in folders(self.directory) if path is None or step_of(p) > step_of(path)}
        return path

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

        acc = self.accelerator
        header = (
            {"meta": json.loads((path / "trainer.json").read_text()), "state": read_state(path)}
            if acc.is_main_process
            else None
        )
        header = json.loads(broadcast_bytes(json.dumps(header).encode() if header else None, acc.device))
        meta = header["meta"]
        self.trainer.load_state(path, meta)
        rng = path / f"rng-rank{acc.process_index}.safetensors"  # a checkpoint of fewer ranks: rank 0's
        set_random_state(load_file(str(rng if rng.exists() else path / "rng-rank0.safetensors")))
        random.setstate(_as_tuple(meta["python_random"]))
        np.random.set_state(_numpy_state(meta["numpy_random"]))
        return header["state"]


def _check_state(path: Path, check_state) -> None:
    """`check_state` (a ValueError names what a resume could not read) on the checkpoint's tidal state."""
    if check_state is not None:
        try:
            check_state(read_state(path))
        except (ValueError, TypeError, KeyError) as err:
            raise DamagedCheckpoint(f"{path.name}/{STATE_FILE}: {err}") from None


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


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_tuple(value: list) -> tuple:
    return (value[0], tuple(value[1]), value[2])


def _numpy_state(value: list) -> tuple:
    return (value[0], np.asarray(value[1], dtype=np.uint32), *value[2:])
