"""Is `tidal plan-batch` right when run? Probes every batch size as the planner does, runs the config
at every batch size and seed (learning rate scaled by the square root of the ratio to the config's
batch, warmup kept to the same samples, one budget of prompt groups, an evaluation every
budget/evals groups), then, for each seed, gives the planner the other seeds' runs as its earlier
runs (what `tidal plan-batch --runs` reads) and compares its predicted time-to-target and its pick
with that seed's measured ones.

    python bench/plan_check.py tiny --batch-sizes 8,16,32 --seeds 2 --target 0.7 --out /tmp/plan-tiny

Prints one JSON line per run (predicted and measured time-to-target and their ratio, steps to the
target, the probe's step time) and a summary line per seed and overall (the planner's pick, the
measured fastest, the largest predicted/measured ratio). Time-to-target is counted from the
step-0 evaluation to the evaluation that first reached the target (engine start-up left out; the
learner's steps and the evaluations on the way in). Runs and probes kept in --out are read again,
not rerun.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from runs import history, mlflow_run, tidal_run, time_to_target
from tidal.config import ConfigError, load_config
from tidal.ops.plan_batch import at_batch, plan, probe, probe_steps, read_probe, run_evidence


def run_at(
    config: list[str], overrides: list[str], batch: int, seed: int, budget_groups: int, eval_groups: int, run_dir: Path
) -> Path:
    """One run at `batch` groups a step and `seed`, `budget_groups` groups in all (kept if it ran before)."""
    if (run_dir / "summary.json").is_file():
        return run_dir
    learner = load_config(config, overrides).learner
    steps = max(budget_groups // batch, 1)
    return tidal_run(
        config,
        [
            *overrides,
            *at_batch(learner, batch, eval_groups),
            f"learner.max_steps={steps}",
            f"learner.seed={seed}",
            f"actor.seed={seed}",
        ],
        run_dir,
        f"plan_check (B={batch}, seed {seed})",
    )


def probe_at(config: list[str], overrides: list[str], batch: int, max_lag: int, folder: Path):
    """The planner's probe at `batch` (read back where an earlier check kept it)."""
    run_dir = folder / f"probe-b{batch}"
    if (run_dir / "summary.json").is_file():
        return read_probe(run_dir, batch, max_lag)
    return probe(config, overrides, batch, folder)


def check_seed(seed: int, probes: list, evidence: dict, measured: dict, cfg, eval_groups: int) -> dict:
    """The planner fed the other seeds' runs, against this seed's measured times."""
    others = [e for (s, _), e in evidence.items() if s != seed]
    rows, note = plan(probes, others, cfg.sampling.n, eval_groups, cfg.staleness.max_lag)
    predicted = {r.batch_groups: r for r in rows}
    reached = {
        b: m["time_to_target_s"] for (s, b), m in measured.items() if s == seed and m["time_to_target_s"] is not None
    }
    ratios = []
    for b, row in predicted.items():
        m = measured[seed, b]
        ratio = row.time_to_target_s / m["time_to_target_s"] if m["time_to_target_s"] else None
        ratios.append(ratio)
        print(
            json.dumps(
                {
                    "seed": seed,
                    "batch": b,
                    "predicted_time_to_target_s": round(row.time_to_target_s, 2),
                    "predicted_steps": row.steps_to_target,
                    "probe_step_s": round(row.step_s, 4),
                    "probe_eval_s": round(row.eval_s, 3),
                    "probe_gen_samples_per_s": round(row.samples_per_s, 1),
                    "probe_train_step_s": round(row.train_step_s, 4),
                    "predicted_over_measured": ratio and round(ratio, 3),
                    **m,
                }
            )
        )
    pick = min(predicted, key=lambda b: predicted[b].time_to_target_s)
    fastest = min(reached, key=reached.get) if reached else None
    worst = max((max(r, 1 / r) for r in ratios if r), default=None)
    return {
        "seed": seed,
        "planner_pick": pick,
        "measured_fastest": fastest,
        "pick_was_fastest": pick == fastest,
        "worst_ratio": worst and round(worst, 3),
        "all_reached": None not in ratios,
        "planner_note": note,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="+", help="presets, YAML files and key=value overrides")
    parser.add_argument("--batch-sizes", default="8,16,32")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.7)
    parser.add_argument("--budget-groups", type=int, default=960, help="prompt groups each run may use")
    parser.add_argument("--evals", type=int, default=12, help="evaluations per run's budget")
    parser.add_argument("--out", help="keep the runs in this folder (default: a temporary one)")
    args = parser.parse_args()
    config, overrides = [c for c in args.config if "=" not in c], [c for c in args.config if "=" in c]
    batches = sorted({int(b) for b in args.batch_sizes.split(",")})
    eval_groups = args.budget_groups // args.evals
    try:
        cfg = load_config(config, overrides)
    except ConfigError as err:
        print(f"plan_check: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.out or tmp)
        probes = [probe_at(config, overrides, b, cfg.staleness.max_lag, folder) for b in batches]
        evidence, measured = {}, {}
        for seed in range(args.seeds):
            for b in batches:
                run_dir = run_at(config, overrides, b, seed, args.budget_groups, eval_groups, folder / f"b{b}-s{seed}")
                uri, run_id = mlflow_run(run_dir)
                (evidence[seed, b],) = run_evidence(uri, [run_id], args.target)  # what `tidal plan-batch --runs` reads
                measured[seed, b] = time_to_target(history(run_dir), args.target)
    seeds = [check_seed(s, probes, evidence, measured, cfg, eval_groups) for s in range(args.seeds)]
    for line in seeds:
        print(json.dumps(line))
    print(
        json.dumps(
            {
                "target": args.target,
                "batches": batches,
                "probe_steps": probe_steps(cfg.staleness.max_lag),
                "picks_fastest": sum(s["pick_was_fastest"] for s in seeds),
                "seeds": args.seeds,
                "worst_ratio": max((s["worst_ratio"] or float("inf")) for s in seeds),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
