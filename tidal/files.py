"""File helpers shared by the checkpoint and the weight channel."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks (weights and checkpoints run to gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# what a run leaves in its run_dir: a folder holding any of these holds a run that another must not mix with
RUN_MARKS = ("metrics.jsonl", "checkpoints", "config.yaml")


def run_marks(run_dir: Path) -> list[str]:
    """The names in `run_dir` that show a run was started there (none for a new or empty folder)."""
    return [name for name in RUN_MARKS if (run_dir / name).exists()]


def used_run_dir(run_dir: Path, marks: list[str], overwrite: bool = True) -> str:
    """The one line that refuses a second run into a folder that holds one (`overwrite`: the command has
    --overwrite)."""
    instead = "--overwrite to start over in it (its files are deleted), " if overwrite else ""
    return (
        f"run_dir={run_dir} holds a run already ({', '.join(marks)}): pass --resume to continue it, "
        f"{instead}or choose another run_dir"
    )
