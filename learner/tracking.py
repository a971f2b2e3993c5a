"""The one place metrics are logged: MLflow (params, config artifact, per-step metrics, summary)
and a JSON-lines file in the run directory that the launcher's progress bar follows.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from tidal.config import RunConfig, TrackingConfig, flatten, to_yaml

log = logging.getLogger(__name__)


def tracking_uri(cfg: TrackingConfig, run_dir: Path) -> str:
    return cfg.uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


class Tracker:
    def __init__(self, cfg: TrackingConfig, run_dir: Path, run_name: str, resume_run_id: str | None = None):
        import mlflow

        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        self._mlflow = mlflow
        self.run_dir = run_dir
        self.uri = tracking_uri(cfg, run_dir)
        mlflow.set_tracking_uri(self.uri)
        if cfg.uri == "":
            # keep artifacts beside the sqlite store, not in the current directory
            if mlflow.get_experiment_by_name(cfg.experiment) is None:
                mlflow.create_experiment(cfg.experiment, artifact_location=(run_dir / "artifacts").resolve().as_uri())
        mlflow.set_experiment(cfg.experiment)
        # a resumed learner continues its MLflow run: same run id, step numbers carry on
        self.run = mlflow.start_run(run_id=resume_run_id) if resume_run_id else mlflow.start_run(run_name=run_name)
        self.run_id = self.run.info.run_id
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)

    def log_config(self, cfg: RunConfig) -> None:
        params = flatten(cfg)
        items = list(params.items())
        for i in range(0, len(items), 100):  # log_batch takes at most 100 params
            self._mlflow.log_params(dict(items[i:i + 100]))
        self._mlflow.log_text(to_yaml(cfg), "config.yaml")

    def log_resumed_config(self, cfg: RunConfig, version: int) -> None:
        """Params are immutable in a run; a resume records its (possibly changed) config as an artifact."""
        self._mlflow.log_text(to_yaml(cfg), f"config-resumed-at-{version}.yaml")
        self._mlflow.set_tag("tidal.resumed_at", str(version))

    def log_artifacts(self, folder: Path, name: str) -> None:
        self._mlflow.log_artifacts(str(folder), name)

    def last_step(self, metric: str = "learner/version") -> int | None:
        history = self._mlflow.tracking.MlflowClient().get_metric_history(self.run_id, metric)
        return max((m.step for m in history), default=None)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(v)}
        self._mlflow.log_metrics(clean, step=step)
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")

    def finish(self, summary: dict, status: str = "FINISHED") -> None:
        self._mlflow.log_dict(summary, "summary.json")
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self._mlflow.end_run(status=status)
        self._jsonl.close()
