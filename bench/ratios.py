"""What tidal's parts cost against the raw thing they wrap, side by side in one run: one JSON line each.

    actor    generated tokens/s: tidal's actor loop (grants, rewards, rollouts over the in-process
             broker) against AsyncLLM.generate of the same prompts on the same engine      goal >= 0.9
    weights  the engine's pause per weight update and the learner's time per push, for the file
             channel, the tcp one (its fetch before the pause, and inside it) and the collective
             one over gloo (a broadcast into the worker inside the pause), against a memcpy
             of the same bytes; for the run's model and a ~100M-parameter one, on an engine per
             CPU linear layout (actor.vllm.cpu_linear), with each layout's generation speed
             (goal: tcp pause <= 2x memcpy and below the file channel's)
    broker   groups/s through tidal's transports (zmq; zmq with CURVE, as every run has it; redis) against
             raw pyzmq / redis-py moving the same frames the same way (request, grant, rollout,
             acknowledge)                                                                  goal >= 0.5

`python bench/ratios.py` (all three, about 5 minutes on 2 cores); `--only broker` for one. Each
pair is measured in alternation, `--repeats` times, and the medians compared.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # conftest's RedisServer: one way to start a throwaway redis-server

# ~100M parameters (Qwen2 layout, character vocabulary): what a weight update of a small real model moves
ACTOR_ID = "bench-actor"
MODEL_100M = dict(hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4, intermediate_size=2048)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def median_pair(raw: list[float], tidal: list[float]) -> dict:
    """Medians of each side, their ratio, and the range of the ratios of the pairs measured together
    (how far one repeat's noise moves the answer)."""
    pairs = [t / r for r, t in zip(raw, tidal)]
    return {
        "raw": round(statistics.median(raw), 4),
        "tidal": round(statistics.median(tidal), 4),
        "ratio": round(statistics.median(tidal) / statistics.median(raw), 3),
        "ratio_range": [round(min(pairs), 3), round(max(pairs), 3)],
        "repeats": len(raw),
    }


# ---- broker ------------------------------------------------------------------------------------
#
# The actor side runs in a process of its own, as actors do, for tidal and the raw baselines alike;
# the clock starts once it is connected and stops at the last rollout back.


def frames_for(n_groups: int, sample_tokens: int, n: int):
    """Prompt groups and, per group id, the rollout an actor sends back (n samples of
    `sample_tokens` tokens with logprobs and a version span); the same in every process (seeded)."""
    from tidal.broker.schema import PromptGroup, RolloutGroup, SampleArrays, SamplingParams, int32s

    rng = np.random.default_rng(0)
    params = SamplingParams(1.0, 1.0, sample_tokens, (0,))
    groups = [
        PromptGroup(
            run_id="bench",
            group_id=f"g{i}",
            prompt_id=i,
            prompt_tokens=int32s(rng.integers(1, 40, 12)),
            task="count",
            payload={"answer": "1 2 3"},
            n=n,
            sampling=params,
            min_version=0,
        )
        for i in range(n_groups)
    ]
    rollouts = {
        g.group_id: RolloutGroup.pack(
            [
                SampleArrays.of(
                    rng.integers(1, 40, sample_tokens),
                    -rng.random(sample_tokens),
                    version_spans=[(0, 0, sample_tokens)],
                    reward=1.0,
                    finish_reason="stop",
                )
                for _ in range(n)
            ],
            group_id=g.group_id,
            prompt_id=g.prompt_id,
            actor_id=ACTOR_ID,
            prompt_tokens=g.prompt_tokens,
            gen_seconds=0.0,
            queue_seconds=0.0,
        )
        for g in groups
    }
    return groups, rollouts


def actor_process(kind: str, spec: dict, ready, done) -> None:
    """One actor: asks for as many groups as fit in the window, answers each with its rollout."""
    from tidal.broker.schema import WireCodec

    groups, rollouts = frames_for(spec["groups"], spec["sample_tokens"], spec["n"])
    if kind == "tidal":
        asyncio.run(tidal_actor(spec, rollouts, ready, done))
        return
    frames = {g.group_id: WireCodec(64 << 20).encode(rollouts[g.group_id]) for g in groups}
    ordered = [frames[g.group_id] for g in groups]  # the raw learner hands prompts out in this order
    (raw_zmq_actor if kind == "zmq" else raw_redis_actor)(spec, ordered, ready, done)


async def tidal_actor(spec: dict, rollouts: dict, ready, done) -> None:
    from tidal.broker.factory import actor_transport
    from tidal.broker.schema import Heartbeat
    from tidal.config import load_config

    cfg = load_config("configs/tiny.yaml", spec["overrides"])
    side = actor_transport(cfg.broker, ACTOR_ID, spec["run"])
    await side.heartbeat(Heartbeat(actor_id=ACTOR_ID, version=0, engine={}, outstanding=[], hello=True))
    ready.set()
    sending: set[asyncio.Task] = set()  # the actor runs each group as a task of its own, which sends its rollout
    while not done.is_set():
        for group in await side.request_work(spec["window"] * spec["n"], timeout_s=0.2):
            task = asyncio.create_task(side.send_rollout(rollouts[group.group_id]))
            sending.add(task)
            task.add_done_callback(sending.discard)
    side.close()


def raw_zmq_actor(spec: dict, frames: list[bytes], ready, done) -> None:
    """Asks on a DEALER for as many groups as fit, sends a rollout per prompt frame over PUSH."""
    import zmq

    ctx = zmq.Context()
    dealer, push = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
    dealer.connect(f"tcp://127.0.0.1:{spec['control']}")
    push.connect(f"tcp://127.0.0.1:{spec['rollouts']}")
    dealer.send(b"hello")
    ready.set()
    sent = 0
    while not done.is_set():
        dealer.send(str(spec["window"]).encode())
        if dealer.poll(200):
            for _ in dealer.recv_multipart():
                push.send(frames[sent])
                sent += 1
    ctx.destroy(linger=0)


def raw_redis_actor(spec: dict, frames: list[bytes], ready, done) -> None:
    """Reads prompts from their stream's consumer group, adds a rollout per prompt, acknowledges it."""
    import redis

    r = redis.Redis.from_url(spec["url"])
    r.ping()
    ready.set()
    sent = 0
    while not done.is_set():
        for _, entries in r.xreadgroup("actors", "a", {spec["prompts"]: ">"}, count=spec["window"], block=200) or []:
            pipe = r.pipeline(transaction=False)
            for entry_id, _ in entries:
                pipe.xadd(spec["rollouts"], {b"f": frames[sent]})
                pipe.xack(spec["prompts"], "actors", entry_id)
                sent += 1
            pipe.execute()


def with_actor(kind: str, spec: dict, learner_side) -> float:
    """Start the actor process, wait until it is connected, run `learner_side()` (returns seconds)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=actor_process, args=(kind, spec, ready, done), daemon=True)
    proc.start()
    try:
        if not ready.wait(60):
            raise SystemExit(f"broker bench: the {kind} actor did not start")
        return learner_side()
    finally:
        done.set()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def pump(total: int, window: int, submit, receive, commit) -> float:
    """The learner's side of every broker run: keep up to `window` groups out, take rollouts back,
    acknowledge every 64. Returns seconds from the first submission to the last rollout."""
    start = time.perf_counter()
    submitted = received = 0
    while received < total:
        if submitted < total and submitted - received < window:
            hi = min(total, submitted + max(1, window // 4))
            submit(submitted, hi)
            submitted = hi
        if receive():
            received += 1
            if received % 64 == 0:
                commit()
    commit()
    return time.perf_counter() - start


def tidal_broker_run(cfg, overrides: list[str], groups, spec: dict) -> float:
    """Seconds for every group to go learner -> actor -> learner through tidal's transport, at most
    `window` groups out at once (the learner's admission control does the same)."""
    from tidal.broker.factory import learner_transport

    run = f"bench-{time.monotonic_ns()}"
    learner = learner_transport(cfg.broker, run, fresh=True)
    ports = [f"broker.zmq.{name}_port={port}" for name, port in learner.ports.items()]  # zmq binds free ports

    def learner_side() -> float:
        while not learner.actors():  # its hello
            time.sleep(0.01)
        return pump(
            len(groups),
            spec["window"],
            lambda lo, hi: learner.submit_prompts(groups[lo:hi]),
            lambda: learner.recv_rollout(timeout_s=0.05) is not None,
            learner.commit,
        )

    try:
        return with_actor("tidal", spec | {"overrides": overrides + ports, "run": run}, learner_side)
    finally:
        learner.close()


def raw_zmq_run(prompt_frames: list[bytes], spec: dict) -> float:
    """The same frames over plain pyzmq sockets laid out as tidal's: the actor asks on a DEALER and
    the learner's ROUTER answers (or parks the ask until there are prompts); rollouts come back
    over PUSH -> PULL."""
    import zmq

    ctx = zmq.Context()
    router, pull = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    spec = spec | {
        "control": router.bind_to_random_port("tcp://127.0.0.1"),
        "rollouts": pull.bind_to_random_port("tcp://127.0.0.1"),
    }
    queue: list[bytes] = []
    parked: list[tuple[bytes, int]] = []
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(pull, zmq.POLLIN)

    def serve_parked():
        while parked and queue:
            identity, want = parked.pop(0)
            grant, queue[:] = queue[:want], queue[want:]
            router.send_multipart([identity, *grant])

    def submit(lo, hi):
        queue.extend(prompt_frames[lo:hi])
        serve_parked()

    def receive() -> bool:
        events = dict(poller.poll(50))
        if router in events:
            identity, ask = router.recv_multipart()
            if ask != b"hello":
                parked.append((identity, int(ask)))
                serve_parked()
        if pull in events:
            pull.recv()
            return True
        return False

    try:
        return with_actor("zmq", spec, lambda: pump(len(prompt_frames), spec["window"], submit, receive, lambda: None))
    finally:
        ctx.destroy(linger=0)


def raw_redis_run(url: str, prompt_frames: list[bytes], spec: dict) -> float:
    """The same frames over plain redis-py as tidal lays them out: prompts and rollouts are streams
    with a consumer group each; the learner adds prompts, reads rollouts and acknowledges them."""
    import redis

    r = redis.Redis.from_url(url)
    key = f"raw:{time.monotonic_ns()}"
    spec = spec | {"url": url, "prompts": f"{key}:prompts", "rollouts": f"{key}:rollouts"}
    r.xgroup_create(spec["prompts"], "actors", id="0", mkstream=True)
    r.xgroup_create(spec["rollouts"], "learner", id="0", mkstream=True)
    inbox: list[bytes] = []
    pending: list[bytes] = []

    def submit(lo, hi):
        pipe = r.pipeline(transaction=False)
        for frame in prompt_frames[lo:hi]:
            pipe.xadd(spec["prompts"], {b"f": frame})
        pipe.execute()

    def receive() -> bool:
        if not inbox:
            for _, entries in r.xreadgroup("learner", "l", {spec["rollouts"]: ">"}, count=64, block=50) or []:
                inbox.extend(entry_id for entry_id, _ in entries)
        if inbox:
            pending.append(inbox.pop(0))
            return True
        return False

    def commit():
        if pending:
            r.xack(spec["rollouts"], "learner", *pending)
            pending.clear()

    try:
        return with_actor("redis", spec, lambda: pump(len(prompt_frames), spec["window"], submit, receive, commit))
    finally:
        r.delete(spec["prompts"], spec["rollouts"])


def bench_broker(args) -> None:
    import shutil

    from tidal.broker.schema import WireCodec
    from tidal.config import load_config

    spec = {"groups": args.groups, "sample_tokens": args.sample_tokens, "n": args.n, "window": args.window}
    groups, rollouts = frames_for(args.groups, args.sample_tokens, args.n)
    codec = WireCodec(64 << 20)
    prompt_frames = [codec.encode(g) for g in groups]
    from tidal.broker.zmq_keys import generate

    # zmq-curve: tidal's transport as `tidal run` uses it (CURVE on) against the same plain pyzmq
    kinds = ["zmq", "zmq-curve"]
    keys = generate(tempfile.mkdtemp(prefix="bench-keys-"), [ACTOR_ID])
    curve = ["broker.zmq.curve=on", f"broker.zmq.keys_dir={keys}"]
    server = None
    if shutil.which("redis-server"):
        from conftest import RedisServer

        server = RedisServer(
            tempfile.mkdtemp(prefix="bench-redis-"), extra=("--appendfsync", "everysec")
        ).start()  # what a deployment would run
        kinds.append("redis")
    try:
        for kind in kinds:
            overrides = {
                "zmq": ["broker.type=zmq"],
                "zmq-curve": ["broker.type=zmq", *curve],
                "redis": ["broker.type=redis", f"broker.redis.url={server.url if server else ''}"],
            }[kind]
            cfg = load_config("configs/tiny.yaml", overrides)
            raw, ours = [], []
            for _ in range(args.repeats):
                if kind.startswith("zmq"):
                    raw.append(raw_zmq_run(prompt_frames, spec))
                else:
                    raw.append(raw_redis_run(server.url, prompt_frames, spec))
                ours.append(tidal_broker_run(cfg, overrides, groups, spec))
            rates = median_pair([len(groups) / s for s in raw], [len(groups) / s for s in ours])
            emit(
                {
                    "bench": "broker",
                    "transport": kind,
                    "groups": len(groups),
                    "samples_per_group": args.n,
                    "tokens_per_sample": args.sample_tokens,
                    "rollout_frame_bytes": len(codec.encode(rollouts["g0"])),
                    "raw_groups_per_s": rates["raw"],
                    "tidal_groups_per_s": rates["tidal"],
                    "ratio": rates["ratio"],
                    "ratio_range": rates["ratio_range"],
                    "goal": ">= 0.5",
                    "repeats": args.repeats,
                }
            )
    finally:
        if server is not None:
            server.stop()


# ---- weights -----------------------------------------------------------------------------------


def model_100m(cfg) -> str:
    """A ~100M-parameter Qwen2 with the task's character vocabulary, built once under runs/."""
    from tidal.config import TinyModelConfig
    from tidal.tasks import get_task
    from tidal.tiny import build_tiny_model, max_positions, save_model

    module = get_task(cfg.task.name)
    path = ROOT / "runs" / "bench-models" / f"qwen2-100m-{cfg.task.name}"
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        model, tokenizer = build_tiny_model(
            TinyModelConfig(**MODEL_100M), module.ALPHABET, seed=0, positions=max_positions(module)
        )
        save_model(model, tokenizer, path)
    return str(path)


def file_channel(cfg):
    """Both sides of the file weight channel over a throwaway folder in /dev/shm."""
    from tidal.broker.weights.file import FilePublisher, FileReceiver
    from tidal.config import WeightsConfig

    weights_cfg = WeightsConfig(dir=tempfile.mkdtemp(prefix="tidal-bench-", dir="/dev/shm"))
    return FilePublisher(weights_cfg, "bench", owns_dir=True, dtype=cfg.model.dtype), FileReceiver(weights_cfg)


def copy_all(sources: dict, targets: dict) -> float:
    start = time.perf_counter()
    for name, tensor in sources.items():
        targets[name].copy_(tensor)
    return time.perf_counter() - start


def weight_channels(cfg) -> dict:
    """name -> (publisher, receiver): the file channel, the tcp one with its fetch before the
    engine's pause (the default) and inside it, and the collective one over gloo (a broadcast into
    the worker, loaded as it lands, inside the pause: NCCL's path on CPU)."""
    from dataclasses import replace

    from tidal.broker.weights import TRANSPORTS
    from tidal.config import WeightsConfig

    tcp_cfg, gloo_cfg = WeightsConfig(transport="tcp"), WeightsConfig(transport="gloo")
    tcp, gloo = TRANSPORTS["tcp"], TRANSPORTS["gloo"]
    tcp_publisher = tcp.publisher(tcp_cfg, "bench", cfg.model.dtype)
    return {
        "file": file_channel(cfg),
        "tcp": (tcp_publisher, tcp.receiver(tcp_cfg)),
        "tcp_fetch_in_pause": (tcp_publisher, tcp.receiver(replace(tcp_cfg, tcp_prefetch=False))),
        "gloo": (gloo.publisher(gloo_cfg, "bench", cfg.model.dtype), gloo.receiver(gloo_cfg)),
    }


async def measure_channels(engine, channels: dict, state: dict, repeats: int, floor) -> tuple[dict, list]:
    """Per channel: push (learner), apply (actor, fetch included) and pause (engine) seconds per
    version; the channels take turns, `repeats` rounds after one that warms every path up. Each
    counted round also times `floor()`, the memcpy of the same bytes."""
    times, floors = {name: {"push": [], "apply": [], "pause": []} for name in channels}, []
    version = 0
    for round_index in range(repeats + 1):
        for name, (publisher, receiver) in channels.items():
            version += 1
            start = time.perf_counter()
            update = publisher.publish(state, version)
            pushed = time.perf_counter()
            paused = await receiver.apply(update, engine)
            if round_index > 0:
                for key, value in (
                    ("push", pushed - start),
                    ("apply", time.perf_counter() - pushed),
                    ("pause", paused),
                ):
                    times[name][key].append(value)
        if round_index > 0:
            floors.append(floor())
    return times, floors


async def generation_rate(engine, prompt: list[int], groups: int = 16, n: int = 8, tokens: int = 64) -> float:
    """Generated tokens/s for `groups` requests of `n` samples of `tokens` tokens (fewer where the
    model's length ends them), all at once."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        n=n, temperature=1.0, max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )

    async def one(request_id: str) -> int:
        # FINAL_ONLY: one output, when the request is done
        outs = [out async for out in engine._llm.generate({"prompt_token_ids": prompt}, params, request_id=request_id)]
        return sum(len(c.token_ids) for c in outs[-1].outputs)

    start = time.perf_counter()
    generated = await asyncio.gather(*(one(f"rate-{time.monotonic_ns()}-{i}") for i in range(groups)))
    return sum(generated) / (time.perf_counter() - start)


async def weights_case(cfg, label: str, repeats: int) -> list[dict]:
    """Push (learner) and pause (engine) per update through each weight channel, against a memcpy
    of the same bytes, on idle engines, one per CPU linear layout (actor.vllm.cpu_linear), which
    also take turns generating the same tokens: one record per layout and channel, one per layout pair."""
    from dataclasses import replace

    import torch
    from transformers import AutoModelForCausalLM

    from tidal.actor.engine import Engine
    from tidal.broker.weights.file import unshared
    from tidal.config import CPU_LINEAR_LAYOUTS

    state = AutoModelForCausalLM.from_pretrained(cfg.model.path, torch_dtype=torch.float32).state_dict()
    sent = unshared(state, getattr(torch, cfg.model.dtype))  # the bytes that travel
    copies = {name: torch.empty_like(t) for name, t in sent.items()}
    channels = weight_channels(cfg)
    engines, by = {}, {}
    try:
        for layout in CPU_LINEAR_LAYOUTS:
            actor = replace(cfg.actor, vllm=replace(cfg.actor.vllm, cpu_linear=layout))
            engines[layout] = Engine(actor, cfg.model.path, cfg.model.dtype)
            await engines[layout].set_version(0)
            by[layout] = await engines[layout].weight_layout()  # "reload" or "copy": the layout took effect
            await generation_rate(engines[layout], [5, 6, 7, 8], groups=2)  # warm-up
        floor = lambda: min(copy_all(sent, copies) for _ in range(3))  # the floor, as a reference
        times, floors, rates = {}, [], {layout: [] for layout in engines}
        for _ in range(repeats):
            for layout, engine in engines.items():
                rates[layout].append(await generation_rate(engine, [5, 6, 7, 8]))
        for layout, engine in engines.items():
            times[layout], layout_floors = await measure_channels(engine, channels, state, repeats, floor)
            floors += layout_floors
    finally:
        for engine in engines.values():
            engine.shutdown()
        for publisher, _ in channels.values():
            publisher.close()
    memcpy = statistics.median(floors)
    common = {
        "bench": "weights",
        "model": label,
        "parameters": sum(t.numel() for t in state.values()),
        "bytes": sum(t.numel() * t.element_size() for t in sent.values()),
        "dtype": cfg.model.dtype,
        "memcpy_s": round(memcpy, 5),
        "repeats": repeats,
    }
    records = []
    for layout, by_channel in times.items():
        for name, values in by_channel.items():
            med = {key: statistics.median(v) for key, v in values.items()}
            records.append(
                common
                | {
                    "cpu_linear": layout,
                    "updates_by": by[layout],
                    "channel": name,
                    "push_s": round(med["push"], 4),
                    "actor_apply_s": round(med["apply"], 4),
                    "engine_pause_s": round(med["pause"], 4),
                    "pause_over_memcpy": round(med["pause"] / memcpy, 2),
                    "push_over_memcpy": round(med["push"] / memcpy, 1),
                    "goal": "tcp pause <= 2x memcpy and < file pause",
                }
            )
    rate = {layout: statistics.median(values) for layout, values in rates.items()}
    records.append(
        {
            "bench": "weights_layout",
            "model": label,
            "requests": "16 x 8 samples x 64 tokens",
            **{f"{layout}_tokens_per_s": round(r, 1) for layout, r in rate.items()},
            "plain_over_packed_tokens_per_s": round(rate["plain"] / rate["packed"], 3),
            "plain_over_packed_tcp_pause": round(
                statistics.median(times["plain"]["tcp"]["pause"]) / statistics.median(times["packed"]["tcp"]["pause"]),
                3,
            ),
            "repeats": repeats,
        }
    )
    return records


def bench_weights(args, cfg) -> None:
    from tidal.config import resolve

    for label, path in (("run", cfg.model.path), ("100m", model_100m(cfg))):
        for record in asyncio.run(weights_case(resolve(cfg, model_path=path, actor=True), label, args.repeats)):
            emit(record)


# ---- actor -------------------------------------------------------------------------------------


async def raw_generate(engine, groups) -> tuple[float, int]:
    """Every group's prompt straight into AsyncLLM.generate at once, final outputs only."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    async def one(group, request_id):
        s = group.sampling
        params = SamplingParams(
            n=group.n,
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=s.max_tokens,
            stop_token_ids=list(s.stop_token_ids),
            logprobs=0,
            flat_logprobs=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )  # as tidal asks
        tokens, prompt = 0, {"prompt_token_ids": group.prompt_tokens.numpy("i4", "prompt_tokens").tolist()}
        async for out in engine._llm.generate(prompt, params, request_id=request_id):
            tokens = sum(len(c.token_ids) for c in out.outputs)
        return tokens

    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(g, f"raw-{time.monotonic_ns()}-{i}") for i, g in enumerate(groups)))
    return time.perf_counter() - start, sum(tokens)


async def tidal_generate(cfg, engine, groups, publisher, receiver) -> tuple[float, int]:
    """The same groups through tidal's actor loop over the in-process broker: the learner side
    submits them all once the actor has caught up and said hello, and takes the rollouts back."""
    import torch
    from transformers import AutoModelForCausalLM

    from tidal.actor.episode import Episodes
    from tidal.actor.loop import Actor
    from tidal.broker.inproc import InprocBroker
    from tidal.broker.schema import WireCodec

    broker = InprocBroker(WireCodec(cfg.broker.max_message_bytes))
    learner = broker.learner()
    state = AutoModelForCausalLM.from_pretrained(cfg.model.path, torch_dtype=torch.float32).state_dict()
    learner.publish_weights(publisher.publish(state, 1))  # what a learner announces first
    episodes = Episodes.of(cfg.task, cfg.env, engine.tokenizer)
    actor = Actor(cfg.actor, engine, broker.actor(cfg.actor.id), receiver, episodes)

    def learner_side() -> tuple[float, int]:
        while not learner.actors():
            time.sleep(0.01)
        start = time.perf_counter()
        learner.submit_prompts(groups)
        tokens = received = 0
        while received < len(groups):
            rollout = learner.recv_rollout(timeout_s=1.0)
            if rollout is not None:
                received += 1
                tokens += sum(s.num_tokens for s in rollout.samples)
        elapsed = time.perf_counter() - start
        learner.shutdown_actors("bench done")
        return elapsed, tokens

    result, _ = await asyncio.gather(asyncio.to_thread(learner_side), actor.run())
    return result


async def actor_case(cfg, num_groups: int, repeats: int) -> dict:
    from transformers import AutoTokenizer

    from tidal.actor.engine import Engine
    from tidal.broker.schema import PromptGroup, int32s
    from tidal.learner.build import dispatch_plan
    from tidal.tasks import PromptEncoder, get_task

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    encode = PromptEncoder.for_task(tokenizer, cfg.task, cfg.env.kwargs)
    plan = dispatch_plan(cfg, tokenizer)
    prompts = get_task(cfg.task.name).load_prompts(cfg.task).train

    def groups(tag: str):
        return [
            PromptGroup(
                run_id="bench",
                group_id=f"{tag}-{i}",
                prompt_id=p.prompt_id,
                prompt_tokens=int32s(encode(p)),
                task=cfg.task.name,
                payload=p.payload,
                n=plan.n,
                sampling=plan.sampling,
                min_version=0,
            )
            for i, p in enumerate(prompts[:num_groups])
        ]

    publisher, receiver = file_channel(cfg)
    engine = Engine(cfg.actor, cfg.model.path, cfg.model.dtype)
    raw, ours = [], []
    try:
        await engine.set_version(0)
        await raw_generate(engine, groups("warm")[:8])
        for r in range(repeats):
            seconds, tokens = await raw_generate(engine, groups(f"raw{r}"))
            raw.append(tokens / seconds)
            seconds, tokens = await tidal_generate(cfg, engine, groups(f"tidal{r}"), publisher, receiver)
            ours.append(tokens / seconds)
    finally:
        engine.shutdown()
        publisher.close()
    rates = median_pair(raw, ours)
    return {
        "bench": "actor",
        "task": cfg.task.name,
        "groups": num_groups,
        "samples_per_group": plan.n,
        "max_tokens": plan.sampling.max_tokens,
        "max_inflight": cfg.actor.max_inflight,
        "raw_tokens_per_s": rates["raw"],
        "tidal_tokens_per_s": rates["tidal"],
        "ratio": rates["ratio"],
        "ratio_range": rates["ratio_range"],
        "goal": ">= 0.9",
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config",
        default="long",
        help="preset or YAML whose model, task and sampling the actor "
        "and weight benches use (its warm-started model is built first if not cached)",
    )
    parser.add_argument("--only", default="broker,weights,actor", help="comma-separated: broker, weights, actor")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--groups",
        type=int,
        default=20000,
        help="broker: groups moved per run (a zmq run of "
        "2,000 lasts under 0.1 s, and one scheduling hiccup moves its rate by half)",
    )
    parser.add_argument("--n", type=int, default=8, help="broker: samples per group")
    parser.add_argument("--sample-tokens", type=int, default=64, help="broker: tokens per sample")
    parser.add_argument("--window", type=int, default=64, help="broker: groups out at once")
    parser.add_argument("--actor-groups", type=int, default=64, help="actor: prompt groups per run")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    if only - {"broker", "weights", "actor"}:
        parser.error(f"--only: unknown parts {sorted(only - {'broker', 'weights', 'actor'})}")
    if "broker" in only:
        bench_broker(args)
    if only & {"weights", "actor"}:
        from tidal.config import load_config, preset_path, resolve
        from tidal.models import resolve_model_path

        cfg = load_config(preset_path(args.config))
        cfg = resolve(cfg, model_path=resolve_model_path(cfg.model, cfg.task), actor=True)
        if "weights" in only:
            bench_weights(args, cfg)
        if "actor" in only:
            emit(asyncio.run(actor_case(cfg, args.actor_groups, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
