"""Does a fit of a run's first half predict where the run ends? Runs a config at several seeds (runs kept
in --out are read again, not rerun), fits each run's eval curve on its first half of compute with the
early transient left out by `tidal fit`'s rule (--skip-fraction auto), and compares the prediction of
the final pass rate (the mean of the last three evaluations) with the measurement.

    python bench/predict_own.py tiny-scalerl curriculum.enabled=false --seeds 6 --out /tmp/own

Prints one JSON line per seed (the transient the rule skipped, the prediction, the curve's 90% interval
and the interval for a measurement, the mean of three evaluations) and a summary line: how many finals
fell inside each interval and within 0.03 of the prediction.
"""

import argparse
import json
from pathlib import Path

import numpy as np

from runs import mlflow_run, tidal_run
from tidal.ops.scaling_report import AUTO, Window, fit_points
from tidal.scaling import points_from_mlflow

FINAL_EVALS = 3
CLOSE = 0.03


def predict_run(run_dir: Path, compute_metric: str, fit_fraction: float) -> dict:
    """The first-half fit's prediction of the run's final pass rate, against the measurement."""
    uri, run_id = mlflow_run(run_dir)
    ((compute, pass_rate),) = points_from_mlflow(uri, [run_id], compute_metric=compute_metric).values()
    fits, _, seen = fit_points({"run": (compute, pass_rate)}, Window(fit=fit_fraction, skip=AUTO))
    fit = fits["run"]
    last = compute[-FINAL_EVALS:]
    final, predicted = float(pass_rate[-FINAL_EVALS:].mean()), float(np.mean(fit.predict(last)))
    (lo,), (hi,) = fit.predict_interval(last.mean())
    (mlo,), (mhi,) = fit.measured_interval(last.mean(), num_evals=FINAL_EVALS)
    return {
        "run": run_dir.name,
        "evals": int(compute.size),
        "fitted_evals": int(seen["run"][0].size),
        "skipped_below_share": fit.skipped_below and round(fit.skipped_below / compute.max(), 3),
        "A": round(fit.A, 3),
        "final": round(final, 4),
        "predicted": round(predicted, 4),
        "off": round(predicted - final, 4),
        "curve_interval": [round(float(lo), 4), round(float(hi), 4)],
        "measurement_interval": [round(float(mlo), 4), round(float(mhi), 4)],
        "in_curve_interval": bool(lo <= final <= hi),
        "in_measurement_interval": bool(mlo <= final <= mhi),
        "within_0.03": bool(abs(predicted - final) <= CLOSE),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="+", help="presets, YAML files and key=value overrides")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--fit-fraction", type=float, default=0.5)
    parser.add_argument("--compute-metric", default="compute/flops")
    parser.add_argument("--out", required=True, help="the runs' folder (kept runs are read, not rerun)")
    args = parser.parse_args()
    config, overrides = [c for c in args.config if "=" not in c], [c for c in args.config if "=" in c]
    lines = []
    for seed in range(args.seeds):
        run_dir = Path(args.out) / f"seed{seed}"
        if not (run_dir / "summary.json").is_file():
            tidal_run(config, [*overrides, f"learner.seed={seed}", f"actor.seed={seed}"], run_dir, f"seed {seed}")
        lines.append(predict_run(run_dir, args.compute_metric, args.fit_fraction))
        print(json.dumps(lines[-1]), flush=True)
    print(
        json.dumps(
            {
                "seeds": len(lines),
                "fit_fraction": args.fit_fraction,
                "compute_metric": args.compute_metric,
                **{
                    key: sum(line[key] for line in lines)
                    for key in ("in_curve_interval", "in_measurement_interval", "within_0.03")
                },
                "mean_abs_off": round(float(np.mean([abs(line["off"]) for line in lines])), 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
