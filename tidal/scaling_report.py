"""`tidal fit`: fit ScaleRL sigmoids to eval curves (MLflow runs or a CSV), print a table,
draw the curves, log both to MLflow, and predict the pass rate at a given compute."""
from __future__ import annotations

from pathlib import Path

from tidal import scaling


def fit_points(points: dict, fit_fraction: float | None) -> tuple[dict, dict]:
    """Sigmoid and power-law fits per curve (on the first fit_fraction of compute, if given)."""
    fits, power = {}, {}
    for name, (compute, pass_rate) in points.items():
        if fit_fraction is not None:
            keep = compute <= fit_fraction * compute.max()
            compute, pass_rate = compute[keep], pass_rate[keep]
        fits[name] = scaling.fit_sigmoid(compute, pass_rate)
        power[name] = scaling.fit_power_law(compute[compute > 0], pass_rate[compute > 0])
    return fits, power


def print_predictions(fits: dict, power: dict, points: dict, predict: float | None) -> None:
    for name, fit in fits.items():
        compute, pass_rate = points[name]
        last = f"final point: measured {pass_rate[-1]:.3f}, sigmoid {fit.predict(compute[-1]):.3f}, " \
               f"power law {power[name].predict(compute[-1]):.3f}"
        at = f"; predicted pass rate at compute {predict:g}: {fit.predict(predict):.4f}" if predict else ""
        print(f"{name}: {last}{at}")


def report(uri: str, runs: dict[str, str], compute_metric: str, png: Path, experiment: str,
           fit_fraction: float | None = None, predict: float | None = None) -> int:
    import mlflow

    raw = scaling.points_from_mlflow(uri, list(runs.values()), compute_metric=compute_metric)
    points = dict(zip(runs, raw.values()))  # one entry per run id, in order: label them as the caller does
    fits, power = fit_points(points, fit_fraction)
    table = scaling.fit_table(fits, power)
    if len(points) >= 2:
        common = scaling.fit_common_A(points)
        table += "\n\nshared A (compare B across runs):\n" + scaling.fit_table(common, None)
    print(table)
    print_predictions(fits, power, points, predict)
    scaling.plot_fits(points, fits, png, power=power, title=f"pass rate vs {compute_metric}")
    print(f"plot: {png}")
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name="scaling-fit"):
        mlflow.log_artifact(str(png))
        mlflow.log_text(table, "fit_table.txt")
        for name, fit in fits.items():
            safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
            mlflow.log_metrics({f"fit/{safe}/A": fit.A, f"fit/{safe}/B": fit.B, f"fit/{safe}/C_mid": fit.C_mid})
    return 0


def fit_csv(path: str, predict: float | None, fit_fraction: float | None, png: Path) -> int:
    points = {Path(path).stem: scaling.read_csv(path)}
    fits, power = fit_points(points, fit_fraction)
    print(scaling.fit_table(fits, power))
    print_predictions(fits, power, points, predict)
    scaling.plot_fits(points, fits, png, power=power, title=Path(path).name)
    print(f"plot: {png}")
    return 0
