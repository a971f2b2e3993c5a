"""What `weights.delta` saves per weight update, over real training steps: the bytes that travel, the
actor's pull (fetch, check and load) and the engine's pause, delta against whole versions, side by
side in one run; one JSON line each.

Per model (the long task's, and a ~100M-parameter one of the same vocabulary), learning rate (the
preset's, and the GPU presets' 1e-6) and dtype the weights travel in (bfloat16, as the GPU presets
serve; float32, as the CPU presets do): --steps training steps of AdamW at that learning rate with
the preset's betas, epsilon and clip, on fp32 master weights, each a batch of the task's own
training prompts under the warm start's loss (teacher-forced answers: a randomly initialised 100M
model earns no reward, so an RL step would not move it; AdamW's step size does not depend on the
loss). Then, for each of three ways of pulling weights (tcp with the fetch before the pause, the
default; tcp with the fetch inside it, `weights.tcp_prefetch: false`; the file channel), every version
is published with deltas on and off, and two engines of the same model take them, one the deltas, one
the whole versions, which going first alternating. Every loaded version is checked against the
learner's bytes by the buckets' sha256s, and after each way the two engines' logprobs of one prompt
are compared (they must be equal).

    python bench/deltas.py                                  # both models, about 15 minutes on 2 cores
    python bench/deltas.py --models 100m --lrs 1e-6 --dtypes bfloat16 --steps 6

Medians over the last --measure steps (the first steps after the starting version are Adam's
largest relative moves). Loopback TCP on one machine: bytes are what a network would carry, while
the pull here is bound by hashing and copying, not by a link. `--link-gbit 1` (root) gives the tcp
ways a link of that rate: what the learner's weight ports send on loopback is shaped by the kernel
(tc's htb), everything else left as it is, and the shaping is removed at the end.

    sudo python bench/deltas.py --models 100m --lrs 1e-6 --dtypes bfloat16 --link-gbit 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
WAYS = ("tcp", "tcp_fetch_in_pause", "file")
KINDS = ("delta", "whole")


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def channel(cfg, way: str, delta: bool, dtype: str, name: str):
    """Both sides of one way of pulling weights, deltas on or off."""
    from tidal.broker.weights import TRANSPORTS

    transport = "file" if way == "file" else "tcp"
    weights = replace(cfg.weights, transport=transport, delta=delta, tcp_prefetch=way != "tcp_fetch_in_pause")
    if transport == "file":
        weights = replace(weights, dir=tempfile.mkdtemp(prefix="tidal-bench-deltas-", dir="/dev/shm"))
    chosen = TRANSPORTS[transport]
    return chosen.publisher(weights, name, dtype, owns_dir=transport == "file"), chosen.receiver(weights)


class ShapedLink:
    """What given local ports send on loopback, limited to `gbit` (tc's htb, as root): the link a
    network would put between the learner's weight port and an actor. Other traffic goes through
    an unlimited class."""

    def __init__(self, gbit: float):
        self.gbit = gbit
        self.tc("qdisc add dev lo root handle 1: htb default 20")
        self.tc("class add dev lo parent 1: classid 1:20 htb rate 100gbit")
        self.tc(f"class add dev lo parent 1: classid 1:10 htb rate {gbit}gbit ceil {gbit}gbit")

    def carry(self, port: int) -> None:
        self.tc(f"filter add dev lo parent 1: protocol ip prio 1 u32 match ip sport {port} 0xffff flowid 1:10")

    def close(self) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False, capture_output=True)

    @staticmethod
    def tc(args: str) -> None:
        done = subprocess.run(["tc", *args.split()], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"--link-gbit: `tc {args}` failed (root and tc's htb are needed): {done.stderr.strip()}")


def bytes_read(publisher, receiver) -> int:
    """Bucket bytes that reached the actor so far: sent by a tcp learner, read by a file actor."""
    if hasattr(publisher, "server"):
        return sum(publisher.server.sent.values())
    return receiver.received.whole + receiver.received.delta


class Trainer:
    """AdamW steps on the task's teacher-forced answers, fp32 master weights."""

    def __init__(self, cfg, lr: float, batch: int, seed: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tidal.tasks import get_task

        torch.manual_seed(seed)
        self.rng = random.Random(seed)
        self.net = AutoModelForCausalLM.from_pretrained(cfg.model.path, torch_dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        optim = cfg.learner.optim
        self.optim = torch.optim.AdamW(
            self.net.parameters(), lr=lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
        )
        self.clip = optim.max_grad_norm
        self.train = get_task(cfg.task.name).load_prompts(cfg.task).train
        self.batch = batch

    def step(self) -> float:
        import torch

        from tidal.learner.tools.warmstart import sft_loss

        loss = sft_loss(self.net, self.tokenizer, [self.rng.choice(self.train) for _ in range(self.batch)])
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.clip)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return float(loss)

    def state(self) -> dict:
        return {name: t.detach().clone() for name, t in self.net.state_dict().items()}


async def one_case(cfg, engines: dict, label: str, lr: float, dtype: str, args) -> list[dict]:
    """The versions of --steps training steps (kept in memory), then per way of pulling them both
    engines take every version, deltas and whole versions alternating which goes first."""
    trainer = Trainer(cfg, lr, args.batch, args.seed)
    versions = [trainer.state()]
    for _ in range(args.steps):
        trainer.step()
        versions.append(trainer.state())
    del trainer
    rows, same = {}, {}
    for way in WAYS:
        name = f"{label}-{lr:g}-{dtype}-{way}"
        sides = {kind: channel(cfg, way, kind == "delta", dtype, f"{name}-{kind}") for kind in KINDS}
        for publisher, _ in sides.values():
            if args.link is not None and hasattr(publisher, "server"):
                args.link.carry(publisher.server.port)
        try:
            for kind in KINDS:
                rows[way, kind] = {"bytes": [], "pull": [], "pause": [], "push": []}
            for version, state in enumerate(versions):
                for kind in KINDS if version % 2 else KINDS[::-1]:
                    await one_update(sides[kind], engines[kind], state, version, rows[way, kind])
            same[way] = await same_logprobs(engines)
        finally:
            for publisher, _ in sides.values():
                publisher.close()
    return summarize(rows, label, lr, dtype, args, same)


async def one_update(side, engine, state: dict, version: int, row: dict) -> None:
    publisher, receiver = side
    start = time.perf_counter()
    update = publisher.publish(state, version)
    row["push"].append(time.perf_counter() - start)
    before = bytes_read(publisher, receiver)
    start = time.perf_counter()
    row["pause"].append(await receiver.apply(update, engine))
    row["pull"].append(time.perf_counter() - start)
    row["bytes"].append(bytes_read(publisher, receiver) - before)


async def same_logprobs(engines: dict) -> bool:
    """Whether the two engines, after the last version, give one prompt's greedy tokens the same logprobs."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
    seen = []
    for kind, engine in engines.items():
        async for out in engine._llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, request_id=f"same-{kind}"):
            final = out
        seen.append((final.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in final.outputs[0].logprobs]))
    return seen[0] == seen[1]


def summarize(rows: dict, label: str, lr: float, dtype: str, args, same: bool) -> list[dict]:
    last = slice(-args.measure, None)
    med = {key: {k: statistics.median(v[last]) for k, v in row.items()} for key, row in rows.items()}
    records = []
    for way in WAYS:
        delta, whole = med[way, "delta"], med[way, "whole"]
        records.append(
            {
                "bench": "weight_deltas",
                "model": label,
                "lr": lr,
                "dtype": dtype,
                "way": way,
                "bytes_delta": int(delta["bytes"]),
                "bytes_whole": int(whole["bytes"]),
                "bytes_ratio": round(delta["bytes"] / whole["bytes"], 4),
                "bytes_ratio_by_step": ratios(rows[way, "delta"]["bytes"], rows[way, "whole"]["bytes"]),
                "pull_s_delta": round(delta["pull"], 4),
                "pull_s_whole": round(whole["pull"], 4),
                "pull_ratio": round(delta["pull"] / whole["pull"], 3),
                "pause_s_delta": round(delta["pause"], 4),
                "pause_s_whole": round(whole["pause"], 4),
                "pause_ratio": round(delta["pause"] / whole["pause"], 3),
                "push_s_delta": round(delta["push"], 4),
                "push_s_whole": round(whole["push"], 4),
                "same_logprobs": same[way],
                "steps": args.steps,
                "measured": args.measure,
                "link_gbit": args.link.gbit if args.link is not None and way != "file" else None,
                "goal": "bytes <= 0.1 of whole at 100M after the first steps; pause <= 0.5 of whole",
            }
        )
    return records


def ratios(delta: list[float], whole: list[float]) -> list[float]:
    return [round(d / w, 4) for d, w in zip(delta, whole)]


async def model_cases(cfg, label: str, args) -> None:
    from tidal.actor.engine import Engine

    actor = replace(cfg.actor, vllm=replace(cfg.actor.vllm, cpu_linear="plain"))
    engines = {kind: Engine(actor, cfg.model.path, cfg.model.dtype) for kind in ("delta", "whole")}
    try:
        for engine in engines.values():
            await engine.set_version(0)
        for lr in [float(x) if x != "preset" else cfg.learner.optim.lr for x in args.lrs.split(",")]:
            for dtype in args.dtypes.split(","):
                for record in await one_case(cfg, engines, label, lr, dtype, args):
                    emit(record)
    finally:
        for engine in engines.values():
            engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="long", help="preset or YAML: the task, its model and optimizer")
    parser.add_argument("--models", default="run,100m", help="run (the config's model), 100m, or both")
    parser.add_argument("--lrs", default="preset,1e-6", help="learning rates; preset = the config's learner.optim.lr")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="dtypes the weights travel in")
    parser.add_argument("--steps", type=int, default=8, help="training steps per case (versions after the first)")
    parser.add_argument("--measure", type=int, default=5, help="the last steps the medians are taken over")
    parser.add_argument("--batch", type=int, default=16, help="prompts per training step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--link-gbit", type=float, help="shape the tcp ways' link to this rate (root; tc)")
    args = parser.parse_args(argv)
    if not 1 <= args.measure <= args.steps:
        parser.error("--measure must be between 1 and --steps")

    from ratios import model_100m

    from tidal.config import load_config, preset_path, resolve
    from tidal.models import resolve_model_path

    cfg = load_config(preset_path(args.config))
    args.link = ShapedLink(args.link_gbit) if args.link_gbit else None
    try:
        for label in args.models.split(","):
            path = resolve_model_path(cfg.model, cfg.task) if label == "run" else model_100m(cfg)
            asyncio.run(model_cases(resolve(cfg, model_path=path, actor=True), label, args))
    finally:
        if args.link is not None:
            args.link.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
