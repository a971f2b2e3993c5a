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
import re
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


def grid_points(config: list[str], overrides: list[str], out: Path, seeds: int = 1) -> list[GridPoint]:
    """Every point of the grid, `seeds` runs each (learner.seed and actor.seed 0, 1, ..., the label ending
    ',seed=N'; one run keeps the config's seeds), each one's config loaded here: a bad key or value
    anywhere in the grid is a ConfigError before the first run starts, not after the runs before it."""
    fixed, axes = split_grid(overrides)
    replicas = [[f"learner.seed={s}", f"actor.seed={s}"] for s in range(seeds)] if seeds > 1 else [[]]
    points = []
    for values, seeded in itertools.product(itertools.product(*(vals for _, vals in axes)), replicas):
        combo = [f"{key}={v}" for (key, _), v in zip(axes, values)]
        label = ",".join(combo) + (f",seed={seeded[0].split('=')[1]}" if seeded else "")
        combo += seeded
        run_dir = out / label.replace("=", "-").replace(",", "_")
        name = re.sub(r"[^A-Za-z0-9_.-]", "-", run_dir.name)[:128]  # a value may hold what a run name may not
        point = GridPoint(label, (*fixed, *combo, f"run_dir={run_dir}", f"name={name}"), run_dir)
        load_config(config, list(point.overrides))
        points.append(point)
    return points


def sweep_store(config: list[str], fixed: list[str], out: Path) -> tuple[str, str]:
    """The MLflow store and experiment of a sweep: the config's or the environment's, else its own sqlite file."""
    tracking = load_config(config, fixed).tracking
    uri = tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(out / 'mlflow.db').resolve()}"
    return uri, tracking.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or f"sweep-{out.name}"


def run_grid(
    config: list[str], points: list[GridPoint], out: Path, uri: str, experiment: str, parent_run_id: str
) -> dict[str, str]:
    """Runs every point of the grid as a child of the parent run; returns label -> MLflow run id."""
    from tidal.ops.launcher import launch

    runs = {}
    for point in points:
        cfg = load_config(
            config,
            [
                *point.overrides,
                f"tracking.uri={uri}",
                f"tracking.experiment={experiment}",
                f"tracking.parent_run_id={parent_run_id}",
            ],
        )
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

    from tidal.mlflow_store import use_store
    from tidal.ops.reachable import STORE_TIMEOUT_S, check_server
    from tidal.scaling import one_line

    if uri.lower().startswith(("http://", "https://")):  # MLflow's client retries a dead server for minutes
        check_server(uri, f"the sweep's MLflow store {uri!r} (tracking.uri, else MLFLOW_TRACKING_URI)", STORE_TIMEOUT_S)
    try:
        use_store(uri, experiment, out / "artifacts")
        return MlflowClient(uri)
    except MlflowException as err:
        raise ValueError(
            f"the sweep's MLflow store {uri} (tracking.uri, else MLFLOW_TRACKING_URI): {one_line(err)}"
        ) from None


def sweep(
    config: list[str],
    overrides: list[str],
    out: Path | None,
    compute_metric: str,
    window=None,
    target: float | None = None,
    seeds: int = 1,
) -> int:
    from tidal.ops.scaling_report import Window, report

    window = window or Window()
    out = out or Path(f"runs/sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder: give a new or existing folder")
    fixed, axes = split_grid(overrides)
    points = grid_points(config, overrides, out, seeds)  # every point checked before anything is made or run
    out.mkdir(parents=True, exist_ok=True)
    uri, experiment = sweep_store(config, fixed, out)
    client = open_sweep_store(uri, experiment, out)
    # created through the client, not made the active run: the runs of the grid start their own
    parent = client.create_run(
        client.get_experiment_by_name(experiment).experiment_id, run_name=out.name, tags={"tidal.ops.sweep": "parent"}
    ).info.run_id
    params = {
        "configs": " ".join(map(str, config)),
        "fixed": " ".join(fixed),
        "compute_metric": compute_metric,
        "seeds": seeds,
        **window.params(),
        **{f"grid.{k}": ",".join(v) for k, v in axes},
    }
    for key, value in params.items():
        client.log_param(parent, key, value)
    try:
        runs = run_grid(config, points, out, uri, experiment, parent)
        client.log_dict(parent, runs, "runs.json")
        if {LAG, LR} <= {key for key, _ in axes}:
            log_stability(client, parent, uri, runs, out)
        # the fit's report ends with the pick (with --target): the line to act on goes last
        code = report(uri, runs, compute_metric, out / "fit.png", run_id=parent, window=window, target=target)
        if target is None:
            print(NO_TARGET)
    except BaseException:
        client.set_terminated(parent, status="FAILED")
        raise
    client.set_terminated(parent)
    return code


LAG, LR = "staleness.max_lag", "learner.optim.lr"
NO_TARGET = (
    "no pick: the table compares each value's ceiling A (the pass rate its fitted curve levels off at) and "
    "steepness B; to name the value that reaches a pass rate soonest, give one: --target 0.6 on the sweep, or "
    "tidal fit --tracking-uri <its store> --runs <the ids in its runs.json> --target 0.6 on these runs"
)


def log_stability(client, parent: str, uri: str, runs: dict[str, str], out: Path) -> None:
    """A max_lag x lr grid's stability table, printed and logged on the sweep's parent run."""
    from tidal.scaling import points_from_mlflow

    curves = points_from_mlflow(uri, list(runs.values()))
    points = dict(zip(runs, curves.values()))
    axes = {label: dict(item.split("=", 1) for item in label.split(",")) for label in runs}
    text = stability_report(points, axes, out / "stability.png")
    print(text)
    client.log_text(parent, text, "stability.txt")
    client.log_artifact(parent, str(out / "stability.png"))


STABLE_DROP = 0.1  # a run that ends this far below its best evaluation has come apart
FINAL_EVALS = 3


@dataclass(frozen=True)
class Stability:
    lag: int
    lr: float
    first: float
    best: float
    final: float  # the mean of the last FINAL_EVALS evaluations

    @property
    def stable(self) -> bool:
        """It learnt (ended above where it started) and kept it (ended within STABLE_DROP of its best)."""
        return self.final > self.first and self.final >= self.best - STABLE_DROP


def stability(points: dict[str, tuple], axes: dict[str, dict[str, str]]) -> list[Stability]:
    """One row per run of a max_lag x lr grid: `points` are label -> (compute, pass rate), `axes` label ->
    {key: value} of the grid point."""
    rows = []
    for label, (_, rates) in points.items():
        rows.append(
            Stability(
                int(axes[label][LAG]),
                float(axes[label][LR]),
                float(rates[0]),
                float(rates.max()),
                float(rates[-FINAL_EVALS:].mean()),
            )
        )
    return sorted(rows, key=lambda r: (r.lag, r.lr))


def largest_stable_lr(rows: list[Stability]) -> dict[int, float | None]:
    """Per max_lag, the largest lr whose run was stable, every smaller lr's run stable too (None: not even
    the smallest)."""
    out: dict[int, float | None] = {}
    for lag in sorted({r.lag for r in rows}):
        out[lag] = None
        for row in (r for r in rows if r.lag == lag):  # rising lr
            if not row.stable:
                break
            out[lag] = row.lr
    return out


def stability_verdict(largest: dict[int, float | None], lrs: list[float]) -> str:
    """Whether the largest stable lr falls like 1/(max_lag + 1), read at the grid's resolution (the ratio
    between neighbouring lrs): each lag's largest stable lr against the smallest lag's times
    (lag0 + 1) / (lag + 1). A lag with no stable lr fits the law where it puts that lag's rate below
    the grid's smallest (within a step)."""
    known = {lag: lr for lag, lr in largest.items() if lr is not None}
    if not known or len(largest) < 2:
        return "too few lags with a stable lr to compare"
    if all(lr == max(lrs) for lr in known.values()) and len(known) == len(largest):
        return f"every lag was stable up to the largest lr tried ({max(lrs):g}): try larger ones"
    step = max(b / a for a, b in zip(lrs, lrs[1:])) if len(lrs) > 1 else 1.0
    base_lag = min(known)
    law = {lag: known[base_lag] * (base_lag + 1) / (lag + 1) for lag in largest}
    follows = all(
        law[lag] / step <= known[lag] <= law[lag] * step if lag in known else law[lag] < min(lrs) * step
        for lag in largest
    )
    none = [
        f"max_lag {lag}: no stable lr on the grid, the law puts it at {law[lag]:.2g}"
        for lag in largest
        if lag not in known
    ]
    falls = len(known) < len(largest) or any(known[lag] < known[base_lag] for lag in known)
    if follows and falls:
        return "the largest stable lr falls like 1/(max_lag + 1), within a step of the lr grid" + (
            f" ({'; '.join(none)})" if none else ""
        )
    if not falls:
        return "the largest stable lr does not fall with max_lag on this grid"
    return "the largest stable lr falls with max_lag, but not like 1/(max_lag + 1)" + (
        f" ({'; '.join(none)})" if none else ""
    )


def stability_report(points: dict[str, tuple], axes: dict[str, dict[str, str]], png: Path) -> str:
    """The table, the verdict and the figure of a max_lag x lr grid."""
    from tidal.scaling import figure, log_ticks, save_figure

    rows = stability(points, axes)
    largest = largest_stable_lr(rows)
    lrs = sorted({r.lr for r in rows})
    lines = [
        f"stability (stable: ended above its start and within {STABLE_DROP} of its best evaluation)",
        "max_lag  " + "  ".join(f"lr {lr:<8g}" for lr in lrs) + "  largest stable lr",
    ]
    for lag in sorted(largest):
        cells = {r.lr: f"{r.final:.3f} {'ok' if r.stable else 'X '}" for r in rows if r.lag == lag}
        lines.append(
            f"{lag:<7}  "
            + "  ".join(f"{cells.get(lr, '-'):<11}" for lr in lrs)
            + f"  {largest[lag] if largest[lag] is not None else 'none'}"
        )
    lines.append(stability_verdict(largest, lrs))
    fig, ax = figure()
    for i, lag in enumerate(sorted(largest)):
        mine = [r for r in rows if r.lag == lag]
        ax.plot([r.lr for r in mine], [r.final for r in mine], "-", color=f"C{i}", label=f"max_lag {lag}")
        for r in mine:
            ax.plot(r.lr, r.final, "o" if r.stable else "x", color=f"C{i}", markersize=7)
    ax.plot([], [], "x", color="grey", label="came apart (not stable)")
    ax.set_xscale("log")
    log_ticks(ax.xaxis)
    ax.set(
        xlabel="learning rate",
        ylabel=f"final pass rate (last {FINAL_EVALS} evaluations)",
        title="largest stable learning rate per staleness bound",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, png, dpi=120)
    return "\n".join(lines)
