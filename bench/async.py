"""Does asynchrony pay? Time to a target pass rate against the staleness bound, side by side in one run.

Runs tidal at every staleness.max_lag and seed (learner and actor each on a core of their own, as the
launcher pins them), on each config, and prints one JSON line per run:

    task, max_lag, seed, wall_s, steps, samples, time_to_target_s, final_pass_rate

then one summary line per max_lag: the median time to target, its ratio to max_lag 0's (how many
times sooner; above 1 is faster) with a bootstrap 90% interval over seeds, and the median final pass
rate's difference from max_lag 0's. The target is the max_lag-0 runs' median final pass rate minus
--margin (or --target). Times count from the end of the step-0 evaluation (start-up left out). A
PNG per config draws the pass rate against wall time for every run, coloured by max_lag.

    python bench/async.py                                         # demo and long task, k 0,1,2,4,8, 3 seeds
    python bench/async.py --config configs/long.yaml --max-lag 0,4 --seeds 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from runs import history, tidal_run, time_to_target


def run_grid(config: str, lags: list[int], seeds: int, extra: list[str], folder: Path) -> list[dict]:
    """Every (max_lag, seed) run of one config: its identity and its metric history."""
    runs = []
    for lag in lags:
        for seed in range(seeds):
            run_dir = folder / f"{Path(config).stem}-k{lag}-s{seed}"
            overrides = [f"staleness.max_lag={lag}", f"learner.seed={seed}", f"actor.seed={seed}", *extra]
            tidal_run([config], overrides, run_dir, "bench/async")
            runs.append({"task": Path(config).stem, "max_lag": lag, "seed": seed, "history": history(run_dir)})
    return runs


def bootstrap_ratio(base: list[float], other: list[float], rng: np.random.Generator, n: int = 2000) -> list:
    """90% interval of median(base) / median(other), resampling the seeds of each side."""
    if not base or not other:
        return [None, None]
    ratios = [np.median(rng.choice(base, len(base))) / np.median(rng.choice(other, len(other))) for _ in range(n)]
    return [round(float(q), 3) for q in np.quantile(ratios, [0.05, 0.95])]


def summarize(runs: list[dict], target: float, rng: np.random.Generator) -> list[dict]:
    """Per max_lag: median time to target, its ratio to max_lag 0's with an interval, final pass rates."""
    by_lag: dict[int, list[dict]] = {}
    for run in runs:
        by_lag.setdefault(run["max_lag"], []).append(run)
    base = by_lag.get(0, [])
    base_times = [r["time_to_target_s"] for r in base if r["time_to_target_s"] is not None]
    base_final = statistics.median(r["final_pass_rate"] for r in base) if base else None
    lines = []
    for lag, group in sorted(by_lag.items()):
        times = [r["time_to_target_s"] for r in group if r["time_to_target_s"] is not None]
        final = statistics.median(r["final_pass_rate"] for r in group)
        line = {"task": group[0]["task"], "max_lag": lag, "target": round(target, 4), "runs": len(group),
                "reached": len(times), "median_time_to_target_s": statistics.median(times) if times else None,
                "median_final_pass_rate": round(final, 4)}
        if base_times and times:
            line["speedup_vs_k0"] = round(statistics.median(base_times) / statistics.median(times), 3)
            line["speedup_vs_k0_90ci"] = bootstrap_ratio(base_times, times, rng)
        if base_final is not None:
            line["final_minus_k0"] = round(final - base_final, 4)
        lines.append(line)
    return lines


def plot(runs: list[dict], target: float, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lags = sorted({r["max_lag"] for r in runs})
    colors = dict(zip(lags, plt.cm.viridis(np.linspace(0, 0.9, len(lags)))))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        hist = r["history"]
        start = hist["compute/wall_s"].get(0, 0.0)
        steps = sorted(s for s in hist["eval/pass_rate"] if s in hist["compute/wall_s"])
        label = f"max_lag {r['max_lag']}" if r["seed"] == 0 else None
        ax.plot([hist["compute/wall_s"][s] - start for s in steps], [hist["eval/pass_rate"][s] for s in steps],
                color=colors[r["max_lag"]], alpha=0.8, label=label)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.2f}")
    ax.set(xlabel="wall time since the step-0 evaluation (s)", ylabel="val pass rate", title=runs[0]["task"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", help="preset or YAML file (repeatable; default tiny and long)")
    parser.add_argument("--max-lag", default="0,1,2,4,8")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--margin", type=float, default=0.05, help="target = median k=0 final pass rate - margin")
    parser.add_argument("--target", type=float, help="a fixed target pass rate instead")
    parser.add_argument("--out", help="keep runs and plots here (default: a temporary folder; plots to .)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args()
    lags = [int(k) for k in args.max_lag.split(",")]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.out or tmp)
        for config in args.config or ["tiny", "long"]:
            runs = run_grid(config, lags, args.seeds, args.overrides, folder)
            base = [time_to_target(r["history"], 1.0)["final_pass_rate"] for r in runs if r["max_lag"] == 0]
            target = args.target if args.target is not None else (
                statistics.median(base) - args.margin if base else 0.6)
            for r in runs:
                r.update(time_to_target(r["history"], target))
                print(json.dumps({k: r[k] for k in ("task", "max_lag", "seed", "wall_s", "steps", "samples",
                                                     "time_to_target_s", "final_pass_rate")}), flush=True)
            for line in summarize(runs, target, rng):
                print(json.dumps({"summary": True, **line}), flush=True)
            png = (Path(args.out) if args.out else Path(".")) / f"async-{runs[0]['task']}.png"
            plot(runs, target, png)
            print(json.dumps({"plot": str(png)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
