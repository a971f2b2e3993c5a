"""Does asynchrony pay? Time to a target pass rate against the staleness bound, side by side in one run.

Runs tidal at every staleness.max_lag and seed (the learner on a core of its own, the engine threads of
the actor on another, as the launcher places them), on each config, and prints one JSON line per run:

    task, system, max_lag, seed, wall_s, steps, samples, time_to_target_s, final_pass_rate
    (and time_to_<rate>_s for each fixed pass rate of --also, 0.6 by default)

then one summary line per max_lag: the median time to target, its ratio to max_lag 0's (how many
times sooner; above 1 is faster) with a bootstrap 90% interval over seeds, the same for each --also
rate, and the median final pass rate's difference from max_lag 0's. With --trl, TRL's GRPOTrainer
runs the same seeds in process (bench/trl_anchor.py; `pip install -e ".[bench]"`; its histories are
kept beside tidal's runs) and every line also gets its ratio to TRL's.
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

from runs import bootstrap_ratio, finish_pass_rate_figure, history, tidal_run, time_to_target


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
        hist = trl_run(config, seed, extra)
        (folder / f"{Path(config).stem}-trl-s{seed}.json").write_text(json.dumps(hist))  # tidal's are in run dirs
        runs.append({"task": Path(config).stem, "system": "trl", "max_lag": None, "seed": seed, "history": hist})
    return runs


def trl_run(config: str, seed: int, extra: list[str]) -> dict[str, dict[int, float]]:
    """bench/trl_anchor.py in a process of its own (TRL's imports and threads stay out of this one)."""
    cmd = [sys.executable, str(Path(__file__).with_name("trl_anchor.py")), config, f"--seed={seed}", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench/async: the TRL run failed:\n{(done.stdout + done.stderr)[-3000:]}")
    hist = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: {int(step): value for step, value in values.items()} for name, values in hist.items()}


def summarize(runs: list[dict], target: float, also: list[float], rng: np.random.Generator) -> list[dict]:
    """Per max_lag (and TRL): median time to target, its ratio to max_lag 0's and to TRL's with
    intervals, the same for each fixed rate of `also`, final pass rates."""
    by_lag: dict[int | None, list[dict]] = {}
    for run in runs:
        by_lag.setdefault(run["max_lag"], []).append(run)
    base, trl = by_lag.get(0, []), by_lag.get(None, [])
    base_final = statistics.median(r["final_pass_rate"] for r in base) if base else None
    lines = []
    for lag, group in sorted(by_lag.items(), key=lambda item: -1 if item[0] is None else item[0]):
        final = statistics.median(r["final_pass_rate"] for r in group)
        line = {"task": group[0]["task"], "system": group[0]["system"], "max_lag": lag, "target": round(target, 4),
                "runs": len(group), "reached": len(_times(group, "time_to_target_s"))}
        for key, label in [("time_to_target_s", ""), *((f"time_to_{rate}_s", f"_at_{rate}") for rate in also)]:
            line |= _time_summary(key, label, group, base, trl, rng)
        line["median_final_pass_rate"] = round(final, 4)
        if base_final is not None:
            line["final_minus_k0"] = round(final - base_final, 4)
        lines.append(line)
    return lines


def _times(group: list[dict], key: str) -> list[float]:
    return [r[key] for r in group if r[key] is not None]


def _time_summary(key: str, label: str, group: list[dict], base: list[dict], trl: list[dict],
                  rng: np.random.Generator) -> dict:
    """The group's median of `key` and how many times sooner than max_lag 0 and TRL it is, with
    intervals, under speedup_vs_<k0|trl><label>."""
    times = _times(group, key)
    line = {f"median_{key}": statistics.median(times) if times else None}
    for name, reference in (("k0", base), ("trl", trl)):
        if _times(reference, key) and times:
            ratio = statistics.median(_times(reference, key)) / statistics.median(times)
            line[f"speedup_vs_{name}{label}"] = round(ratio, 3)
            line[f"speedup_vs_{name}{label}_90ci"] = bootstrap_ratio(_times(reference, key), times, rng)
    return line


def plot(runs: list[dict], target: float, png: Path) -> None:
    from matplotlib import colormaps

    from tidal.scaling import figure

    lags = sorted({r["max_lag"] for r in runs if r["max_lag"] is not None})
    colors = dict(zip(lags, colormaps["viridis"](np.linspace(0, 0.9, len(lags))))) | {None: "tab:red"}
    seeds = {lag: sum(r["max_lag"] == lag for r in runs) for lag in [*lags, None]}  # runs per colour
    last_step = 0
    fig, ax = figure()
    for r in runs:
        hist = r["history"]
        start = hist["compute/wall_s"].get(0, 0.0)
        steps = sorted(s for s in hist["eval/pass_rate"] if s in hist["compute/wall_s"])
        last_step = max([last_step, *steps])
        # one legend entry per max_lag (its seeds share a colour), saying how many runs it stands for
        name = f"max_lag {r['max_lag']}" if r["system"] == "tidal" else "TRL GRPOTrainer"
        count = seeds[r["max_lag"]]
        label = f"{name} ({count} seed{'s' if count > 1 else ''})" if r["seed"] == 0 else None
        ax.plot([hist["compute/wall_s"][s] - start for s in steps], [hist["eval/pass_rate"][s] for s in steps],
                color=colors[r["max_lag"]], alpha=0.8, label=label)
    finish_pass_rate_figure(fig, ax, target, f"{runs[0]['task']}: pass rate against wall time, steps 0-{last_step}",
                            png)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", help="preset or YAML file (repeatable; default tiny and long)")
    parser.add_argument("--max-lag", default="0,1,2,4,8")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--margin", type=float, default=0.05, help="target = median k=0 final pass rate - margin")
    parser.add_argument("--target", type=float, help="a fixed target pass rate instead")
    parser.add_argument("--also", default="0.6", help="fixed pass rates also timed, comma-separated (empty: none)")
    parser.add_argument("--eval-every", type=int, default=10,
                        help="evaluate every this many steps (the resolution of times to a pass rate), tidal and TRL")
    parser.add_argument("--trl", action="store_true", help="also TRL's GRPOTrainer per seed (the in-process anchor)")
    parser.add_argument("--out", help="keep runs and plots here (default: a temporary folder; plots to .)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args()
    lags = [int(k) for k in args.max_lag.split(",")]
    also = [float(rate) for rate in args.also.split(",") if rate]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.out or tmp)
        for config in args.config or ["tiny", "long"]:
            overrides = [f"eval.every={args.eval_every}", *args.overrides]
            runs = run_grid(config, lags, args.seeds, overrides, folder, args.trl)
            base = [time_to_target(r["history"], 1.0)["final_pass_rate"] for r in runs if r["max_lag"] == 0]
            target = args.target if args.target is not None else (
                statistics.median(base) - args.margin if base else 0.6)
            fixed = [f"time_to_{rate}_s" for rate in also]
            for r in runs:
                r.update(time_to_target(r["history"], target))
                r.update({key: time_to_target(r["history"], rate)["time_to_target_s"]
                          for key, rate in zip(fixed, also)})
                print(json.dumps({k: r[k] for k in ("task", "system", "max_lag", "seed", "wall_s", "steps", "samples",
                                                     "time_to_target_s", *fixed, "final_pass_rate")}), flush=True)
            for line in summarize(runs, target, also, rng):
                print(json.dumps({"summary": True, **line}), flush=True)
            png = (Path(args.out) if args.out else Path(".")) / f"async-{runs[0]['task']}.png"
            plot(runs, target, png)
            print(json.dumps({"plot": str(png)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
