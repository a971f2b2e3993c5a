"""`tidal sweep CONFIG... key=v1,v2 [key=value ...]`: run a grid sequentially, then fit it.

The sweep is one MLflow parent run with a child run per grid point, in the configured store
(`tracking.uri`, $MLFLOW_TRACKING_URI, else `<out>/mlflow.db`); afterwards the children's eval
curves are fitted with the ScaleRL sigmoid (`tidal.scaling`), and the table and the plot are
printed, written to `<out>` and logged on the parent run.
"""
from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

from tidal.config import load_config


def split_grid(overrides: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """key=value overrides stay fixed; key=v1,v2,... become axes of the grid."""
    fixed, axes = [], []
    for item in overrides:
        key, _, value = item.partition("=")
        if "," in value:
            axes.append((key, [v for v in value.split(",") if v]))
        else:
            fixed.append(item)
    if not axes:
        raise ValueError("tidal sweep needs at least one key=v1,v2,... override to sweep over")
    return fixed, axes


def sweep_store(config: list[str], fixed: list[str], out: Path) -> tuple[str, str]:
    """The MLflow store and experiment of a sweep: the config's or the environment's, else its own sqlite file."""
    tracking = load_config(config, fixed).tracking
    uri = tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(out / 'mlflow.db').resolve()}"
    return uri, tracking.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or f"sweep-{out.name}"


def run_grid(config: list[str], overrides: list[str], out: Path, uri: str, experiment: str,
             parent_run_id: str) -> dict[str, str]:
    """Runs every point of the grid as a child of the parent run; returns label -> MLflow run id."""
    from tidal.launcher import launch

    fixed, axes = split_grid(overrides)
    runs = {}
    for values in itertools.product(*(vals for _, vals in axes)):
        combo = [f"{key}={v}" for (key, _), v in zip(axes, values)]
        label = ",".join(combo)
        run_dir = out / label.replace("=", "-").replace(",", "_")
        cfg = load_config(config, [*fixed, *combo, f"run_dir={run_dir}", f"tracking.uri={uri}", f"name={run_dir.name}",
                                   f"tracking.experiment={experiment}", f"tracking.parent_run_id={parent_run_id}"])
        print(f"[sweep] {label}", flush=True)
        if launch(cfg) != 0:
            raise RuntimeError(f"sweep run {label} failed; see {run_dir}/logs")
        runs[label] = json.loads((run_dir / "summary.json").read_text())["mlflow_run_id"]
    (out / "runs.json").write_text(json.dumps(runs, indent=2))
    return runs


def sweep(config: list[str], overrides: list[str], out: Path | None, compute_metric: str, window=None) -> int:
    import mlflow
    from mlflow.tracking import MlflowClient

    from tidal.learner.tracking import use_store
    from tidal.scaling_report import Window, report

    window = window or Window()
    out = out or Path(f"runs/sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    fixed, axes = split_grid(overrides)
    uri, experiment = sweep_store(config, fixed, out)
    use_store(uri, experiment, out / "artifacts")
    client = MlflowClient(uri)
    # created through the client, not made the active run: the runs of the grid start their own
    parent = client.create_run(mlflow.get_experiment_by_name(experiment).experiment_id, run_name=out.name,
                               tags={"tidal.sweep": "parent"}).info.run_id
    params = {"configs": " ".join(map(str, config)), "fixed": " ".join(fixed), "compute_metric": compute_metric,
              **window.params(), **{f"grid.{k}": ",".join(v) for k, v in axes}}
    for key, value in params.items():
        client.log_param(parent, key, value)
    try:
        runs = run_grid(config, overrides, out, uri, experiment, parent)
        client.log_dict(parent, runs, "runs.json")
        code = report(uri, runs, compute_metric, out / "fit.png", run_id=parent, window=window)
    except BaseException:
        client.set_terminated(parent, status="FAILED")
        raise
    client.set_terminated(parent)
    return code
