"""`tidal plan-batch CONFIG`: which batch size reaches a target pass rate soonest.

Time-to-target at B prompt groups a step, evaluating every E(B) steps, is
T(B) = first step + (steps(B) - 1) x seconds per step + evaluations felt x seconds per evaluation,
counting the evaluations whose stall the learner felt before the step that reaches the target (an
evaluation holds the learner up about max_lag + 2 steps later, once the rollouts admitted before it
run out):
- step and evaluation times are measured, for every candidate B, in a probe: a short `tidal run` of
  the config at B on its real engine and learner (learning rate scaled by sqrt(B / B_config), the
  warmup kept to the same number of samples), evaluating every few steps. Its median step counts
  what every step pays: generation and learning (overlapping when staleness.max_lag > 0, one after
  the other at 0), the weight push and the actors' pause to load the weights; an evaluation's time
  is what the steps around it took beyond the median. The probe also reports the two halves: the
  actors' generated samples per second and the learner's time per step.
- steps(B) = S(B) / (B x n), rounded up to the evaluation that would see the target. S(B), trained
  samples to the target, comes from earlier runs: a power law S ~ B^g fitted to runs at two or more
  batch sizes, or, from runs at one batch size, the assumption that with square-root learning-rate
  scaling S does not depend on B (stated in the output). A larger batch B' pays only when its time
  per sample falls by more than its samples-to-target grow.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tidal.config import EvalConfig, LearnerConfig, load_config

PROBE_WARM_STEPS = 2  # the first steps wait for the actors' first rollouts: timed apart
PROBE_EVAL_EVERY = 6  # a probe evaluates this often, to time what an evaluation adds
PROBE_EVALS = 3


def stall_delay(max_lag: int) -> int:
    """Steps after an evaluation at which the learner feels it. The actors evaluate instead of sampling;
    the learner goes on with the rollouts already admitted, up to max_lag + 1 steps' worth, and waits
    about max_lag + 2 steps after the evaluation (measured on the demo at max_lag 2: three or four)."""
    return max_lag + 2


def probe_steps(max_lag: int) -> int:
    """Warm steps, PROBE_EVALS evaluation intervals, and room for the last one's stall."""
    return PROBE_WARM_STEPS + PROBE_EVALS * PROBE_EVAL_EVERY + stall_delay(max_lag)


def felt_evals(every: int, until: int, max_lag: int, after: int = 0) -> int:
    """Evaluations at every `every` steps, past step `after`, whose stall the learner felt by step `until`."""
    last = until - stall_delay(max_lag)
    return max(last // every - after // every, 0)


def eval_every(batch: int, eval_groups: int) -> int:
    """Steps between evaluations at `batch` groups a step when a run evaluates every `eval_groups` groups."""
    return max(round(eval_groups / batch), 1)


def at_batch(learner: LearnerConfig, batch: int, eval_groups: int) -> list[str]:
    """Overrides that run a config at `batch` groups a step: lr scaled from the config's batch by the
    square root of the ratio, the warmup kept to the same number of samples, an evaluation every
    `eval_groups` groups."""
    lr = learner.optim.lr * math.sqrt(batch / learner.groups_per_step)
    warmup = round(learner.optim.warmup_steps * learner.groups_per_step / batch)
    return [
        f"learner.groups_per_step={batch}",
        f"learner.optim.lr={lr:.6g}",
        f"learner.optim.warmup_steps={warmup}",
        f"eval.every={eval_every(batch, eval_groups)}",
    ]


def default_eval_groups(learner: LearnerConfig, evals: EvalConfig) -> int:
    """The config's own evaluation cadence, in groups (eval.every steps at its batch)."""
    return max(evals.every, 1) * learner.groups_per_step


@dataclass
class Probe:
    """What a short run at one batch size measured."""

    batch_groups: int
    # step 1's wall time less the step-0 evaluation's (the actors' first rollouts); below 0 where that
    # evaluation ended after step 1: time to a target counts from it, so the offset carries over as is
    first_step_s: float
    step_s: float  # the median step after the first ones
    eval_s: float  # what one evaluation adds to the run's wall time
    gen_samples_per_s: float  # training samples the actors generated per second over the timed steps
    train_step_s: float  # the learner's median forward, backward and optimizer time a step


def probe(config: list[str], overrides: list[str], batch: int, folder: Path) -> Probe:
    """Run the config at `batch` for probe_steps() steps, evaluating every PROBE_EVAL_EVERY (its own MLflow
    file in `folder`, no checkpoints), and read its step times back. A probe that fails is a
    RuntimeError naming its logs."""
    from tidal.ops.launcher import launch

    base = load_config(config, overrides)
    run_dir = folder / f"probe-b{batch}"
    steps = probe_steps(base.staleness.max_lag)
    cfg = load_config(
        config,
        [
            *overrides,
            *at_batch(base.learner, batch, 1),
            f"eval.every={PROBE_EVAL_EVERY}",
            f"learner.max_steps={steps}",
            f"run_dir={run_dir}",
            f"name=probe-b{batch}",
            "checkpoint.every=0",
            f"tracking.uri=sqlite:///{(run_dir / 'mlflow.db').resolve()}",
        ],
    )
    print(f"[plan-batch] probe at B={batch}: {steps} steps", flush=True)
    if launch(cfg) != 0:
        raise RuntimeError(f"the probe at B={batch} failed; its logs: {run_dir}/logs")
    return read_probe(run_dir, batch, base.staleness.max_lag)


def read_probe(run_dir: Path, batch: int, max_lag: int) -> Probe:
    """A probe's times from its MLflow record: the median step after the warm ones, and what each
    evaluation whose stall fell within those steps added beyond the median."""
    from mlflow.tracking import MlflowClient

    from tidal.scaling import by_step

    summary = json.loads((run_dir / "summary.json").read_text())
    client = MlflowClient(summary["mlflow_uri"])
    hist = {
        name: by_step(name, client.get_metric_history(summary["mlflow_run_id"], name))
        for name in ("compute/wall_s", "compute/samples", "timing/train_step_s")
    }
    wall, samples = hist["compute/wall_s"], hist["compute/samples"]
    last = max(wall)
    timed = range(PROBE_WARM_STEPS + 1, last + 1)
    step_s = float(np.median([wall[s] - wall[s - 1] for s in timed]))
    evals = felt_evals(PROBE_EVAL_EVERY, last, max_lag, after=PROBE_WARM_STEPS)
    span = wall[last] - wall[PROBE_WARM_STEPS]
    return Probe(
        batch,
        first_step_s=wall[1] - wall[0],
        step_s=step_s,
        eval_s=max(span - len(timed) * step_s, 0.0) / max(evals, 1),
        gen_samples_per_s=(samples[last] - samples[PROBE_WARM_STEPS]) / span,
        train_step_s=float(np.median(list(hist["timing/train_step_s"].values()))),
    )


@dataclass
class RunEvidence:
    """What one earlier run says: the step whose evaluation first reached the target (None if none did),
    its batch, samples per group and evaluation cadence."""

    batch_groups: int
    samples_per_group: int
    eval_every: int
    step_at_target: int | None

    @property
    def samples_to_target(self) -> float | None:
        """Trained samples to the target: the target was crossed somewhere in the evaluation interval that
        ended at step_at_target, so its middle is taken."""
        if self.step_at_target is None:
            return None
        steps = max(self.step_at_target - self.eval_every / 2, 1.0)
        return steps * self.batch_groups * self.samples_per_group


def run_evidence(uri: str, run_ids: list[str], target: float) -> list[RunEvidence]:
    """The step at which eval/pass_rate (the share of held-out samples whose reward reached the run's
    task.pass_threshold, not the mean reward) first reached `target`, with the run's batch, samples per
    group and evaluation cadence. A store or run id that is not there, or a run that is not tidal's, is a
    ScalingFitError naming it."""
    from tidal.scaling import ScalingFitError, by_step, open_store, run_name

    client = open_store(uri)
    out = []
    for run_id in run_ids:
        name = run_name(client, uri, run_id)
        params = client.get_run(run_id).data.params
        missing = [k for k in ("learner.groups_per_step", "sampling.n", "eval.every") if k not in params]
        if missing:
            raise ScalingFitError(
                f"run {run_id} ({name}) in {uri}: no {', '.join(missing)} param (not a tidal "
                "run?): its batch is unknown"
            )
        b = int(params["learner.groups_per_step"])
        evals = by_step("eval/pass_rate", client.get_metric_history(run_id, "eval/pass_rate"))
        hit = next((step for step, rate in sorted(evals.items()) if step > 0 and rate >= target), None)
        if hit is None:
            print(f"run {run_id} (B={b}) never reached pass rate {target}")
        out.append(RunEvidence(b, int(params["sampling.n"]), int(params["eval.every"]), hit))
    return out


@dataclass
class PlanRow:
    batch_groups: int
    samples_per_s: float  # generation, measured
    train_step_s: float  # the learner, measured
    step_s: float  # the whole step, measured
    eval_s: float  # what an evaluation adds, measured
    trained_per_s: float  # samples trained per second of whole steps
    samples_to_target: float
    steps_to_target: int
    time_to_target_s: float

    @property
    def s_per_sample(self) -> float:
        return self.time_to_target_s / self.samples_to_target


def _samples_model(evidence: list[RunEvidence]) -> tuple[Callable[[int], float], str]:
    """S(B) from the runs that reached the target: a power law in B, a constant, or units of S."""
    reached: dict[int, list[float]] = {}
    for e in evidence:
        if e.samples_to_target is not None:
            reached.setdefault(e.batch_groups, []).append(e.samples_to_target)
    if len(reached) >= 2:
        bs = sorted(reached)
        logs = [float(np.mean(np.log(reached[b]))) for b in bs]  # geometric mean over a batch's runs
        slope, intercept = np.polyfit(np.log(bs), logs, 1)
        return (
            lambda b: float(np.exp(intercept + slope * np.log(b))),
            f"S(B) = {np.exp(intercept):.0f} x B^{slope:.2f}, fitted to runs at B = {bs}",
        )
    if reached:
        ((b0, s0),) = reached.items()
        s = float(np.exp(np.mean(np.log(s0))))
        return (
            lambda b: s,
            "ASSUMPTION: with square-root learning-rate scaling, samples-to-target S(B) does not "
            f"depend on B (S = {s:.0f} samples, from the one batch size run, B = {b0})",
        )
    return (lambda b: float("nan"), "no run reached the target (or none given): only time per sample is known")


def plan(
    probes: list[Probe], evidence: list[RunEvidence], samples_per_group: int, eval_groups: int, max_lag: int
) -> tuple[list[PlanRow], str]:
    """One row per probed batch size, evaluating every `eval_groups` groups, and a note on where S(B)
    came from."""
    s_of, note = _samples_model(evidence)
    rows = []
    for p in probes:
        s, every = s_of(p.batch_groups), eval_every(p.batch_groups, eval_groups)
        if math.isnan(s):
            steps, t = 0, float("nan")
        else:
            evals = math.ceil(s / (p.batch_groups * samples_per_group) / every - 1e-9)  # exp(log) is not exact
            steps = evals * every  # the evaluation that sees the target
            t = p.first_step_s + (steps - 1) * p.step_s + felt_evals(every, steps, max_lag) * p.eval_s
        rows.append(
            PlanRow(
                p.batch_groups,
                p.gen_samples_per_s,
                p.train_step_s,
                p.step_s,
                p.eval_s,
                p.batch_groups * samples_per_group / p.step_s,
                s,
                steps,
                t,
            )
        )
    return rows, (
        f"{note}; step and evaluation times measured in a probe run at each B (generation, learning, "
        "weight pushes); steps rounded up to the evaluation that sees the target"
    )


def print_plan(rows: list[PlanRow], note: str) -> int | None:
    print(
        f"{'B (groups)':>10} {'gen samp/s':>10} {'learn s':>8} {'step s':>7} {'eval s':>7} {'S(B)':>8} "
        f"{'steps':>6} {'T(B) s':>8}"
    )
    for r in rows:
        print(
            f"{r.batch_groups:>10} {r.samples_per_s:>10.1f} {r.train_step_s:>8.3f} {r.step_s:>7.3f} "
            f"{r.eval_s:>7.2f} {r.samples_to_target:>8.0f} {r.steps_to_target:>6} {r.time_to_target_s:>8.1f}"
        )
    print(note)
    if any(math.isnan(r.time_to_target_s) for r in rows):
        print("no recommendation: give --runs that reached the target (--target) to know the samples it takes")
        return None
    for r, r2 in zip(rows, rows[1:]):
        speedup = r.s_per_sample / r2.s_per_sample
        growth = r2.samples_to_target / r.samples_to_target
        verdict = (
            "> S(B')/S(B) = {:.2f} -> the larger batch pays"
            if speedup > growth
            else "<= S(B')/S(B) = {:.2f} -> the larger batch does not pay"
        )
        print(
            f"B'={r2.batch_groups} vs B={r.batch_groups}: time per sample falls {speedup:.2f}x "
            + verdict.format(growth)
        )
    best = min(rows, key=lambda r: r.time_to_target_s)
    print(
        f"recommendation: B = {best.batch_groups} groups per step (lowest time-to-target; scale lr by sqrt(B / B_ref))"
    )
    return best.batch_groups


def plot_plan(rows: list[PlanRow], png: Path) -> None:
    from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

    from tidal.scaling import figure, save_figure

    bs = [r.batch_groups for r in rows]
    fig, (ax1, ax2) = figure(2, figsize=(10, 4))
    ax1.plot(bs, [r.samples_per_s for r in rows], "o-", label="generated by the actors")
    ax1.plot(bs, [r.trained_per_s for r in rows], "s-", label="trained (whole steps)")
    ax1.set(ylabel="samples/s", title="measured in the probes")
    ax1.legend(fontsize=8)
    ax2.plot(bs, [r.time_to_target_s for r in rows], "o-")
    ax2.set(ylabel="T(B) (s)", title="predicted time to target")
    for ax in (ax1, ax2):
        # batch sizes double: ticks at powers of two, as plain numbers (4 8 16 ...), at most six of them
        # (every other power, or fewer, over a wide range); matplotlib's 10^1 10^2 named no batch measured
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(LogLocator(base=2, numticks=6))
        ax.xaxis.set_major_formatter(StrMethodFormatter("{x:.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("batch (groups per step)")
        ax.grid(True, alpha=0.3)
    save_figure(fig, png, dpi=100)
