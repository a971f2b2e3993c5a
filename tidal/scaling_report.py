"""`tidal fit`: fit ScaleRL sigmoids to eval curves (MLflow runs or a CSV), print a table,
draw the curves, log both to MLflow, and predict the pass rate at a given compute."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tidal import scaling


@dataclass(frozen=True)
class Window:
    """The part of each curve a fit sees, as fractions of the run's final compute: points below
    `skip` are left out (the early transient; the step-0 evaluation still counts), points above
    `fit` are held out and predicted."""

    fit: float | None = None
    skip: float | None = None

    def __post_init__(self):
        for name, value in (("--fit-fraction", self.fit), ("--skip-fraction", self.skip)):
            if value is not None and not 0 < value < 1:
                raise ValueError(f"{name}={value} must be between 0 and 1")
        if self.fit is not None and self.skip is not None and self.skip >= self.fit:
            raise ValueError(f"--skip-fraction={self.skip} leaves nothing below --fit-fraction={self.fit}")

    def params(self) -> dict:
        return {"fit_fraction": self.fit or "", "skip_fraction": self.skip or ""}


def fit_points(points: dict, window: Window) -> tuple[dict, dict, dict]:
    """Sigmoid and power-law fits per curve, and the points they saw."""
    fits, power, seen = {}, {}, {}
    for name, (compute, pass_rate) in points.items():
        final = compute.max()
        if window.fit is not None:
            keep = compute <= window.fit * final
            compute, pass_rate = compute[keep], pass_rate[keep]
        seen[name] = (compute, pass_rate)
        fits[name] = scaling.fit_sigmoid(compute, pass_rate, min_compute=window.skip and window.skip * final)
        late = compute >= (window.skip or 0) * final
        power[name] = scaling.fit_power_law(compute[late & (compute > 0)], pass_rate[late & (compute > 0)])
    return fits, power, seen


def print_predictions(fits: dict, power: dict, points: dict, predict: float | None) -> None:
    for name, fit in fits.items():
        compute, pass_rate = points[name]
        off = float(fit.predict(compute[-1])) - pass_rate[-1]
        last = f"final point: measured {pass_rate[-1]:.3f}, sigmoid {_with_interval(fit, compute[-1])} " \
               f"(off by {off:+.3f}), power law {power[name].predict(compute[-1]):.3f}"
        at = f"; predicted pass rate at compute {predict:g}: {_with_interval(fit, predict)}" if predict else ""
        print(f"{name}: {last}{at}")


def _with_interval(fit, compute: float) -> str:
    lo, hi = fit.predict_interval(compute)
    return f"{float(fit.predict(compute)):.3f} [90%: {lo[0]:.3f}, {hi[0]:.3f}]"


def report(uri: str, runs: dict[str, str], compute_metric: str, png: Path, run_id: str | None = None,
           window: Window = Window(), predict: float | None = None) -> int:
    """Fit the runs' curves, print and draw them, and log the fit: into `run_id` (a sweep's parent
    run), else into a new run beside the first fitted run, linked to every run it fitted."""
    raw = scaling.points_from_mlflow(uri, list(runs.values()), compute_metric=compute_metric)
    points = dict(zip(_labels(runs, raw), raw.values()))
    fits, power, seen = fit_points(points, window)
    table = scaling.fit_table(fits, power)
    if len(points) >= 2:
        common = scaling.fit_common_A(seen, min_compute=window.skip and window.skip * min(
            c.max() for c, _ in points.values()))
        table += "\n\nshared A (compare B across runs):\n" + scaling.fit_table(common, None, notes=False)
    print(table)
    print_predictions(fits, power, points, predict)
    scaling.plot_fits(points, fits, png, power=power, title=f"pass rate vs {compute_metric}")
    print(f"plot: {png}")
    log_fit(uri, runs, fits, table, png, run_id, {"compute_metric": compute_metric, "predict": predict,
                                                  **window.params()})
    return 0


def _labels(runs: dict[str, str], named: dict) -> list[str]:
    """Each run's label in the table, the plot's legend and the fit's metrics: the caller's (a sweep
    point's), or where the caller had only the run id (`tidal fit --runs`), the run's name as
    `points_from_mlflow` gave it (the keys of `named`, in the order of `runs`)."""
    labels = [name if label == run_id else label for (label, run_id), name in zip(runs.items(), named)]
    if len(set(labels)) < len(labels):  # a run named like another run's label: keep every curve
        labels = [f"{label} ({run_id[:8]})" if labels.count(label) > 1 else label
                  for label, run_id in zip(labels, runs.values())]
    return labels


def log_fit(uri: str, runs: dict[str, str], fits: dict, table: str, png: Path, run_id: str | None,
            params: dict) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    created = run_id is None
    if created:
        first = client.get_run(next(iter(runs.values())))
        run_id = client.create_run(first.info.experiment_id, run_name="scaling-fit",
                                   tags={"tidal.fitted_runs": ",".join(runs.values())}).info.run_id
        for key, value in {**params, **{f"run.{_safe(label)}": rid for label, rid in runs.items()}}.items():
            client.log_param(run_id, key, "" if value is None else value)
    for fitted in runs.values():
        client.set_tag(fitted, "tidal.fit_run_id", run_id)  # each fitted run points at its fit
    client.log_artifact(run_id, str(png))
    client.log_text(run_id, table, "fit_table.txt")
    for name, fit in fits.items():
        for key, value in (("A", fit.A), ("B", fit.B), ("C_mid", fit.C_mid)):
            client.log_metric(run_id, f"fit/{_safe(name)}/{key}", value)
    if created:
        client.set_terminated(run_id)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def fit_csv(path: str, predict: float | None, window: Window, png: Path) -> int:
    points = {Path(path).stem: scaling.read_csv(path)}
    fits, power, _ = fit_points(points, window)
    print(scaling.fit_table(fits, power))
    print_predictions(fits, power, points, predict)
    scaling.plot_fits(points, fits, png, power=power, title=Path(path).name)
    print(f"plot: {png}")
    return 0
