"""`tidal sweep CONFIG... key=v1,v2 [key=value ...]`: run a grid sequentially, then fit it.

Every run of the grid logs to one MLflow store (`<out>/mlflow.db`, one experiment), so the
runs sit side by side; afterwards their eval curves are fitted with the ScaleRL sigmoid
(`tidal.scaling`), and the table and the plot are printed, written and logged to MLflow.
"""
from __future__ import annotations

import itertools
import json
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


def run_grid(config: list[str], overrides: list[str], out: Path) -> dict[str, str]:
    """Runs every point of the grid; returns label -> MLflow run id."""
    from tidal.launcher import launch

    fixed, axes = split_grid(overrides)
    out.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    runs = {}
    for values in itertools.product(*(vals for _, vals in axes)):
        combo = [f"{key}={v}" for (key, _), v in zip(axes, values)]
        label = ",".join(combo)
        run_dir = out / label.replace("=", "-").replace(",", "_")
        cfg = load_config(config, [*fixed, *combo, f"run_dir={run_dir}", f"tracking.uri={uri}", f"name={run_dir.name}",
                                   f"tracking.experiment=sweep-{out.name}"])
        print(f"[sweep] {label}", flush=True)
        if launch(cfg) != 0:
            raise RuntimeError(f"sweep run {label} failed; see {run_dir}/logs")
        runs[label] = json.loads((run_dir / "summary.json").read_text())["mlflow_run_id"]
    (out / "runs.json").write_text(json.dumps(runs, indent=2))
    return runs


def sweep(config: list[str], overrides: list[str], out: Path | None, compute_metric: str) -> int:
    from tidal.scaling_report import report

    out = out or Path(f"runs/sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    runs = run_grid(config, overrides, out)
    uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    return report(uri, runs, compute_metric, out / "fit.png", experiment=f"sweep-{out.name}")
