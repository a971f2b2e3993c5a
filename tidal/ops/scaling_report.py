"""`tidal fit`: fit ScaleRL sigmoids to eval curves (MLflow runs or a CSV), print a table,
draw the curves, log both to MLflow, and predict the pass rate at a given compute."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tidal import scaling

AUTO = "auto"


@dataclass(frozen=True)
class Window:
    """The part of each curve a fit sees, as fractions of the run's final compute: points below
    `skip` are left out (the early transient; the step-0 evaluation still counts), points above
    `fit` are held out and predicted. skip="auto" finds each curve's transient by a rule
    (`scaling.fit_past_transient`: the skip that best predicts the fitted points' own last quarter,
    its intervals widened to the fit on every point unless the skipped points depart beyond noise)."""

    fit: float | None = None
    skip: float | str | None = None

    def __post_init__(self):
        if self.skip == AUTO:
            check = (("--fit-fraction", self.fit),)
        elif isinstance(self.skip, str):
            raise ValueError(f"--skip-fraction={self.skip} must be a fraction between 0 and 1, or {AUTO}")
        else:
            check = (("--fit-fraction", self.fit), ("--skip-fraction", self.skip))
        for name, value in check:
            if value is not None and not 0 < value < 1:
                raise ValueError(f"{name}={value} must be between 0 and 1")
        if self.fit is not None and self.skip not in (None, AUTO) and self.skip >= self.fit:
            raise ValueError(f"--skip-fraction={self.skip} leaves nothing below --fit-fraction={self.fit}")

    def params(self) -> dict:
        return {"fit_fraction": self.fit or "", "skip_fraction": self.skip or ""}

    def sigmoid(self, compute, pass_rate, final: float) -> scaling.SigmoidFit:
        """The sigmoid fit of this curve's points past the skip (auto: past its transient, the choice paid
        for in the intervals)."""
        if self.skip == AUTO:
            return scaling.fit_past_transient(compute, pass_rate)
        return scaling.fit_sigmoid(compute, pass_rate, min_compute=self.skip and self.skip * final)


def fit_points(points: dict, window: Window, failed: dict | None = None) -> tuple[dict, dict, dict]:
    """Sigmoid and power-law fits per curve, and the points they saw. A curve that cannot be fitted (a run
    that came apart and never rose) raises, or, given `failed`, is left out and its reason kept there."""
    fits, power, seen = {}, {}, {}
    for name, (compute, pass_rate) in points.items():
        final = compute.max()
        if window.fit is not None:
            keep = compute <= window.fit * final
            compute, pass_rate = compute[keep], pass_rate[keep]
        try:
            fit = window.sigmoid(compute, pass_rate, final)
            late = (compute >= (fit.skipped_below or 0)) & (compute > 0)
            power[name] = scaling.fit_power_law(compute[late], pass_rate[late])
        except scaling.ScalingFitError as err:
            if failed is None:
                raise
            failed[name] = str(err)
            continue
        fits[name], seen[name] = fit, (compute, pass_rate)
    return fits, power, seen


def shared_a_table(fits: dict, seen: dict) -> str:
    """One A for every fitted curve, each with its own B and C_mid, over one window: the latest transient
    any curve skipped. Curves that came apart cannot share a rising A: said instead of a table."""
    skip = max((f.skipped_below or 0 for f in fits.values()), default=0) or None
    try:
        return scaling.fit_table(scaling.fit_common_A(seen, min_compute=skip), None, notes=False)
    except scaling.ScalingFitError as err:
        return f"not fitted: {err}"


def print_predictions(fits: dict, power: dict, points: dict, predict: float | None) -> None:
    for name, fit in fits.items():
        compute, pass_rate = points[name]
        off = float(fit.predict(compute[-1])) - pass_rate[-1]
        (lo,), (hi,) = fit.measured_interval(compute[-1])
        last = (
            f"final point: measured {pass_rate[-1]:.3f}, sigmoid {_with_interval(fit, compute[-1])} "
            f"(off by {off:+.3f}; a measurement there: [90%: {lo:.3f}, {hi:.3f}]), "
            f"power law {power[name].predict(compute[-1]):.3f}"
        )
        skipped = f"; the transient below compute {fit.skipped_below:.3g} left out" if fit.skipped_below else ""
        at = f"; predicted pass rate at compute {predict:g}: {_with_interval(fit, predict)}" if predict else ""
        print(f"{name}: {last}{skipped}{at}")


def _with_interval(fit, compute: float) -> str:
    lo, hi = fit.predict_interval(compute)
    return f"{float(fit.predict(compute)):.3f} [90%: {lo[0]:.3f}, {hi[0]:.3f}]"


def report(
    uri: str,
    runs: dict[str, str],
    compute_metric: str,
    png: Path,
    run_id: str | None = None,
    window: Window = Window(),
    predict: float | None = None,
    target: float | None = None,
) -> int:
    """Fit the runs' curves, print and draw them, and log the fit: into `run_id` (a sweep's parent
    run), else into a new run beside the first fitted run, linked to every run it fitted. With a
    target, the curves are fitted against wall time too and the run that reaches it soonest is named."""
    raw = scaling.points_from_mlflow(uri, list(runs.values()), compute_metric=compute_metric)
    points = dict(zip(_labels(runs, raw), raw.values()))
    failed = {} if len(points) > 1 else None  # one curve that cannot be fitted is the error itself
    fits, power, seen = fit_points(points, window, failed)
    if not fits:
        raise scaling.ScalingFitError("no run could be fitted: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    table = scaling.fit_table(fits, power)
    table += "".join(f"\nnot fitted: {name}: {why}" for name, why in (failed or {}).items())
    if len(fits) >= 2:
        table += "\n\nshared A (compare B across runs):\n" + shared_a_table(fits, seen)
    print(table)
    print_predictions(fits, power, points, predict)
    scaling.plot_fits(points, fits, png, power=power, title=f"pass rate vs {compute_metric}")
    print(f"plot: {png}")
    pngs = [png]
    if target is not None:
        wall = dict(zip(points, scaling.points_from_mlflow(uri, list(runs.values()), compute_metric=WALL).values()))
        pngs.append(png.with_name(f"{png.stem}-wall.png"))
        reach = reach_table(points, wall, window, target, compute_metric, pngs[-1])
        pngs = [p for p in pngs if p.exists()]  # no wall-time figure where no curve could be fitted
        print(reach)
        table += "\n\n" + reach
    log_fit(
        uri,
        runs,
        fits,
        table,
        pngs,
        run_id,
        {"compute_metric": compute_metric, "predict": predict, "target": target, **window.params()},
    )
    return 0


WALL = "compute/wall_s"


SEED = ",seed="  # a sweep's replicates: labels that differ only in what follows this


def pooled(points: dict) -> dict:
    """Runs that differ only in their seed as one curve, their points together; others as they are."""
    groups: dict[str, list] = {}
    for label, curve in points.items():
        groups.setdefault(label.split(SEED)[0], []).append(curve)
    return {
        name: (np.concatenate([c for c, _ in group]), np.concatenate([r for _, r in group]))
        for name, group in groups.items()
    }


def reach_table(
    points: dict, wall: dict, window: Window, target: float, compute_metric: str, png: Path | None = None
) -> str:
    """Per run (a sweep's seeds of one point pooled into one curve), the predicted compute and wall time
    to `target` with 90% intervals (inf: the curve, or some curve its data allow, never gets there) beside
    the measured wall time (the first evaluation at or above it, from the step-0 evaluation; the median
    over seeds); then the verdict (`verdict`), its pick last. The fits keep the early points: a target is
    often crossed within the transient. `png` gets the wall-time fits."""
    keep_all = Window(fit=window.fit)
    fits, _, _ = fit_points(pooled(points), keep_all, failed={})
    wall_fits, _, _ = fit_points(pooled(wall), keep_all, failed={})
    fits = {name: fit for name, fit in fits.items() if name in wall_fits}  # a curve that never rose has no time
    if not fits:
        return f"no run could be fitted against wall time: none is predicted to reach {target:g}"
    measured: dict[str, list[float]] = {}
    for label, (seconds, rates) in wall.items():
        hit = np.flatnonzero((rates >= target) & (seconds > 0))
        measured.setdefault(label.split(SEED)[0], []).append(seconds[hit[0]] if hit.size else np.inf)
    num_seeds = min(len(measured[name]) for name in fits)
    if png is not None:
        fitted = {name: curve for name, curve in pooled(wall).items() if name in fits}
        pooled_note = f", {num_seeds} seeds pooled" if num_seeds > 1 else ""
        scaling.plot_fits(
            fitted,
            wall_fits,
            png,
            xlabel="wall time since the step-0 evaluation (s)",
            title=f"pass rate vs wall time{pooled_note}",
            target=target,
        )
        print(f"plot: {png}")
    rows = [["run", f"{compute_metric} to {target:g} [90%]", f"wall s to {target:g} [90%]", "measured wall s"]]
    reach = {name: wall_fits[name].compute_to(target) for name in fits}
    for name in fits:
        seen = float(np.median(measured[name]))
        rows.append(
            [
                name,
                _reach(fits[name].compute_to(target), ".3g"),
                _reach(reach[name], ".1f"),
                f"{seen:.1f}" if np.isfinite(seen) else "not reached",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([*lines, *verdict(reach, target, num_seeds)])


def verdict(reach: dict[str, tuple[float, float, float]], target: float, num_seeds: int) -> list[str]:
    """The lines under the reach table, the pick last: what a reader who never heard of the fit's
    parameters needs to act on. `reach` maps each run to its predicted wall seconds to `target` (best,
    lo, hi); `num_seeds` is the fewest runs pooled into one of them."""
    order = sorted(reach, key=lambda name: reach[name][0])
    best = order[0]
    if not np.isfinite(reach[best][0]):
        return [f"no run is predicted to reach {target:g}: fit on longer runs or lower the target"]
    pick = (
        f"pick: {best}, predicted to reach {target:g} soonest ({_reach(reach[best], '.1f')} s of wall time "
        f"to an eval pass rate of {target:g}, its 90% interval in brackets)"
    )
    if len(order) == 1:
        return [f"{pick}; the only run fitted"]
    second, more_seeds = order[1], f"--seeds {max(3, 2 * num_seeds)}"
    lines = []
    if num_seeds == 1:
        lines.append(
            f"warning: one seed per value: a run's own luck can move its time to {target:g} by more than "
            f"the values differ, and one run per value cannot show it; use {more_seeds}"
        )
    if reach[best][2] < reach[second][1]:
        return [*lines, f"{pick}; clearly ahead of the runner-up, {second} ({_reach(reach[second], '.1f')} s)"]
    lines.append(
        f"inconclusive: the intervals overlap ({best} {_reach(reach[best], '.1f')} s, {second} "
        f"{_reach(reach[second], '.1f')} s), so this sweep cannot tell which reaches {target:g} sooner; "
        f"add seeds ({more_seeds}) or steps (learner.max_steps) and sweep again"
    )
    return [*lines, f"{pick}; tentative: the runner-up, {second}, may be as fast"]


def _reach(span: tuple[float, float, float], fmt: str) -> str:
    best, lo, hi = span
    return f"{best:{fmt}} [{lo:{fmt}},{hi:{fmt}}]"


def _labels(runs: dict[str, str], named: dict) -> list[str]:
    """Each run's label in the table, the plot's legend and the fit's metrics: the caller's (a sweep
    point's), or where the caller had only the run id (`tidal fit --runs`), the run's name as
    `points_from_mlflow` gave it (the keys of `named`, in the order of `runs`)."""
    labels = [name if label == run_id else label for (label, run_id), name in zip(runs.items(), named)]
    if len(set(labels)) < len(labels):  # a run named like another run's label: keep every curve
        labels = [
            f"{label} ({run_id[:8]})" if labels.count(label) > 1 else label
            for label, run_id in zip(labels, runs.values())
        ]
    return labels


def log_fit(
    uri: str, runs: dict[str, str], fits: dict, table: str, pngs: list[Path], run_id: str | None, params: dict
) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    created = run_id is None
    if created:
        first = client.get_run(next(iter(runs.values())))
        run_id = client.create_run(
            first.info.experiment_id, run_name="scaling-fit", tags={"tidal.fitted_runs": ",".join(runs.values())}
        ).info.run_id
        for key, value in {**params, **{f"run.{_safe(label)}": rid for label, rid in runs.items()}}.items():
            client.log_param(run_id, key, "" if value is None else value)
    for fitted in runs.values():
        client.set_tag(fitted, "tidal.fit_run_id", run_id)  # each fitted run points at its fit
    for png in pngs:
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
