"""A LoRA adapter against full fine-tuning (learner.lora), side by side in one run; one JSON line each.

weights   per weight update, the adapter alone and the whole model taking turns on the same
          model: the bytes that travel, the learner's push (every tensor gathered and published,
          WeightPush) and the engine's pause, over tcp and gloo, on the run's model and a
          ~100M-parameter one; then the engine over --updates adapter updates: its resident
          memory (engine core) and the adapters it holds
learning  the demo and the long task with and without learner.lora, --seeds seeds each: time to
          a target pass rate (the full runs' median final minus --margin) and final pass rate per
          run, then the LoRA runs' time to target over the full runs' with a bootstrap 90%
          interval, and a figure of pass rate against wall time per task

python bench/lora.py --part weights                       # ~2 minutes on 2 cores
python bench/lora.py --part learning --configs tiny --seeds 3
python bench/lora.py --part learning --configs long --seeds 3 --override learner.max_steps=60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from runs import bootstrap_ratio, finish_pass_rate_figure, history, tidal_run, time_to_target


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def lora_overrides(rank: int, lr_factor: float, cfg) -> list[str]:
    """learner.lora on at `rank` (alpha 2 x rank), the preset's lr times `lr_factor`: an adapter's
    updates move a low-rank slice of each weight, and take a larger step than full fine-tuning."""
    return [
        f"learner.lora.rank={rank}",
        f"learner.lora.alpha={2 * rank}",
        f"learner.optim.lr={cfg.learner.optim.lr * lr_factor}",
    ]


# ---- weights -----------------------------------------------------------------------------------


def trainers(cfg, rank: int):
    """(full, lora) trainers on the same model, as a learner builds them, and the push each makes."""
    from dataclasses import replace

    from accelerate import Accelerator

    from tidal.config import LoraConfig
    from tidal.learner.every_rank.ranks import WeightPush
    from tidal.learner.every_rank.trainer import Trainer, load_policy, policy_dtype

    accelerator = Accelerator(cpu=True)
    lora_cfg = replace(cfg, learner=replace(cfg.learner, lora=LoraConfig(rank=rank, alpha=2.0 * rank)))
    out = {}
    for mode, run in (("full", cfg), ("lora", lora_cfg)):
        policy = load_policy(run.model.path, policy_dtype(run.learner))
        out[mode] = (Trainer(run.learner, policy, accelerator, temperature=1.0), WeightPush.of(run))
    return out


async def one_update(trainer, push, publisher, receiver, engine, version: int) -> dict:
    start = time.perf_counter()
    update = push(trainer, publisher, version)
    pushed = time.perf_counter()
    paused = await receiver.apply(update, engine)
    return {
        "bytes": sum(s.nbytes for s in update.manifest),
        "push_s": pushed - start,
        "apply_s": time.perf_counter() - pushed,
        "pause_s": paused,
    }


def channels(cfg):
    """transport -> mode -> (publisher, receiver): one channel per engine, as each actor has its own."""
    from tidal.broker.weights import TRANSPORTS
    from tidal.config import WeightsConfig

    out = {}
    for name in ("tcp", "gloo"):
        weights = WeightsConfig(transport=name)
        out[name] = {
            mode: (TRANSPORTS[name].publisher(weights, "bench", cfg.model.dtype), TRANSPORTS[name].receiver(weights))
            for mode in ("full", "lora")
        }
    return out


async def weights_case(cfg, label: str, rank: int, repeats: int) -> list[dict]:
    """Full and adapter updates taking turns, one engine each, `repeats` rounds after a warm-up one."""
    from tidal.actor.engine import Engine

    made, by_mode = trainers(cfg, rank), channels(cfg)
    engines = {
        "full": Engine(cfg.actor, cfg.model.path, cfg.model.dtype),
        "lora": Engine(cfg.actor, cfg.model.path, cfg.model.dtype, adapter_rank=rank),
    }
    times = {(t, m): [] for t in by_mode for m in engines}
    try:
        version = 0
        for round_index in range(repeats + 1):
            for transport, pair in by_mode.items():
                for mode, engine in engines.items():
                    version += 1
                    trainer, push = made[mode]
                    record = await one_update(trainer, push, *pair[mode], engine, version)
                    if round_index:
                        times[(transport, mode)].append(record)
    finally:
        for engine in engines.values():
            engine.shutdown()
        for pair in by_mode.values():
            for publisher, _ in pair.values():
                publisher.close()
    return summarize_weights(times, label, rank, repeats)


def summarize_weights(times: dict, label: str, rank: int, repeats: int) -> list[dict]:
    records = []
    for transport in sorted({t for t, _ in times}):
        med = {
            mode: {
                k: statistics.median(r[k] for r in times[(transport, mode)])
                for k in ("bytes", "push_s", "apply_s", "pause_s")
            }
            for mode in ("full", "lora")
        }
        for mode, values in med.items():
            records.append(
                {
                    "bench": "lora_weights",
                    "model": label,
                    "channel": transport,
                    "update": mode,
                    "rank": rank if mode == "lora" else None,
                    "bytes": int(values["bytes"]),
                    **{k: round(v, 5) for k, v in values.items() if k != "bytes"},
                    "repeats": repeats,
                }
            )
        records.append(
            {
                "bench": "lora_weights_ratio",
                "model": label,
                "channel": transport,
                "rank": rank,
                **{
                    f"lora_over_full_{k}": round(med["lora"][k] / med["full"][k], 4)
                    for k in ("bytes", "push_s", "pause_s")
                },
            }
        )
    return records


def engine_core_rss_mib() -> float:
    """Resident memory of this process's children (the engine core and its workers), in MiB."""
    import psutil

    return sum(p.memory_info().rss for p in psutil.Process().children(recursive=True)) / 2**20


async def memory_case(cfg, rank: int, updates: int) -> dict:
    """`updates` adapter versions over tcp into one engine, each a trained step's (the values change):
    the engine's memory after the first tenth and at the end, and the adapter ids it holds."""
    import torch

    from tidal.actor.engine import Engine

    trainer, push = trainers(cfg, rank)["lora"]
    publisher, receiver = channels(cfg)["tcp"]["lora"]
    engine = Engine(cfg.actor, cfg.model.path, cfg.model.dtype, adapter_rank=rank)
    rss, held = {}, set()
    start = time.perf_counter()
    try:
        for version in range(1, updates + 1):
            with torch.no_grad():  # a new version's values, as a step would leave them
                for _, param in trainer.policy.named_parameters():
                    if param.requires_grad:
                        param.add_(torch.randn_like(param) * 1e-3)
            await receiver.apply(push(trainer, publisher, version), engine)
            if version in (updates // 10, updates):
                rss[version] = engine_core_rss_mib()
                held |= {tuple(ids) for ids in await engine._llm.collective_rpc("tidal_adapters")}
    finally:
        engine.shutdown()
        publisher.close()
    first, last = min(rss), max(rss)
    return {
        "bench": "lora_memory",
        "updates": updates,
        "seconds": round(time.perf_counter() - start, 1),
        f"engine_rss_mib_at_{first}": round(rss[first], 1),
        f"engine_rss_mib_at_{last}": round(rss[last], 1),
        "rss_growth_kib_per_update": round((rss[last] - rss[first]) * 1024 / (last - first), 2),
        "adapter_ids_held": sorted(held),
    }


def bench_weights(args) -> None:
    from ratios import model_100m

    from tidal.config import resolve

    cfg = prepared(args.config)
    for label, path in (("run", cfg.model.path), ("100m", model_100m(cfg))):
        for record in asyncio.run(
            weights_case(resolve(cfg, model_path=path, actor=True), label, args.rank, args.repeats)
        ):
            emit(record)
    emit(asyncio.run(memory_case(cfg, args.rank, args.updates)))


def prepared(config: str):
    """The preset resolved to its warm-started model (built first if not cached), its actor's settings."""
    from tidal.config import load_config, preset_path, resolve
    from tidal.models import resolve_model_path

    cfg = load_config(preset_path(config))
    return resolve(cfg, model_path=resolve_model_path(cfg.model, cfg.task), actor=True)


# ---- learning ----------------------------------------------------------------------------------


def bench_learning(args) -> None:
    rng = np.random.default_rng(0)
    folder = Path(args.out or tempfile.mkdtemp(prefix="tidal-bench-lora-"))
    for config in args.configs.split(","):
        cfg = prepared(config)
        runs = []
        for seed in range(args.seeds):
            for mode, extra in (("full", []), ("lora", lora_overrides(args.rank, args.lr_factor, cfg))):
                run_dir = folder / f"{config}-{mode}-s{seed}"
                overrides = [f"learner.seed={seed}", f"actor.seed={seed}", *args.override, *extra]
                tidal_run([config], overrides, run_dir, "bench/lora")
                runs.append({"task": config, "mode": mode, "seed": seed, "history": history(run_dir)})
        target = statistics.median(final_pass_rate(r["history"]) for r in runs if r["mode"] == "full") - args.margin
        for run in runs:
            run.update(time_to_target(run["history"], target))
            emit({k: v for k, v in run.items() if k != "history"} | {"target": round(target, 4)})
        emit(summarize_learning(runs, config, target, rng))
        plot(runs, target, folder / f"{config}-lora.png")
    print(f"runs and figures in {folder}", file=sys.stderr)


def final_pass_rate(hist: dict) -> float:
    return hist["eval/pass_rate"][max(hist["eval/pass_rate"])]


def summarize_learning(runs: list[dict], task: str, target: float, rng) -> dict:
    times = {
        m: [r["time_to_target_s"] for r in runs if r["mode"] == m and r["time_to_target_s"] is not None]
        for m in ("full", "lora")
    }
    finals = {m: statistics.median(r["final_pass_rate"] for r in runs if r["mode"] == m) for m in ("full", "lora")}
    line = {
        "bench": "lora_learning",
        "task": task,
        "target": round(target, 4),
        **{f"{m}_reached": len(t) for m, t in times.items()},
        **{f"{m}_median_time_to_target_s": statistics.median(t) if t else None for m, t in times.items()},
        **{f"{m}_median_final_pass_rate": round(v, 4) for m, v in finals.items()},
    }
    if times["full"] and times["lora"]:
        line["lora_over_full_time_to_target"] = round(
            statistics.median(times["lora"]) / statistics.median(times["full"]), 3
        )
        line["lora_over_full_time_to_target_90ci"] = bootstrap_ratio(times["lora"], times["full"], rng)
    return line


def plot(runs: list[dict], target: float, png: Path) -> None:
    from tidal.scaling import figure

    fig, ax = figure()
    for run in runs:
        hist = run["history"]
        start = hist["compute/wall_s"].get(0, 0.0)
        steps = sorted(s for s in hist["eval/pass_rate"] if s in hist["compute/wall_s"])
        label = f"{'LoRA' if run['mode'] == 'lora' else 'full fine-tuning'}" if run["seed"] == 0 else None
        ax.plot(
            [hist["compute/wall_s"][s] - start for s in steps],
            [hist["eval/pass_rate"][s] for s in steps],
            color="tab:orange" if run["mode"] == "lora" else "tab:blue",
            alpha=0.8,
            label=label,
        )
    finish_pass_rate_figure(fig, ax, target, f"{runs[0]['task']}: LoRA against full fine-tuning", png)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="weights,learning", help="comma-separated: weights, learning")
    parser.add_argument("--config", default="long", help="weights: the preset whose model the updates carry")
    parser.add_argument("--configs", default="tiny,long", help="learning: the presets run with and without LoRA")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr-factor", type=float, default=10.0, help="learning: the LoRA runs' lr over the preset's")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--updates", type=int, default=1000, help="weights: adapter updates for the memory check")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--margin", type=float, default=0.03, help="learning: target = full runs' median final - this")
    parser.add_argument("--out", default="", help="learning: where the runs go (default: a temporary folder)")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="learning: a config override for every run (repeatable), e.g. learner.max_steps=60",
    )
    args = parser.parse_args(argv)
    parts = set(args.part.split(","))
    if parts - {"weights", "learning"}:
        parser.error(f"--part: unknown parts {sorted(parts - {'weights', 'learning'})}")
    if "weights" in parts:
        bench_weights(args)
    if "learning" in parts:
        bench_learning(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
