"""Checkpoints: Accelerate state (model, optimizer, scheduler, RNG) plus tidal's own state
(policy version, coordinator bookkeeping, learner totals, the step's metrics, MLflow run id)
in `tidal_state.json`, written last: a folder without it is an unfinished save and is ignored."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tidal.config import CheckpointConfig

STATE_FILE = "tidal_state.json"


def latest_checkpoint(directory: Path) -> Path | None:
    done = sorted(p for p in directory.glob("step-*") if (p / STATE_FILE).is_file())
    return done[-1] if done else None


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, directory: Path, accelerator):
        self.cfg = cfg
        self.directory = directory
        self.accelerator = accelerator

    @property
    def periodic(self) -> bool:
        return self.cfg.every > 0

    def due(self, version: int) -> bool:
        return self.periodic and version % self.cfg.every == 0

    def save(self, version: int, state: dict) -> Path:
        """All ranks save together; rank 0 writes tidal's `state` (JSON) last, marking the save complete."""
        path = self.directory / f"step-{version:06d}"
        if self.accelerator.is_main_process:  # saved again (the final save): unfinished until rewritten
            (path / STATE_FILE).unlink(missing_ok=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(path))
        if self.accelerator.is_main_process:
            tmp = path / (STATE_FILE + ".tmp")
            tmp.write_text(json.dumps({"version": version, **state}))
            tmp.replace(path / STATE_FILE)
            for old in sorted(self.directory.glob("step-*"))[:-max(self.cfg.keep, 1)]:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def load(self, path: Path) -> dict:
        """Restore model, optimizer, scheduler and RNG in place; returns tidal's state."""
        self.accelerator.load_state(str(path))
        return read_state(path)
