"""`tidal plan-batch CONFIG`: which batch size reaches a target pass rate soonest.

Time-to-target is T(B) = S(B) / Theta(B): S(B) samples needed to reach the target at batch
size B, Theta(B) the actors' generation throughput (samples/s) at that batch size. Theta is
measured here, on the config's real engine and model; S comes from runs at several batch
sizes, or, when runs at only one batch size exist (or none), from the assumption that with
square-root learning-rate scaling the samples needed do not depend on B (stated in the
output). A larger batch B' pays only when Theta(B')/Theta(B) > S(B')/S(B).
"""
from __future__ import annotations

import asyncio
import time
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
    encode = PromptEncoder(tokenizer, cfg.task.chat_template, cfg.task.system_prompt)
    params = SamplingParams(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.max_tokens,
                            (tokenizer.eos_token_id,))
    engine = Engine(cfg.actor, cfg.model.path, cfg.model.dtype,
                    max_num_seqs=max(cfg.actor.max_inflight, max(batch_sizes) * cfg.sampling.n))
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


def samples_to_target(uri: str, run_ids: list[str], target: float) -> dict[int, float]:
    """groups_per_step -> samples consumed when the eval pass rate first reached `target`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out: dict[int, float] = {}
    for run_id in run_ids:
        run = client.get_run(run_id)
        b = int(run.data.params["learner.groups_per_step"])
        evals = sorted(client.get_metric_history(run_id, "eval/pass_rate"), key=lambda m: m.step)
        samples = {m.step: m.value for m in client.get_metric_history(run_id, "compute/samples")}
        hit = next((m for m in evals if m.value >= target and m.step in samples), None)
        if hit is None:
            print(f"run {run_id} (B={b}) never reached pass rate {target}; ignored")
            continue
        out[b] = min(out.get(b, float("inf")), samples[hit.step])
    return out


def plan(throughput: list[Throughput], s_measured: dict[int, float]) -> tuple[list[tuple], str]:
    """Rows (B, samples/s, tokens/s, S, T) and the note on where S came from."""
    if len(s_measured) >= 2:
        bs = np.array(sorted(s_measured))
        s_of = lambda b: float(np.interp(b, bs, [s_measured[x] for x in bs]))  # noqa: E731
        note = f"S(B) interpolated from runs at B = {list(map(int, bs))}"
    else:
        base = next(iter(s_measured.values()), 1.0)
        s_of = lambda b: base  # noqa: E731
        note = ("ASSUMPTION: with square-root learning-rate scaling, samples-to-target S(B) does not depend on B "
                + (f"(S = {base:.0f} samples, from the one batch size run)" if s_measured else
                   "(no runs given: T(B) is in units of S, so only throughput decides)"))
    rows = [(t.batch_groups, t.samples_per_s, t.tokens_per_s, s_of(t.batch_groups),
             s_of(t.batch_groups) / t.samples_per_s) for t in throughput]
    return rows, note


def print_plan(rows: list[tuple], note: str) -> int:
    print(f"{'B (groups)':>10} {'samples/s':>10} {'tokens/s':>10} {'S(B)':>10} {'T(B)=S/Theta':>13}")
    for b, sps, tps, s, t in rows:
        print(f"{b:>10} {sps:>10.1f} {tps:>10.0f} {s:>10.0f} {t:>13.3f}")
    print(note)
    for (b, sps, _, s, _), (b2, sps2, _, s2, _) in zip(rows, rows[1:]):
        pays = sps2 / sps > s2 / s
        print(f"B'={b2} vs B={b}: Theta(B')/Theta(B) = {sps2 / sps:.2f} {'>' if pays else '<='} "
              f"S(B')/S(B) = {s2 / s:.2f} -> the larger batch {'pays' if pays else 'does not pay'}")
    best = min(rows, key=lambda r: r[4])
    print(f"recommendation: B = {best[0]} groups per step (lowest time-to-target; scale lr by sqrt(B / B_ref))")
    return best[0]


def plot_plan(rows: list[tuple], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = [r[0] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(bs, [r[1] for r in rows], "o-")
    ax1.set(xscale="log", xlabel="batch (groups per step)", ylabel="samples/s", title="measured throughput Theta(B)")
    ax2.plot(bs, [r[4] for r in rows], "o-")
    ax2.set(xscale="log", xlabel="batch (groups per step)", ylabel="T(B) = S(B)/Theta(B)", title="time to target")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
