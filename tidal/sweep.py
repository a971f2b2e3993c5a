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
from dataclasses import dataclass
from pathlib import Path

from tidal.config import load_config


class SweepRunFailed(Exception):
    """A run of the grid exited with an error; the message names it and its logs."""


@dataclass(frozen=True)
class GridPoint:
    """One run of a sweep: its label (`key=value,key=value`), its overrides and its run folder."""

    label: str
    overrides: tuple[str, ...]
    run_dir: Path


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
        raise ValueError("no key=v1,v2,... override to sweep over: give at least one, e.g. staleness.max_lag=0,2,8")
    return fixed, axes


def grid_points(config: list[str], overrides: list[str], out: Path) -> list[GridPoint]:
    """Every point of the grid, each one's config loaded here: a bad key or value anywhere in the grid
    is a ConfigError before the first run starts, not after the runs before it."""
    fixed, axes = split_grid(overrides)
    points = []
    for values in itertools.product(*(vals for _, vals in axes)):
        combo = [f"{key}={v}" for (key, _), v in zip(axes, values)]
        label = ",".join(combo)
        run_dir = out / label.replace("=", "-").replace(",", "_")
        point = GridPoint(label, (*fixed, *combo, f"run_dir={run_dir}", f"name={run_dir.name}"), run_dir)
        load_config(config, list(point.overrides))
        points.append(point)
    return points


def sweep_store(config: list[str], fixed: list[str], out: Path) -> tuple[str, str]:
    """The MLflow store and experiment of a sweep: the config's or the environment's, else its own sqlite file."""
    tracking = load_config(config, fixed).tracking
    uri = tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(out / 'mlflow.db').resolve()}"
    return uri, tracking.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or f"sweep-{out.name}"


def run_grid(config: list[str], points: list[GridPoint], out: Path, uri: str, experiment: str,
             parent_run_id: str) -> dict[str, str]:
    """Runs every point of the grid as a child of the parent run; returns label -> MLflow run id."""
    from tidal.launcher import launch

    runs = {}
    for point in points:
        cfg = load_config(config, [*point.overrides, f"tracking.uri={uri}", f"tracking.experiment={experiment}",
                                   f"tracking.parent_run_id={parent_run_id}"])
        print(f"[sweep] {point.label}", flush=True)
        if launch(cfg) != 0:
            raise SweepRunFailed(f"the run {point.label} failed; its logs: {point.run_dir}/logs")
        runs[point.label] = json.loads((point.run_dir / "summary.json").read_text())["mlflow_run_id"]
    (out / "runs.json").write_text(json.dumps(runs, indent=2))
    return runs


def open_sweep_store(uri: str, experiment: str, out: Path):
    """The sweep's MLflow client, its experiment made; a store MLflow cannot open (a URI it does not
    know, a server that is down) is a ValueError naming the URI, before any run starts."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from tidal.learner.tracking import use_store
    from tidal.scaling import one_line

    try:
        use_store(uri, experiment, out / "artifacts")
        return MlflowClient(uri)
    except MlflowException as err:
        raise ValueError(f"the sweep's MLflow store {uri} (tracking.uri, else MLFLOW_TRACKING_URI): "
                         f"{one_line(err)}") from None


def sweep(config: list[str], overrides: list[str], out: Path | None, compute_metric: str, window=None) -> int:
    from tidal.scaling_report import Window, report

    window = window or Window()
    out = out or Path(f"runs/sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder: give a new or existing folder")
    fixed, axes = split_grid(overrides)
    points = grid_points(config, overrides, out)  # every point checked before anything is made or run
    out.mkdir(parents=True, exist_ok=True)
    uri, experiment = sweep_store(config, fixed, out)
    client = open_sweep_store(uri, experiment, out)
    # created through the client, not made the active run: the runs of the grid start their own
    parent = client.create_run(client.get_experiment_by_name(experiment).experiment_id, run_name=out.name,
                               tags={"tidal.sweep": "parent"}).info.run_id
    params = {"configs": " ".join(map(str, config)), "fixed": " ".join(fixed), "compute_metric": compute_metric,
              **window.params(), **{f"grid.{k}": ",".join(v) for k, v in axes}}
    for key, value in params.items():
        client.log_param(parent, key, value)
    try:
        runs = run_grid(config, points, out, uri, experiment, parent)
        client.log_dict(parent, runs, "runs.json")
        code = report(uri, runs, compute_metric, out / "fit.png", run_id=parent, window=window)
    except BaseException:
        client.set_terminated(parent, status="FAILED")
        raise
    client.set_terminated(parent)
    return code
