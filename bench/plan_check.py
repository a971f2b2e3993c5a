"""Is `tidal plan-batch`'s pick the fastest when run? Measures generation throughput per batch
size on the real engine, runs the config at the reference batches (samples-to-target and learner
time per sample, as `tidal plan-batch --runs` reads them), lets the planner predict every batch's
time-to-target and pick one, then runs every other batch (learning rate scaled by the square root
of the ratio to the config's batch, warmup kept to the same samples, one sample budget) and measures.

    python bench/plan_check.py tiny --batch-sizes 4,8,16,32 --references 8,16 --target 0.7

Prints one JSON line per batch size (predicted and measured time-to-target, samples-to-target)
and a summary line (the planner's pick, the measured fastest). Time-to-target is counted from
the end of the step-0 evaluation (so engine start-up is left out) to the evaluation that first
reached the target; it includes the learner's steps and the evaluations on the way.
"""
import argparse
import asyncio
import json
import math
import sys
import tempfile
from pathlib import Path

from runs import history, mlflow_run, tidal_run, time_to_target
from tidal.config import ConfigError, LearnerConfig, load_config, resolve
from tidal.learner.warmstart import build_tiny
from tidal.models import resolve_model_path
from tidal.plan_batch import measure, plan, run_evidence


def run_at(config: list[str], batch: int, learner: LearnerConfig, budget_groups: int, evals: int,
           run_dir: Path) -> Path:
    """One run at `batch` groups per step, `budget_groups` in all: lr scaled from the config's batch by the
    square root of the ratio, the warmup kept to the same number of samples."""
    base_batch, optim = learner.groups_per_step, learner.optim
    steps = max(budget_groups // batch, 1)
    lr = optim.lr * math.sqrt(batch / base_batch)
    warmup = round(optim.warmup_steps * base_batch / batch)
    overrides = [f"learner.groups_per_step={batch}", f"learner.optim.lr={lr:.6g}", f"learner.max_steps={steps}",
                 f"learner.optim.warmup_steps={warmup}", f"eval.every={max(steps // evals, 1)}"]
    return tidal_run([c for c in config if "=" not in c], [c for c in config if "=" in c] + overrides, run_dir,
                     f"plan_check (B={batch})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="+", help="presets, YAML files and key=value overrides")
    parser.add_argument("--batch-sizes", default="4,8,16,32")
    parser.add_argument("--references", default="8,16",
                        help="batches whose runs the planner reads (samples-to-target, learner time)")
    parser.add_argument("--target", type=float, default=0.7)
    parser.add_argument("--budget-groups", type=int, default=960, help="prompt groups each run may use")
    parser.add_argument("--evals", type=int, default=12, help="evaluations per run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", help="keep the runs in this folder (default: a temporary one)")
    args = parser.parse_args()
    references = [int(b) for b in args.references.split(",")]
    batches = sorted({int(b) for b in args.batch_sizes.split(",")} | set(references))
    try:
        cfg = load_config([c for c in args.config if "=" not in c], [c for c in args.config if "=" in c])
        cfg = resolve(cfg, model_path=resolve_model_path(cfg.model, cfg.task, build_tiny))
    except ConfigError as err:
        print(f"plan_check: {err}", file=sys.stderr)
        return 2
    throughput = asyncio.run(measure(cfg, batches, args.reps))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.out or tmp)
        measured, evidence = {}, {}
        for batch in [*references, *[b for b in batches if b not in references]]:
            run_dir = run_at(args.config, batch, cfg.learner, args.budget_groups, args.evals, folder / f"b{batch}")
            uri, run_id = mlflow_run(run_dir)
            evidence[batch], = run_evidence(uri, [run_id], args.target)  # what `tidal plan-batch --runs` reads
            measured[batch] = {**time_to_target(history(run_dir), args.target),
                               "learner_s_per_sample": evidence[batch].learner_s_per_sample}
    rows, note = plan(throughput, [evidence[b] for b in references], overlap=cfg.staleness.max_lag > 0)
    predicted = {row.batch_groups: row.time_to_target_s for row in rows}
    pick = min(predicted, key=predicted.get)
    for t in throughput:
        print(json.dumps({"batch": t.batch_groups, "reference": t.batch_groups in references,
                          "gen_samples_per_s": round(t.samples_per_s, 1),
                          "predicted_time_to_target_s": round(predicted[t.batch_groups], 1),
                          **measured[t.batch_groups]}))
    reached = {b: m["time_to_target_s"] for b, m in measured.items() if m["time_to_target_s"] is not None}
    fastest = min(reached, key=reached.get) if reached else None
    print(json.dumps({"target": args.target, "planner_pick": pick, "measured_fastest": fastest,
                      "pick_was_fastest": pick == fastest, "planner_note": note}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
