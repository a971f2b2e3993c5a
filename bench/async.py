"""Does asynchrony pay? Time to a target pass rate against the staleness bound, side by side in one run.

Runs tidal at every staleness.max_lag and seed (learner and actor each on a core of their own, as the
launcher pins them), on each config, and prints one JSON line per run:

    task, system, max_lag, seed, wall_s, steps, samples, time_to_target_s, final_pass_rate

then one summary line per max_lag: the median time to target, its ratio to max_lag 0's (how many
times sooner; above 1 is faster) with a bootstrap 90% interval over seeds, and the median final pass
rate's difference from max_lag 0's. With --trl, TRL's GRPOTrainer runs the same seeds in process
(bench/trl_anchor.py; `pip install -e ".[bench]"`) and every line also gets its ratio to TRL's.
The target is the max_lag-0 runs' median final pass rate minus --margin (or --target). Times count
from the end of the step-0 evaluation (start-up left out) to the moment the weights that first reached
the target existed (tidal's evaluations run beside training, TRL's block it: each is charged for the
evaluations before, neither for the one that measured). A PNG per config draws the pass rate
against wall time for every run, coloured by max_lag.

    python bench/async.py                                         # demo and long task, k 0,1,2,4,8, 3 seeds
    python bench/async.py --config configs/long.yaml --max-lag 0,4 --seeds 2
    python bench/async.py --config tiny --max-lag 0,2 --trl                # with the in-process anchor
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from runs import history, tidal_run, time_to_target


def run_grid(config: str, lags: list[int], seeds: int, extra: list[str], folder: Path, trl: bool) -> list[dict]:
    """Every (max_lag, seed) run of one config, and TRL's per seed when asked: identity and metric history."""
    runs = []
    for lag in lags:
        for seed in range(seeds):
            run_dir = folder / f"{Path(config).stem}-k{lag}-s{seed}"
            overrides = [f"staleness.max_lag={lag}", f"learner.seed={seed}", f"actor.seed={seed}", *extra]
            tidal_run([config], overrides, run_dir, "bench/async")
            runs.append({"task": Path(config).stem, "system": "tidal", "max_lag": lag, "seed": seed,
                         "history": history(run_dir)})
    for seed in range(seeds if trl else 0):
        runs.append({"task": Path(config).stem, "system": "trl", "max_lag": None, "seed": seed,
                     "history": trl_run(config, seed, extra)})
    return runs


def trl_run(config: str, seed: int, extra: list[str]) -> dict[str, dict[int, float]]:
    """bench/trl_anchor.py in a process of its own (TRL's imports and threads stay out of this one)."""
    cmd = [sys.executable, str(Path(__file__).with_name("trl_anchor.py")), config, f"--seed={seed}", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench/async: the TRL run failed:\n{(done.stdout + done.stderr)[-3000:]}")
    hist = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: {int(step): value for step, value in values.items()} for name, values in hist.items()}


def bootstrap_ratio(base: list[float], other: list[float], rng: np.random.Generator, n: int = 2000) -> list:
    """90% interval of median(base) / median(other), resampling the seeds of each side."""
    if not base or not other:
        return [None, None]
    ratios = [np.median(rng.choice(base, len(base))) / np.median(rng.choice(other, len(other))) for _ in range(n)]
    return [round(float(q), 3) for q in np.quantile(ratios, [0.05, 0.95])]


def summarize(runs: list[dict], target: float, rng: np.random.Generator) -> list[dict]:
    """Per max_lag (and TRL): median time to target, its ratio to max_lag 0's and to TRL's with
    intervals, final pass rates."""
    by_lag: dict[int | None, list[dict]] = {}
    for run in runs:
        by_lag.setdefault(run["max_lag"], []).append(run)

    def times(group: list[dict]) -> list[float]:
        return [r["time_to_target_s"] for r in group if r["time_to_target_s"] is not None]

    base, trl = by_lag.get(0, []), by_lag.get(None, [])
    base_final = statistics.median(r["final_pass_rate"] for r in base) if base else None
    lines = []
    for lag, group in sorted(by_lag.items(), key=lambda item: -1 if item[0] is None else item[0]):
        final = statistics.median(r["final_pass_rate"] for r in group)
        line = {"task": group[0]["task"], "system": group[0]["system"], "max_lag": lag, "target": round(target, 4),
                "runs": len(group), "reached": len(times(group)),
                "median_time_to_target_s": statistics.median(times(group)) if times(group) else None,
                "median_final_pass_rate": round(final, 4)}
        for name, reference in (("k0", base), ("trl", trl)):
            if times(reference) and times(group):
                ratio = statistics.median(times(reference)) / statistics.median(times(group))
                line[f"speedup_vs_{name}"] = round(ratio, 3)
                line[f"speedup_vs_{name}_90ci"] = bootstrap_ratio(times(reference), times(group), rng)
        if base_final is not None:
            line["final_minus_k0"] = round(final - base_final, 4)
        lines.append(line)
    return lines


def plot(runs: list[dict], target: float, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lags = sorted({r["max_lag"] for r in runs if r["max_lag"] is not None})
    colors = dict(zip(lags, plt.cm.viridis(np.linspace(0, 0.9, len(lags))))) | {None: "tab:red"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        hist = r["history"]
        start = hist["compute/wall_s"].get(0, 0.0)
        steps = sorted(s for s in hist["eval/pass_rate"] if s in hist["compute/wall_s"])
        label = (f"max_lag {r['max_lag']}" if r["system"] == "tidal" else "TRL GRPOTrainer") if r["seed"] == 0 else None
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
    parser.add_argument("--trl", action="store_true", help="also TRL's GRPOTrainer per seed (the in-process anchor)")
    parser.add_argument("--out", help="keep runs and plots here (default: a temporary folder; plots to .)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args()
    lags = [int(k) for k in args.max_lag.split(",")]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.out or tmp)
        for config in args.config or ["tiny", "long"]:
            runs = run_grid(config, lags, args.seeds, args.overrides, folder, args.trl)
            base = [time_to_target(r["history"], 1.0)["final_pass_rate"] for r in runs if r["max_lag"] == 0]
            target = args.target if args.target is not None else (
                statistics.median(base) - args.margin if base else 0.6)
            for r in runs:
                r.update(time_to_target(r["history"], target))
                print(json.dumps({k: r[k] for k in ("task", "system", "max_lag", "seed", "wall_s", "steps", "samples",
                                                     "time_to_target_s", "final_pass_rate")}), flush=True)
            for line in summarize(runs, target, rng):
                print(json.dumps({"summary": True, **line}), flush=True)
            png = (Path(args.out) if args.out else Path(".")) / f"async-{runs[0]['task']}.png"
            plot(runs, target, png)
            print(json.dumps({"plot": str(png)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
