"""Checkpoints: Accelerate state (model, optimizer, scheduler, RNG) plus tidal's own state
(policy version, coordinator position, MLflow run id) in `tidal_state.json`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tidal.config import CheckpointConfig


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, directory: Path, accelerator, run_id: str):
        self.cfg = cfg
        self.directory = directory
        self.accelerator = accelerator
        self.run_id = run_id

    def due(self, version: int) -> bool:
        return bool(self.cfg.every) and version % self.cfg.every == 0

    def save(self, version: int, coordinator_state: dict) -> Path:
        path = self.directory / f"step-{version:06d}"
        self.accelerator.save_state(str(path))
        if self.accelerator.is_main_process:
            state = {"version": version, "coordinator": coordinator_state, "mlflow_run_id": self.run_id}
            (path / "tidal_state.json").write_text(json.dumps(state, indent=2))
            for old in sorted(self.directory.glob("step-*"))[:-max(self.cfg.keep, 1)]:
                shutil.rmtree(old, ignore_errors=True)
        return path
