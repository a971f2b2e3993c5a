"""Does asynchrony pay? Time to a target pass rate against the staleness bound, side by side in one run.

Runs tidal at every staleness.max_lag, learner.zero_variance_filter setting (--filter) and seed (the
learner on a core of its own, the engine threads of the actor on another, as the launcher places them),
on each config, and prints one JSON line per run:

    task, system, max_lag, filter, seed, wall_s, steps, time_per_step_s, whole_s, samples_generated,
    samples_trained, time_to_target_s (and time_to_<rate>_s for each rate of --also, 0.6 by default),
    final_pass_rate, profile (tidal: the median step's collect, train, push and engine pause seconds, and
    the actors' median shares of time paused for weight updates and spent on them: pause_share, pull_share)

then one summary line per variant: the median time to target, its ratio to max_lag 0's with the same
filter (how many times sooner; above 1 is faster) with a bootstrap 90% interval over seeds, the same
for each --also rate, the median time per step and whole command, samples generated and trained, and
the median final pass rate. With --trl, TRL's GRPOTrainer runs the same seeds in process
(bench/trl_anchor.py; `pip install -e ".[bench]"`; its results are kept beside tidal's runs) and every
line also gets its ratios to TRL's.

Both sides are charged alike: no evaluation runs inside either's training. Tidal's runs evaluate only at
the start and the end (on the actor, as a user's run does) and keep every version's weight file; TRL's
keeps its weights every --eval-every steps. Afterwards one evaluator (runs.HeldOut: eval.n samples of
every held-out prompt at eval.temperature) scores both. Times count from the end of the step-0
evaluation (start-up left out) to the moment the weights that first reached the target existed;
time_per_step_s is that clock's last reading over the steps; whole_s runs from launch to exit, less
TRL's evaluations after training (each side pays for a start and an end evaluation, as tidal's run
makes them). The target is the max_lag-0 runs' median final pass rate minus --margin (or --target).
A PNG per config draws the pass rate against wall time for every run, coloured by variant.

    python bench/async.py                                         # demo and long task, k 0,1,2,4,8, 3 seeds
    python bench/async.py --config configs/long.yaml --max-lag 0,4 --seeds 2
    python bench/async.py --config tiny --max-lag 0,2 --filter on,off --trl   # recipe and asynchrony, and TRL
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from runs import (
    bootstrap_ratio,
    finish_pass_rate_figure,
    time_to_target,
    timed_tidal_run,
)

PROFILE = (
    "timing/collect_s",
    "timing/train_step_s",
    "timing/weight_push_s",
    "timing/actor_weight_swap_paused_s",
    # the share of the actors' time their engines were paused for updates, and spent on updates in all
    "flow/actor_pause_share",
    "flow/actor_pull_share",
)


def run_grid(
    config: str, variants: list[tuple[int, bool]], seeds: int, every: int, extra: list[str], folder: Path, trl: bool
) -> list[dict]:
    """Every (max_lag, filter) variant's runs of one config, a seed each, and TRL's per seed when asked:
    identity, metric history (its pass rates evaluated off the training path) and timings. Each run's
    result is kept in FOLDER/<run>.json as it ends, and a run whose file is there is not run again (a
    bench stopped part way resumes with the same --out)."""
    task = Path(config).stem
    cells = [(lag, keep_filter, seed) for (lag, keep_filter), seed in itertools.product(variants, range(seeds))]
    cells += [(None, False, seed) for seed in range(seeds if trl else 0)]
    runs = []
    for lag, keep_filter, seed in cells:
        recipe = "filter" if keep_filter else "nofilter"
        name = f"{task}-trl-s{seed}" if lag is None else f"{task}-k{lag}-{recipe}-s{seed}"
        kept = folder / f"{name}.json"
        if kept.exists():
            run = json.loads(kept.read_text())
        else:
            overrides = [
                f"staleness.max_lag={lag}",
                f"learner.zero_variance_filter={keep_filter}",
                f"learner.seed={seed}",
                f"actor.seed={seed}",
                *extra,
            ]
            run = (
                trl_run(config, seed, every, extra)
                if lag is None
                else timed_tidal_run(config, folder / name, every, overrides, PROFILE)
            )
            kept.write_text(json.dumps(run))
        run["history"] = {
            metric: {int(step): value for step, value in values.items()} for metric, values in run["history"].items()
        }
        runs.append(
            {
                "task": task,
                "system": "tidal" if lag is not None else "trl",
                "max_lag": lag,
                "filter": keep_filter,
                "seed": seed,
                **run,
            }
        )
    return runs


def trl_run(config: str, seed: int, every: int, extra: list[str]) -> dict:
    """bench/trl_anchor.py in a process of its own (TRL's imports and threads stay out of this one); whole_s:
    from launch to exit less the evaluations made after training (a tidal run makes only the first and last)."""
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("trl_anchor.py")),
        config,
        f"--seed={seed}",
        f"--eval-every={every}",
        *extra,
    ]
    launched = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    ended = time.time()
    if done.returncode != 0:
        raise SystemExit(f"bench/async: the TRL run failed:\n{(done.stdout + done.stderr)[-3000:]}")
    run = json.loads(done.stdout.strip().splitlines()[-1])
    run["whole_s"] = ended - launched - run["offline_eval_s"]
    return run


def variant(run: dict) -> str:
    """What a run stands for in the summary and the plot: the system, its staleness bound and recipe."""
    if run["system"] == "trl":
        return "trl"
    return f"k{run['max_lag']}" + ("" if run["filter"] else "-nofilter")


def parse_variant(name: str) -> tuple[int, bool]:
    """`k2` -> (2, True), `k0-nofilter` -> (0, False): the names variant() gives."""
    lag, _, rest = name.removeprefix("k").partition("-")
    if not lag.isdigit() or rest not in ("", "nofilter"):
        raise SystemExit(f"bench/async: --variants: {name!r} is not k<max_lag> or k<max_lag>-nofilter")
    return int(lag), rest == ""


def summarize(runs: list[dict], target: float, also: list[float], rng: np.random.Generator) -> list[dict]:
    """Per variant (max_lag and zero-variance filter, and TRL): median time to target, its ratio to max_lag 0's
    (with the same filter) and to TRL's with intervals, the same for each fixed rate of `also`, time per
    step and the whole command's time against TRL's, samples generated and trained, final pass rates."""
    by_variant: dict[str, list[dict]] = {}
    for run in runs:
        by_variant.setdefault(variant(run), []).append(run)
    trl = by_variant.get("trl", [])
    lines = []
    for name, group in sorted(
        by_variant.items(), key=lambda item: (item[0] != "trl", item[1][0]["max_lag"] or 0, item[0])
    ):
        base = [r for r in runs if r["max_lag"] == 0 and r["filter"] == group[0]["filter"] and r["system"] == "tidal"]
        line = {
            "task": group[0]["task"],
            "variant": name,
            "system": group[0]["system"],
            "max_lag": group[0]["max_lag"],
            "filter": group[0]["filter"],
            "target": round(target, 4),
            "runs": len(group),
            "reached": len(_times(group, "time_to_target_s")),
        }
        for key, label in [("time_to_target_s", ""), *((f"time_to_{rate}_s", f"_at_{rate}") for rate in also)]:
            line |= _time_summary(key, label, group, base, trl, rng)
        for key in ("time_per_step_s", "whole_s", "samples_generated", "samples_trained"):
            line[f"median_{key}"] = round(statistics.median(r[key] for r in group), 3)
        if trl and group is not trl:  # above 1: tidal takes longer than TRL
            for key in ("time_per_step_s", "whole_s"):
                line[f"{key}_over_trl"] = round(line[f"median_{key}"] / statistics.median(r[key] for r in trl), 3)
        line["median_final_pass_rate"] = round(statistics.median(r["final_pass_rate"] for r in group), 4)
        if base:
            line["final_minus_k0"] = round(
                line["median_final_pass_rate"] - statistics.median(r["final_pass_rate"] for r in base), 4
            )
        lines.append(line)
    return lines


def _times(group: list[dict], key: str) -> list[float]:
    return [r[key] for r in group if r[key] is not None]


def _time_summary(
    key: str, label: str, group: list[dict], base: list[dict], trl: list[dict], rng: np.random.Generator
) -> dict:
    """The group's median of `key` and how many times sooner than max_lag 0 and TRL it is, with
    intervals, under speedup_vs_<k0|trl><label>."""
    times = _times(group, key)
    line = {f"median_{key}": statistics.median(times) if times else None}
    for name, reference in (("k0", base), ("trl", trl)):
        if _times(reference, key) and times and reference is not group:
            ratio = statistics.median(_times(reference, key)) / statistics.median(times)
            line[f"speedup_vs_{name}{label}"] = round(ratio, 3)
            line[f"speedup_vs_{name}{label}_90ci"] = bootstrap_ratio(_times(reference, key), times, rng)
    return line


def plot(runs: list[dict], target: float, png: Path) -> None:
    from matplotlib import colormaps

    from tidal.scaling import figure

    names = sorted({variant(r) for r in runs} - {"trl"})
    colors = dict(zip(names, colormaps["viridis"](np.linspace(0, 0.9, len(names))))) | {"trl": "tab:red"}
    seeds = {name: sum(variant(r) == name for r in runs) for name in [*names, "trl"]}  # runs per colour
    last_step = 0
    fig, ax = figure()
    for r in runs:
        hist, name = r["history"], variant(r)
        start = hist["compute/wall_s"].get(0, 0.0)
        steps = sorted(s for s in hist["eval/pass_rate"] if s in hist["compute/wall_s"])
        last_step = max([last_step, *steps])
        # one legend entry per variant (its seeds share a colour), saying how many runs it stands for
        label = (
            "TRL GRPOTrainer"
            if name == "trl"
            else f"max_lag {r['max_lag']}" + ("" if r["filter"] else ", no zero-variance filter")
        )
        label = f"{label} ({seeds[name]} seed{'s' if seeds[name] > 1 else ''})" if r["seed"] == 0 else None
        ax.plot(
            [hist["compute/wall_s"][s] - start for s in steps],
            [hist["eval/pass_rate"][s] for s in steps],
            color=colors[name],
            alpha=0.8,
            label=label,
        )
    finish_pass_rate_figure(
        fig, ax, target, f"{runs[0]['task']}: pass rate against wall time, steps 0-{last_step}", png
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", help="preset or YAML file (repeatable; default tiny and long)")
    parser.add_argument("--max-lag", default="0,1,2,4,8")
    parser.add_argument(
        "--filter",
        default="on",
        help="learner.zero_variance_filter per run: on, off or on,off (the recipe beside asynchrony)",
    )
    parser.add_argument(
        "--variants",
        help="instead of --max-lag x --filter, these variants only: k<max_lag> with the "
        "filter, k<max_lag>-nofilter without (k0-nofilter,k2,k2-nofilter)",
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--margin", type=float, default=0.05, help="target = median k=0 final pass rate - margin")
    parser.add_argument("--target", type=float, help="a fixed target pass rate instead")
    parser.add_argument("--also", default="0.6", help="fixed pass rates also timed, comma-separated (empty: none)")
    parser.add_argument(
        "--eval-every",
        type=int,
        default=10,
        help="evaluate the weights of every this many steps (the resolution of times to a pass rate)",
    )
    parser.add_argument("--trl", action="store_true", help="also TRL's GRPOTrainer per seed (the in-process anchor)")
    parser.add_argument("--out", help="keep runs and plots here (default: a temporary folder; plots to .)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args()
    if args.variants:
        variants = [parse_variant(name) for name in args.variants.split(",")]
    else:
        variants = list(
            itertools.product(
                [int(k) for k in args.max_lag.split(",")],
                [{"on": True, "off": False}[f] for f in args.filter.split(",")],
            )
        )
    also = [float(rate) for rate in args.also.split(",") if rate]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.out or tmp)
        for config in args.config or ["tiny", "long"]:
            runs = run_grid(config, variants, args.seeds, args.eval_every, args.overrides, folder, args.trl)
            base = [time_to_target(r["history"], 1.0)["final_pass_rate"] for r in runs if r["max_lag"] == 0]
            target = (
                args.target if args.target is not None else (statistics.median(base) - args.margin if base else 0.6)
            )
            fixed = [f"time_to_{rate}_s" for rate in also]
            for r in runs:
                r.update(time_to_target(r["history"], target))
                r.update(
                    {key: time_to_target(r["history"], rate)["time_to_target_s"] for key, rate in zip(fixed, also)}
                )
                r["time_per_step_s"] = round(r["wall_s"] / max(r["steps"], 1), 4)
                print(
                    json.dumps(
                        {
                            k: r.get(k)
                            for k in (
                                "task",
                                "system",
                                "max_lag",
                                "filter",
                                "seed",
                                "wall_s",
                                "steps",
                                "time_per_step_s",
                                "whole_s",
                                "samples_generated",
                                "samples_trained",
                                "time_to_target_s",
                                *fixed,
                                "final_pass_rate",
                                "profile",
                            )
                        }
                    ),
                    flush=True,
                )
            for line in summarize(runs, target, also, rng):
                print(json.dumps({"summary": True, **line}), flush=True)
            png = (Path(args.out) if args.out else Path(".")) / f"async-{runs[0]['task']}.png"
            plot(runs, target, png)
            print(json.dumps({"plot": str(png)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
