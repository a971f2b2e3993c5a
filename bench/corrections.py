"""Off-policy corrections where lag and mismatch are large: each correction at each staleness bound, with and
without an actor that serves other numbers than the learner trains, side by side in one run.

Mismatch, on a CPU that has no bf16 kernels: the actors serve every version's weights rounded to bf16 (and
compute in fp32), while the learner scores its fp32 weights (TIDAL_BENCH_ROUND_WEIGHTS, a benchmark knob and
never a user setting; it needs plain linear layers, so every run here has actor.vllm.cpu_linear=plain). The
zero-variance filter is off, so runs are short. Each run's versions are evaluated afterwards off the training
path (bench/runs.py's HeldOut), as bench/async.py does.

Prints one JSON line per run (max_lag, mismatch, correction, seed, final pass rate, its start, time to the
target, collapsed) and one summary line per cell: the median final pass rate with its range, the median time to
the target and its ratio to the reference cell's (max_lag 2, no mismatch, cispo) with a 90% bootstrap interval
over seeds, and how many seeds collapsed (their final pass rate below their own start). The target is the
reference cell's median final pass rate less --margin.

    python bench/corrections.py --out runs/bench-corrections    # long task, k 2,8,16, both ways, 4 corrections, 3 seeds
    python bench/corrections.py --max-lag 8 --mismatch on --seeds 3 --out runs/bench-corrections
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from runs import bootstrap_ratio, time_to_target, timed_tidal_run

# name -> the overrides that choose it; every one keeps cispo's token-level cap (learner.loss.eps_max)
CORRECTIONS = {
    "cispo": [],  # the presets' loss until now: each token's ratio capped at eps_max
    "geo_mask": ["learner.loss.sequence_mask=[0.9,1.1]"],  # a sample left out when its geometric mean strays
    "icepop": ["learner.loss.token_mask=[0.5,2.0]"],  # a token left out when its ratio leaves [0.5, 2]
    "seq_tis": ["learner.loss.ratio_level=sequence"],  # the sample's ratio (product), capped at eps_max
}
MISMATCH_ENV = {"TIDAL_BENCH_ROUND_WEIGHTS": "bfloat16"}
REFERENCE = (2, False, "cispo")  # the cell whose time the others are held to
PROFILE = (
    "offpolicy/rho_mean",
    "offpolicy/fresh_ratio",
    "offpolicy/token_masked_frac",
    "offpolicy/sequence_masked_frac",
    "offpolicy/clipped_frac",
    "timing/train_step_s",
)


def run_cell(
    config: str, lag: int, mismatch: bool, correction: str, seed: int, every: int, extra: list[str], folder: Path
) -> dict:
    """One run, kept in FOLDER/<name>.json as it ends; a run whose file is there is read back, not run again."""
    name = f"{Path(config).stem}-k{lag}-{'mismatch' if mismatch else 'exact'}-{correction}-s{seed}"
    kept = folder / f"{name}.json"
    if kept.exists():
        run = json.loads(kept.read_text())
    else:
        overrides = [
            f"staleness.max_lag={lag}",
            "learner.zero_variance_filter=false",
            "actor.vllm.cpu_linear=plain",
            f"learner.seed={seed}",
            f"actor.seed={seed}",
            *CORRECTIONS[correction],
            *extra,
        ]
        run = timed_tidal_run(config, folder / name, every, overrides, PROFILE, MISMATCH_ENV if mismatch else None)
        kept.write_text(json.dumps(run))
    run["history"] = {
        metric: {int(step): value for step, value in values.items()} for metric, values in run["history"].items()
    }
    return {"max_lag": lag, "mismatch": mismatch, "correction": correction, "seed": seed, **run}


def judge(run: dict, target: float) -> dict:
    """The run's line: its pass rate at the start and the end, time to the target, and whether it collapsed."""
    evals = run["history"]["eval/pass_rate"]
    line = {k: run[k] for k in ("max_lag", "mismatch", "correction", "seed")} | time_to_target(run["history"], target)
    line["start_pass_rate"] = round(evals[min(evals)], 4)
    line["collapsed"] = line["final_pass_rate"] < line["start_pass_rate"]
    line["profile"] = {k: round(v, 4) for k, v in run["profile"].items()}
    return line


def summarize(lines: list[dict], target: float, rng: np.random.Generator) -> list[dict]:
    """One line per (max_lag, mismatch, correction) cell."""
    cells: dict[tuple, list[dict]] = {}
    for line in lines:
        cells.setdefault((line["max_lag"], line["mismatch"], line["correction"]), []).append(line)
    reference = [r["time_to_target_s"] for r in cells.get(REFERENCE, []) if r["time_to_target_s"] is not None]
    out = []
    for (lag, mismatch, correction), group in sorted(cells.items()):
        finals = [r["final_pass_rate"] for r in group]
        times = [r["time_to_target_s"] for r in group if r["time_to_target_s"] is not None]
        summary = {
            "summary": True,
            "max_lag": lag,
            "mismatch": mismatch,
            "correction": correction,
            "seeds": len(group),
            "target": round(target, 4),
            "median_final_pass_rate": round(statistics.median(finals), 4),
            "final_range": [min(finals), max(finals)],
            "reached": len(times),
            "collapsed": sum(r["collapsed"] for r in group),
            "median_time_to_target_s": round(statistics.median(times), 2) if times else None,
        }
        if times and reference:  # above 1: slower than the reference cell
            summary["time_over_reference"] = round(statistics.median(times) / statistics.median(reference), 3)
            summary["time_over_reference_90ci"] = bootstrap_ratio(times, reference, rng)
        for key in PROFILE:
            name = key.split("/")[1]
            values = [r["profile"][name] for r in group if name in r["profile"]]
            if values:
                summary[f"median_{name}"] = round(statistics.median(values), 4)
        out.append(summary)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="long", help="preset or YAML file")
    parser.add_argument("--max-lag", default="2,8,16")
    parser.add_argument("--mismatch", default="off,on", help="off, on or off,on: actors serve bf16-rounded weights")
    parser.add_argument("--corrections", default=",".join(CORRECTIONS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--margin", type=float, default=0.05, help="target = the reference cell's median final pass rate - margin"
    )
    parser.add_argument("--target", type=float, help="a fixed target pass rate instead")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", required=True, help="keep every run here; a run kept there is not run again")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args()
    lags = [int(k) for k in args.max_lag.split(",")]
    mismatches = [{"off": False, "on": True}[m] for m in args.mismatch.split(",")]
    corrections = args.corrections.split(",")
    unknown = set(corrections) - set(CORRECTIONS)
    if unknown:
        raise SystemExit(f"bench/corrections: --corrections {sorted(unknown)}: expected some of {list(CORRECTIONS)}")
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    # the reference cell first: every other cell's time is held to it
    cells = [REFERENCE] + [c for c in itertools.product(lags, mismatches, corrections) if c != REFERENCE]
    runs = [
        run_cell(args.config, lag, mismatch, correction, seed, args.eval_every, args.overrides, folder)
        for lag, mismatch, correction in cells
        for seed in range(args.seeds)
    ]
    reference = [
        time_to_target(r["history"], 1.0)["final_pass_rate"]
        for r in runs
        if (r["max_lag"], r["mismatch"], r["correction"]) == REFERENCE
    ]
    target = args.target if args.target is not None else statistics.median(reference) - args.margin
    lines = [judge(r, target) for r in runs]
    for line in lines:
        print(json.dumps(line), flush=True)
    for line in summarize(lines, target, np.random.default_rng(0)):
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
