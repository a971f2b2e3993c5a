"""What an evaluation made by one version costs the training: the same run with evaluations that hold
newer versions back while they are under way (tidal's behaviour), with evaluations that let weights land
mid-evaluation (TIDAL_BENCH_EVAL_HOLD=0, a benchmark knob: the behaviour before), and with no evaluation
but at the start and the end; side by side in one run, alternating, as ratios of training throughput.

Prints one JSON line per run and a summary: steps per second of training (the wall time from the end of
the step-0 evaluation to the last step, over the steps), its ratio to the unheld runs', the seconds held,
and the evaluation samples made by a version other than the one they were logged at.

    python bench/eval_hold.py --repeats 2                       # tiny demo, max_lag 2, every 10 steps
    python bench/eval_hold.py --max-lag 0 --every 5 --steps 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from runs import history, tidal_run

WAYS = {"held": {}, "unheld": {"TIDAL_BENCH_EVAL_HOLD": "0"}, "none": {}}


def one(way: str, args, folder: Path, i: int) -> dict:
    run_dir = folder / f"{way}-{i}"
    every = 0 if way == "none" else args.every
    overrides = [
        f"staleness.max_lag={args.max_lag}",
        f"learner.max_steps={args.steps}",
        f"eval.every={every}",
        f"learner.seed={i}",
        f"actor.seed={i}",
    ]
    tidal_run([args.config], overrides, run_dir, way, WAYS[way])
    wall = history(run_dir, ("compute/wall_s",))["compute/wall_s"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = next(m for m in reversed(metrics) if "learner/loss" in m)
    train_s = wall[args.steps] - wall[min(wall)]  # from the first step's end: the step-0 evaluation is common
    return {
        "way": way,
        "repeat": i,
        "steps_per_s": round((args.steps - min(wall)) / train_s, 4),
        "held_s": round(last["eval/hold_s_total"], 2),
        "off_version_eval_samples": int(last["eval/off_version_samples_total"]),
        "multi_version_eval_samples": int(last["eval/multi_version_samples_total"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny")
    p.add_argument("--max-lag", type=int, default=2)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="", help="keep the runs here (default: a temporary folder)")
    args = p.parse_args()
    folder = Path(args.out or tempfile.mkdtemp(prefix="tidal-eval-hold-"))
    lines = []
    for i in range(args.repeats):
        for way in WAYS:  # alternating: the machine's drift falls on every way alike
            lines.append(one(way, args, folder, i))
            print(json.dumps(lines[-1]), flush=True)
    rate = {w: statistics.median(r["steps_per_s"] for r in lines if r["way"] == w) for w in WAYS}
    print(
        json.dumps(
            {
                "summary": {
                    "max_lag": args.max_lag,
                    "every": args.every,
                    "steps": args.steps,
                    "steps_per_s": rate,
                    "held_over_unheld": round(rate["held"] / rate["unheld"], 3),
                    "held_over_none": round(rate["held"] / rate["none"], 3),
                    "unheld_over_none": round(rate["unheld"] / rate["none"], 3),
                    "off_version_eval_samples": {
                        w: sum(r["off_version_eval_samples"] for r in lines if r["way"] == w) for w in WAYS
                    },
                }
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
