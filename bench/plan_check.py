"""Is `tidal plan-batch`'s pick the fastest when run? Measures generation throughput per batch
size on the real engine, runs the config at the reference batches (samples-to-target and learner
time per sample, as `tidal plan-batch --runs` reads them), lets the planner predict every batch's
time-to-target and pick one, then runs every other batch (learning rate scaled by the square root
of the ratio to the config's batch, the same sample budget) and measures.

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
import subprocess
import sys
import tempfile
from pathlib import Path

from tidal.config import ConfigError, load_config, resolve
from tidal.learner.warmstart import build_tiny
from tidal.models import resolve_model_path
from tidal.plan_batch import RunEvidence, measure, plan


def run_at(config: list[str], batch: int, base_batch: int, budget_groups: int, evals: int, run_dir: Path,
           base_lr: float) -> Path:
    """One run at `batch` groups per step, lr scaled from the config's batch, `budget_groups` in all."""
    steps = max(budget_groups // batch, 1)
    lr = base_lr * math.sqrt(batch / base_batch)
    cmd = [sys.executable, "-m", "tidal", "run", *config, f"run_dir={run_dir}", f"learner.groups_per_step={batch}",
           f"learner.optim.lr={lr:.6g}", f"learner.max_steps={steps}", f"eval.every={max(steps // evals, 1)}",
           "checkpoint.every=0"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"plan_check: the run at B={batch} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return run_dir


def time_to_target(run_dir: Path, target: float) -> dict:
    """Samples and seconds (from the end of the step-0 evaluation) until eval/pass_rate >= target."""
    from mlflow.tracking import MlflowClient

    summary = json.loads((run_dir / "summary.json").read_text())
    client = MlflowClient(summary["mlflow_uri"])
    run = summary["mlflow_run_id"]
    history = {name: {m.step: m.value for m in client.get_metric_history(run, name)}
               for name in ("eval/pass_rate", "compute/wall_s", "compute/samples", "timing/train_step_s",
                            "learner/num_samples")}
    evals = sorted(history["eval/pass_rate"].items())
    start = history["compute/wall_s"].get(0, 0.0)
    hit = next(((step, rate) for step, rate in evals if step > 0 and rate >= target), None)
    out = {"final_pass_rate": evals[-1][1], "steps": evals[-1][0], "reached": hit is not None,
           "learner_s_per_sample": sum(history["timing/train_step_s"].values())
           / max(sum(history["learner/num_samples"].values()), 1.0)}
    if hit is not None:
        out |= {"samples_to_target": history["compute/samples"][hit[0]],
                "time_to_target_s": history["compute/wall_s"][hit[0]] - start, "step_at_target": hit[0]}
    return out


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
        measured = {}
        for batch in [*references, *[b for b in batches if b not in references]]:
            run_dir = run_at(args.config, batch, cfg.learner.groups_per_step, args.budget_groups, args.evals,
                             folder / f"b{batch}", cfg.learner.optim.lr)
            measured[batch] = time_to_target(run_dir, args.target)
            if batch == references[-1]:
                evidence = [RunEvidence(b, measured[b].get("samples_to_target"), measured[b]["learner_s_per_sample"])
                            for b in references]
                rows, note = plan(throughput, evidence, overlap=cfg.staleness.max_lag > 0)
                predicted = {row.batch_groups: row.time_to_target_s for row in rows}
                pick = min(predicted, key=predicted.get)
    for t in throughput:
        print(json.dumps({"batch": t.batch_groups, "reference": t.batch_groups in references,
                          "gen_samples_per_s": round(t.samples_per_s, 1),
                          "predicted_time_to_target_s": round(predicted[t.batch_groups], 1),
                          **measured[t.batch_groups]}))
    reached = {b: m["time_to_target_s"] for b, m in measured.items() if m["reached"]}
    fastest = min(reached, key=reached.get) if reached else None
    print(json.dumps({"target": args.target, "planner_pick": pick, "measured_fastest": fastest,
                      "pick_was_fastest": pick == fastest, "planner_note": note}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
