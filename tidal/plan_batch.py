"""`tidal plan-batch CONFIG`: which batch size reaches a target pass rate soonest.

Time-to-target is T(B) = S(B) x (seconds per sample at B): S(B) samples needed to reach the
target at batch size B; a sample costs 1/Theta(B) of generation (Theta, the actors' samples/s, is
measured here on the config's real engine and model) and L(B) of learner time (read from earlier
runs' `timing/train_step_s`). With staleness.max_lag > 0 the two overlap, so a sample costs
max(1/Theta, L); at max_lag 0 they add up. S(B) comes from earlier runs: a power law S ~ B^g fitted
to runs at two or more batch sizes, or, from runs at one batch size, the assumption that with
square-root learning-rate scaling S does not depend on B (stated in the output). A larger batch
B' pays only when its time per sample falls by more than its samples-to-target grow.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tidal.config import RunConfig


@dataclass
class Throughput:
    batch_groups: int
    samples_per_s: float
    tokens_per_s: float


async def measure(cfg: RunConfig, batch_sizes: list[int], reps: int) -> list[Throughput]:
    """Generate B prompt groups of cfg.sampling.n samples at once, `reps` times per B."""
    from transformers import AutoTokenizer

    from tidal.actor.engine import Engine
    from tidal.broker.schema import SamplingParams
    from tidal.tasks import PromptEncoder, get_task

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    prompts = get_task(cfg.task.name).load_prompts(cfg.task).train
    encode = PromptEncoder.for_task(tokenizer, cfg.task, cfg.env.kwargs)
    params = SamplingParams(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.max_tokens,
                            (tokenizer.eos_token_id,))
    engine = Engine(cfg.actor, cfg.model.path, cfg.model.dtype,
                    max_num_seqs=max(cfg.actor.max_inflight, max(batch_sizes) * cfg.sampling.n),
                    adapter_rank=cfg.learner.lora.rank)
    results, counter = [], 0
    try:
        await engine.set_version(0)
        for b in [batch_sizes[0], *batch_sizes]:  # the first pass warms the engine up
            elapsed, samples, tokens = 0.0, 0, 0
            for _ in range(reps):
                batch = [encode(prompts[(counter + i) % len(prompts)]) for i in range(b)]
                counter += b
                start = time.perf_counter()
                groups = await asyncio.gather(*(engine.sample(ids, cfg.sampling.n, params, f"plan-{counter}-{i}")
                                                for i, ids in enumerate(batch)))
                elapsed += time.perf_counter() - start
                samples += sum(len(g) for g in groups)
                tokens += sum(len(c.tokens) for g in groups for c in g)
            results.append(Throughput(b, samples / elapsed, tokens / elapsed))
    finally:
        engine.shutdown()
    return results[1:]


@dataclass
class RunEvidence:
    """What one earlier run says: samples to the target (None if never reached) and learner cost."""
    batch_groups: int
    samples_to_target: float | None
    learner_s_per_sample: float


def run_evidence(uri: str, run_ids: list[str], target: float) -> list[RunEvidence]:
    """Samples consumed when eval/pass_rate (the share of held-out samples whose reward reached the run's
    task.pass_threshold, not the mean reward) first reached `target`, and learner seconds per sample. A
    store or run id that is not there, or a run that is not tidal's, is a ScalingFitError naming it."""
    from tidal.scaling import ScalingFitError, open_store, run_name

    client = open_store(uri)
    out = []
    for run_id in run_ids:
        name = run_name(client, uri, run_id)
        b = client.get_run(run_id).data.params.get("learner.groups_per_step")
        if b is None:
            raise ScalingFitError(f"run {run_id} ({name}) in {uri}: no learner.groups_per_step param (not a tidal "
                                  "run?): its batch size is unknown")
        b = int(b)
        history = {name: sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)
                   for name in ("eval/pass_rate", "compute/samples", "timing/train_step_s", "learner/num_samples")}
        samples = {m.step: m.value for m in history["compute/samples"]}
        hit = next((m for m in history["eval/pass_rate"] if m.value >= target and m.step in samples), None)
        if hit is None:
            print(f"run {run_id} (B={b}) never reached pass rate {target}")
        step_s = sum(m.value for m in history["timing/train_step_s"])
        trained = sum(m.value for m in history["learner/num_samples"])
        out.append(RunEvidence(b, samples[hit.step] if hit else None, step_s / trained if trained else 0.0))
    return out


@dataclass
class PlanRow:
    batch_groups: int
    samples_per_s: float  # generation, measured
    tokens_per_s: float
    learner_s_per_sample: float
    samples_to_target: float
    time_to_target_s: float


def _samples_model(evidence: list[RunEvidence]) -> tuple[Callable[[int], float], str]:
    """S(B) from the runs that reached the target: a power law in B, a constant, or units of S."""
    reached: dict[int, float] = {}
    for e in evidence:
        if e.samples_to_target is not None:
            reached[e.batch_groups] = min(reached.get(e.batch_groups, float("inf")), e.samples_to_target)
    if len(reached) >= 2:
        bs = sorted(reached)
        slope, intercept = np.polyfit(np.log(bs), np.log([reached[b] for b in bs]), 1)
        return (lambda b: float(np.exp(intercept + slope * np.log(b))),
                f"S(B) = {np.exp(intercept):.0f} x B^{slope:.2f}, fitted to runs at B = {bs}")
    if reached:
        (b0, s0), = reached.items()
        return (lambda b: s0, "ASSUMPTION: with square-root learning-rate scaling, samples-to-target S(B) does not "
                f"depend on B (S = {s0:.0f} samples, from the one batch size run, B = {b0})")
    return (lambda b: 1.0, "ASSUMPTION: no run reached the target (or none given): T(B) is in units of S, "
            "so only time per sample decides")


def _learner_model(evidence: list[RunEvidence]) -> tuple[Callable[[int], float], str]:
    """L(B), learner seconds per sample, interpolated between the runs' batch sizes (flat outside)."""
    by_batch: dict[int, list[float]] = {}
    for e in evidence:
        by_batch.setdefault(e.batch_groups, []).append(e.learner_s_per_sample)
    if not by_batch:
        return (lambda b: 0.0), "learner time not counted (no runs given)"
    bs = sorted(by_batch)
    ls = [float(np.mean(by_batch[b])) for b in bs]
    return (lambda b: float(np.interp(b, bs, ls))), f"learner s/sample from runs at B = {bs}"


def plan(throughput: list[Throughput], evidence: list[RunEvidence], overlap: bool) -> tuple[list[PlanRow], str]:
    """One row per measured batch size and a note on where S(B) and L(B) came from.

    overlap: generation and learning run at the same time (staleness.max_lag > 0)."""
    s_of, s_note = _samples_model(evidence)
    l_of, l_note = _learner_model(evidence)
    rows = []
    for t in throughput:
        gen, learn = 1.0 / t.samples_per_s, l_of(t.batch_groups)
        per_sample = max(gen, learn) if overlap else gen + learn
        s = s_of(t.batch_groups)
        rows.append(PlanRow(t.batch_groups, t.samples_per_s, t.tokens_per_s, learn, s, s * per_sample))
    combine = "max(1/Theta, L): generation and learning overlap" if overlap else "1/Theta + L: max_lag 0, no overlap"
    return rows, f"{s_note}; {l_note}; seconds per sample = {combine}"


def print_plan(rows: list[PlanRow], note: str) -> int:
    print(f"{'B (groups)':>10} {'gen samp/s':>10} {'tokens/s':>10} {'L ms/samp':>10} {'S(B)':>10} {'T(B) s':>10}")
    for r in rows:
        print(f"{r.batch_groups:>10} {r.samples_per_s:>10.1f} {r.tokens_per_s:>10.0f} "
              f"{1e3 * r.learner_s_per_sample:>10.3f} {r.samples_to_target:>10.0f} {r.time_to_target_s:>10.3f}")
    print(note)
    for r, r2 in zip(rows, rows[1:]):
        speedup = (r.time_to_target_s / r.samples_to_target) / (r2.time_to_target_s / r2.samples_to_target)
        growth = r2.samples_to_target / r.samples_to_target
        verdict = "> S(B')/S(B) = {:.2f} -> the larger batch pays" if speedup > growth else \
            "<= S(B')/S(B) = {:.2f} -> the larger batch does not pay"
        print(f"B'={r2.batch_groups} vs B={r.batch_groups}: time per sample falls {speedup:.2f}x "
              + verdict.format(growth))
    best = min(rows, key=lambda r: r.time_to_target_s)
    print(f"recommendation: B = {best.batch_groups} groups per step "
          "(lowest time-to-target; scale lr by sqrt(B / B_ref))")
    return best.batch_groups


def plot_plan(rows: list[PlanRow], png: Path) -> None:
    from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

    from tidal.scaling import figure, save_figure

    bs = [r.batch_groups for r in rows]
    fig, (ax1, ax2) = figure(2, figsize=(10, 4))
    ax1.plot(bs, [r.samples_per_s for r in rows], "o-")
    ax1.set(ylabel="samples/s", title="measured generation Theta(B)")
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
