"""What a weight update should do to the requests running (`actor.on_update`): recompute their keys and
values under the new weights, or keep them, side by side over whole runs; one JSON line per run, then
one per task with the medians and keep's ratios to recompute.

Per task (the agent demo, whose episodes run many turns; the long task with `sampling.max_tokens`
raised to what its model's context holds, its zero-variance filter off) and seed, one run under each
choice, taking turns: generated tokens per second over the run (every actor's), time to a target pass
rate (the recompute runs' median final pass rate less --margin) and the final pass rate, from each
run's own evaluations.

    python bench/on_update.py                              # both tasks, 3 seeds: about 50 minutes on 2 cores
    python bench/on_update.py --configs long --seeds 2 --override learner.max_steps=60
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from runs import bootstrap_ratio, history, tidal_run, time_to_target

CHOICES = ("recompute", "keep")
# the long task's answers are up to 95 characters; its model's context (128) holds an 8-character prompt,
# <eos> and 119 sampled tokens: room for the model to overshoot further, and longer requests in flight.
# Its zero-variance filter off (bench/async.py's no-filter variant): with it the preset samples ~15 groups
# for each one it trains on, 6.6 s a step, and six runs would take two hours
RAISED = {"long": ["sampling.max_tokens=119", "learner.zero_variance_filter=false"]}
METRICS = ("eval/pass_rate", "compute/wall_s", "compute/samples", "compute/gen_tokens")


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def one_run(config: str, choice: str, seed: int, folder: Path, extra: list[str]) -> dict:
    run_dir = folder / f"{config}-{choice}-s{seed}"
    if not (run_dir / "summary.json").exists():  # a run kept in --out is read again
        overrides = [f"actor.on_update={choice}", f"learner.seed={seed}", f"actor.seed={seed}", *extra]
        tidal_run([config], overrides, run_dir, "bench/on_update")
    hist = history(run_dir, METRICS)
    last = max(hist["compute/wall_s"])
    start = hist["compute/wall_s"].get(0, 0.0)
    return {
        "task": config,
        "on_update": choice,
        "seed": seed,
        "history": hist,
        "gen_tokens_per_s": round(hist["compute/gen_tokens"][last] / (hist["compute/wall_s"][last] - start), 1),
    }


def summarize(runs: list[dict], task: str, target: float, rng) -> dict:
    by = {c: [r for r in runs if r["on_update"] == c] for c in CHOICES}
    times = {c: [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None] for c, rs in by.items()}
    line = {"bench": "on_update", "task": task, "target": round(target, 4), "seeds": len(by["keep"])}
    for choice, rs in by.items():
        line[f"{choice}_gen_tokens_per_s"] = statistics.median(r["gen_tokens_per_s"] for r in rs)
        line[f"{choice}_final_pass_rate"] = round(statistics.median(r["final_pass_rate"] for r in rs), 4)
        line[f"{choice}_reached"] = len(times[choice])
        line[f"{choice}_time_to_target_s"] = statistics.median(times[choice]) if times[choice] else None
    line["keep_over_recompute_gen_tokens_per_s"] = round(
        line["keep_gen_tokens_per_s"] / line["recompute_gen_tokens_per_s"], 3
    )
    if times["keep"] and times["recompute"]:
        line["keep_over_recompute_time_to_target"] = round(
            statistics.median(times["keep"]) / statistics.median(times["recompute"]), 3
        )
        line["keep_over_recompute_time_to_target_90ci"] = bootstrap_ratio(times["keep"], times["recompute"], rng)
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="agent,long")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--margin", type=float, default=0.05, help="target = median recompute final pass rate - margin")
    parser.add_argument("--override", action="append", default=[], help="key=value for every run (repeatable)")
    parser.add_argument("--out", help="keep runs here (default: a temporary folder); runs found there are read again")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    folder = Path(args.out or tempfile.mkdtemp(prefix="tidal-bench-on-update-"))
    for config in args.configs.split(","):
        extra = [*RAISED.get(config, []), *args.override]
        runs = [
            one_run(config, choice, seed, folder, extra)
            for seed in range(args.seeds)
            for choice in (CHOICES if seed % 2 == 0 else CHOICES[::-1])  # which goes first alternates
        ]
        finals = [r["history"]["eval/pass_rate"][max(r["history"]["eval/pass_rate"])] for r in runs]
        target = statistics.median(f for f, r in zip(finals, runs) if r["on_update"] == "recompute") - args.margin
        for run in runs:
            run.update(time_to_target(run["history"], target))
            emit({k: v for k, v in run.items() if k != "history"} | {"target": round(target, 4)})
        emit(summarize(runs, config, target, rng))
    print(f"runs in {folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
