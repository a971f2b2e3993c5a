"""A version staged in memory for an engine's workers, shared by the channels that fetch or read a whole
payload before the pause (tcp, file): one file in /dev/shm, mapped by the actor and by each worker, reused
for every version of the same size; the workers load its tensors in place."""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

from tidal.broker.schema import WeightUpdate
from tidal.broker.weights.base import load_into_model
from tidal.broker.weights.delta import NO_BASE
from tidal.broker.weights.payload import tensors_of


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
        self.holds: tuple[str, int] | None = None  # (incarnation, version) whose every byte it holds, checked

    def buffer_for(self, total: int):
        import torch

        if self.buffer is None or self.buffer.numel() != total:
            self.drop()
            self.holds = None
            self.path = staging_dir() / f"{STAGED_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
            self.buffer = torch.from_file(str(self.path), shared=True, size=total, dtype=torch.uint8)
        return self.buffer

    def base_for(self, update: WeightUpdate) -> int:
        """The version to name as a delta's base for `update`: the one held, where the same learner
        process announced both (a resumed learner counts versions again); else none."""
        if self.holds is None or self.holds[0] != update.incarnation:
            return NO_BASE
        return self.holds[1]

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
        self.path, self.buffer, self.held, self.holds = None, None, False, None


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


def load_payload(model, model_config, update: WeightUpdate, payload) -> str:
    """`payload`'s tensors into `model` in place; the payload's layout (the manifest) keys the
    recorded copy plan. Returns how it loaded."""
    layout = tuple((s.name, s.dtype, s.shape, s.offset) for s in update.manifest)
    return load_into_model(model, tensors_of(update.manifest, payload), model_config, payload=payload, key=layout)
