"""Shared test set-up and helpers for every tier.

    tests/unit         fast, no vLLM engine, no redis-server (`make test-unit`)
    tests/integration  real vLLM engines, redis-server, MLflow stores, torchrun processes; the ZeroMQ
                       transport and the gloo weight channel on real sockets, through their timeouts
    tests/fault        real processes killed and restarted mid-run
    tests/gpu          CUDA only; skipped elsewhere

Each test gets its tier's marker from its folder. Triton runs in its interpreter on machines
without CUDA; the variable must be set before anything imports triton (vLLM does), so it is set
here, first.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tidal.broker.schema import PromptGroup, RolloutGroup, SampleArrays, SamplingParams, int32s  # noqa: E402
from tidal.config import Aggregation, LearnerConfig, LossConfig, LossType, OptimConfig, TinyModelConfig  # noqa: E402
from tidal.kernels import logprobs  # noqa: E402
from tidal.ops.reachable import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TIERS = {"integration": "integration", "fault": "fault", "gpu": "gpu"}  # folder -> marker


def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        tier = Path(item.fspath).resolve().relative_to(ROOT / "tests").parts[0]
        if tier in TIERS:
            item.add_marker(TIERS[tier])
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)


SESSION_MARK = "TIDAL_TEST_SESSION"  # inherited by every process the tests start, orphaned or not
os.environ[SESSION_MARK] = str(os.getpid())


@pytest.fixture(autouse=True)
def no_orphaned_processes(request):
    """Tests that start real processes must leave none behind: a vLLM engine orphaned by a killed
    actor would keep a core busy and slow every later test. After each such test, processes of this
    session that are no longer its descendants get 15 s to exit, then are killed and named."""
    if not {"integration", "fault"} & set(request.node.keywords):
        yield
        return
    import psutil

    yield
    me = psutil.Process()

    def orphans() -> list[psutil.Process]:
        ours = {p.pid for p in me.children(recursive=True)} | {me.pid}
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if proc.pid not in ours and proc.environ().get(SESSION_MARK) == os.environ[SESSION_MARK]:
                    found.append(proc)
            except psutil.Error:  # gone, or not ours to read
                continue
        return found

    deadline = time.monotonic() + 15
    while (left := orphans()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    assert not left, "processes left running after the test: " + "; ".join(
        f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}" for p in left
    )


@pytest.fixture(autouse=True)
def mlflow_environment():
    """MLflow's set_tracking_uri and set_experiment also write MLFLOW_TRACKING_URI and
    MLFLOW_EXPERIMENT_ID into the environment, which tidal honours: without this, a test that
    logged to a temporary store would send every later test's runs (and their subprocesses') there."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    yield
    for key in [k for k in os.environ if k.startswith("MLFLOW_")]:
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(scope="session")
def mlflow_tables_template(tmp_path_factory) -> Path:
    """Where the session's empty MLflow sqlite store (its tables, no experiment) is made, on first use."""
    return tmp_path_factory.mktemp("mlflow-template") / "tables.db"


@pytest.fixture(autouse=True)
def new_mlflow_stores_from_a_template(request, monkeypatch, mlflow_tables_template):
    """In the unit tier a new sqlite MLflow store gets its tables copied from one made once a session:
    MLflow's own set-up (create the tables, then every schema migration) took 2-5 s a store on 2 cores,
    most of a pipeline test. Everything after the tables (the default experiment, tidal's experiment,
    runs) happens in each store as in a new one; the integration tier makes every store for real."""
    if set(TIERS.values()) & set(request.node.keywords):
        yield
        return
    import sqlite3

    import mlflow.store.db.utils as db_utils

    make_tables = db_utils._initialize_tables

    def copy_tables(engine) -> None:
        if engine.dialect.name != "sqlite" or engine.url.database in (None, "", ":memory:"):
            make_tables(engine)
            return
        if not mlflow_tables_template.exists():
            import sqlalchemy

            made = sqlalchemy.create_engine(f"sqlite:///{mlflow_tables_template}")
            make_tables(made)
            made.dispose()
        with sqlite3.connect(mlflow_tables_template) as template, sqlite3.connect(engine.url.database) as store:
            template.backup(store)
        template.close()
        store.close()

    monkeypatch.setattr(db_utils, "_initialize_tables", copy_tables)  # read at call time by MLflow's stores
    yield


@pytest.fixture(scope="module")
def accelerator():
    """A plain CPU Accelerator (no mixed precision), shared by a module's tests."""
    from accelerate import Accelerator

    return Accelerator(cpu=True)


@pytest.fixture
def fresh_accelerator():
    """Accelerate keeps one process-wide state: a test that builds its own Accelerator (another mixed
    precision) starts from none and leaves none behind, as a new process would."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The warm-started tiny model of configs/tiny.yaml, built once if the cache lacks it (about 80 s)."""
    from tidal.config import load_config
    from tidal.learner.tools.warmstart import build_tiny
    from tidal.models import resolve_model_path

    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    return resolve_model_path(cfg.model, cfg.task, build_tiny)


# ---- wire messages -------------------------------------------------------------------------------


def prompt_group(i: int, n: int = 4, eval_version: int | None = None) -> PromptGroup:
    return PromptGroup(
        run_id="r",
        group_id=f"r-{i}",
        prompt_id=i,
        prompt_tokens=int32s([1, 2]),
        task="arithmetic",
        payload={"answer": "3"},
        n=n,
        sampling=SamplingParams(),
        min_version=0,
        eval_version=eval_version,
    )


def rollout(
    tokens=(3, 4, 1),
    logprobs=(-0.5, -1.0, -0.1),
    spans=((0, 0, 1), (1, 1, 3)),
    reward=1.0,
    group_id="g1",
    actor_id="actor-0",
) -> RolloutGroup:
    return RolloutGroup.pack(
        [
            SampleArrays.of(
                tokens, logprobs, version_spans=[tuple(s) for s in spans], reward=reward, finish_reason="stop"
            )
        ],
        group_id=group_id,
        prompt_id=7,
        actor_id=actor_id,
        prompt_tokens=int32s([5, 6]),
    )


def sample(spans, reward, finish_reason="stop", **extra) -> SampleArrays:
    """A sample whose tokens were produced by the versions of `spans` [(version, num_tokens), ...]."""
    version_spans, start = [], 0
    for version, n in spans:
        version_spans.append((version, start, start + n))
        start += n
    return SampleArrays.of(
        [5] * start, [-1.0] * start, version_spans=version_spans, reward=reward, finish_reason=finish_reason, **extra
    )


# ---- one training step of a tiny model (unit tests, and the multi-rank script under torchrun) -----

STEP_VERSION = 2  # the learner's version during the step; samples carry versions 1 and 2
ALPHABET = "0123456789+="
TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=1, num_kv_heads=1, intermediate_size=64)

# name -> (loss, aggregation, micro_batch_tokens, mini-batches per step)
CASES = {
    "cispo_prompt_mean": (LossType.cispo, Aggregation.prompt_mean, 24, 1),
    "ppo_token_mean_2updates": (LossType.ppo, Aggregation.token_mean, 24, 2),
    "gspo_sample_mean": (LossType.gspo, Aggregation.sample_mean, 10_000, 1),
}


def step_batch(num_groups: int = 6, seed: int = 0) -> tuple[list[RolloutGroup], list[list[np.ndarray]]]:
    """Groups of 2-3 samples with uneven lengths, mixed versions and one masked (too old) token."""
    rng = np.random.default_rng(seed)
    groups, masks = [], []
    for g in range(num_groups):
        samples = []
        for i in range(2 + g % 2):
            n = int(rng.integers(1, 7))
            version = STEP_VERSION - int(rng.integers(0, 2))
            behavior = -2.4 + 0.3 * rng.standard_normal(n)
            samples.append(
                SampleArrays.of(
                    rng.integers(2, 14, n),
                    behavior,
                    version_spans=[(version, 0, n)],
                    reward=float((g + i) % 2),
                    finish_reason="stop",
                )
            )
        prompt = int32s(rng.integers(2, 14, 2 + g % 3))
        groups.append(RolloutGroup.pack(samples, group_id=f"g{g}", prompt_id=g, actor_id="a", prompt_tokens=prompt))
        masks.append([np.ones(s.sample.num_tokens, dtype=bool) for s in samples])
    masks[-1][0][0] = False  # a token the staleness rule masked out
    return groups, masks


def learner_config(
    loss: LossType, aggregation: Aggregation, micro_batch_tokens: int, minibatches: int, num_groups: int = 6
) -> LearnerConfig:
    # AdamW's first update is lr * g / (|g| + eps): with eps = 1 and lr = 1 it follows the gradient
    # almost linearly, so parameters after the step differ when the gradients do (Adam's usual
    # g / |g| would hide a wrong gradient scale).
    optim = OptimConfig(lr=1.0, eps=1.0, max_grad_norm=0.0)
    # narrow clip ranges, so that the second ppo update and gspo's sequence ratios do clip
    loss_cfg = LossConfig(
        type=loss,
        aggregation=aggregation,
        minibatches_per_step=minibatches,
        clip_eps=0.05,
        gspo_clip_low=0.05,
        gspo_clip_high=0.05,
    )
    return LearnerConfig(
        groups_per_step=num_groups,
        micro_batch_tokens=micro_batch_tokens,
        kernel_backend="torch",
        optim=optim,
        loss=loss_cfg,
    )


def run_step(cfg: LearnerConfig, accelerator, groups=None, masks=None) -> tuple[dict, dict]:
    """Parameters after one step from the same initial tiny model, and the step's metrics."""
    from tidal.learner.every_rank.trainer import Trainer
    from tidal.tiny import build_tiny_model

    if groups is None:
        groups, masks = step_batch(cfg.groups_per_step)
    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    trainer = Trainer(cfg, model, accelerator, temperature=1.0)
    metrics = trainer.step(groups, masks, STEP_VERSION)
    params = {k: v.detach().cpu().clone() for k, v in trainer.policy.state_dict().items()}
    return params, metrics


# the tiny tokenizer knows only "0123456789+=": a chat template it can render; a system message "7"
# and a user message "12+34" come out as "7+12+34="
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'system' %}+{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


# ---- a learner's tcp weight server that dies mid-transfer -----------------------------------------


def weights_config(transport: str, **keys):
    from tidal.config import WeightsConfig

    return WeightsConfig(transport=transport, **{"tcp_timeout_s": 5.0, **keys})


def served_weights(transport: str, **keys):
    """A network weight channel's learner side serving the tiny model: yields (publisher with 4 KiB
    buckets, the announcement of version 3, the model's state dict, its tokenizer); closed after.
    `keys`: WeightsConfig fields beyond weights_config's."""
    from tidal.broker.weights import build_publisher
    from tidal.tiny import build_tiny_model

    model, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    publisher = build_publisher(weights_config(transport, **keys), "inc", "run", "/unused")
    publisher.bucket_bytes = 4096  # several buckets even for the tiny model
    try:
        yield publisher, publisher.publish(model.state_dict(), version=3), model.state_dict(), tokenizer
    finally:
        publisher.close()


class DyingWeightServer:
    """Answers tcp weight-bucket requests from a real payload `view` until bucket `cut_at`, then
    sends that bucket's reply header (announcing `announced` bytes, default the bucket's own) and
    only `sent` of its bytes, and closes: a learner that dies, or a reply cut short, mid-transfer."""

    def __init__(self, view, buckets, cut_at: int, sent: int, announced: int | None = None):
        import socket
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.location = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.args = view, buckets, cut_at, sent, announced
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        import socket

        from tidal.broker.weights import tcp

        view, buckets, cut_at, sent, announced = self.args
        conn, _ = self.listener.accept()
        with conn, self.listener:
            for index, b in enumerate(buckets[: cut_at + 1]):
                conn.recv(tcp.REQUEST.size, socket.MSG_WAITALL)
                cut = index == cut_at
                conn.sendall(tcp.REPLY.pack(tcp.MAGIC, tcp.OK, (announced or b.nbytes) if cut else b.nbytes))
                conn.sendall(view[b.offset : b.offset + (sent if cut else b.nbytes)])


# ---- the actor's engine, scripted (no vLLM) ------------------------------------------------------


class ScriptedEngine:
    """Stands in for the vLLM engine in unit tests of the actor loop and the whole pipeline: answers
    `a+b=` prompts right with probability `p_correct` (else off by one), stamps each token with the
    version it runs, and loads weights through tidal's weight-transfer engine, as a vLLM worker does:
    on one thread of its own (`worker_setup` runs first on it), reading each tensor with `read`."""

    def __init__(
        self,
        tokenizer,
        p_correct: float = 0.5,
        seed: int = 0,
        read=None,
        worker_setup=None,
        vllm_config=None,
        device=None,
        adapter: bool = False,
    ):
        import random
        from concurrent.futures import ThreadPoolExecutor

        self.tokenizer = tokenizer
        self.p_correct = p_correct
        self.rng = random.Random(seed)
        self.version = 0
        self.loaded: dict = {}  # name -> tensor, what the weight updates brought
        self.swaps: list[int] = []  # versions loaded, in order
        self.torn = False  # an update failed part-way: the engine stays paused
        self.num_requests = 0
        self.read = read or (lambda t: t.clone())  # a model copies what it loads into its parameters
        self.weight_transport = ""  # the weight channel the worker is set up for
        self.adapter = adapter  # the updates are a LoRA adapter's, kept in the worker's stash
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="scripted-worker", initializer=worker_setup)
        from tidal.actor.weight_engine import build_engine

        self.worker = build_engine(self, None, device, vllm_config)  # as in a vLLM worker, on its `device`

    async def set_version(self, version: int) -> None:
        self.version = version

    async def in_worker(self, fn, *args):
        return await asyncio.wrap_future(self.thread.submit(fn, *args))

    async def init_weight_transfer(self, init_info: dict) -> None:
        init_info = {**init_info, "adapter": self.adapter}
        await self.in_worker(self.worker.init_transfer_engine, self.worker.parse_init_info(init_info))
        self.weight_transport = init_info["transport"]

    def num_workers(self) -> int:
        return 1

    async def transfer_weights(self, version: int, update_info: dict, streaming: bool = False) -> float:
        """vLLM's weight-transfer cycle on tidal's worker-side engine, as one worker runs it."""
        if self.weight_transport != update_info["transport"]:
            await self.init_weight_transfer({"transport": update_info["transport"]})
        try:
            await self.in_worker(self.worker.start_weight_update)
            await self.in_worker(self.worker.update_weights, update_info)
            await self.in_worker(self.worker.finish_weight_update)
        except BaseException:
            self.torn = self.torn or streaming
            raise
        self.torn = False
        self.version = version
        self.swaps.append(version)
        return 0.0

    # what the weight channel's worker side reaches in a vLLM worker: the model, and its config
    model_config = None

    def get_model(self):
        return self

    def parameters(self):
        return iter(())

    def named_parameters(self, remove_duplicate: bool = True):
        return iter(())

    def modules(self):
        return iter((self,))

    def load_weights(self, weights) -> set[str]:
        loaded = {name: self.read(t) for name, t in weights}
        self.loaded.update(loaded)  # a collective channel loads a version piece by piece
        return set(loaded)

    async def sample(self, prompt_tokens, n, params, request_id, max_tokens=None):
        import asyncio

        from tidal.actor.engine import Completion

        self.num_requests += 1
        await asyncio.sleep(0)  # requests interleave on the loop like real ones
        # the sum asked first: an episode's later turns carry earlier answers and replies after it
        a, b = re.match(r"(\d+)\+(\d+)=", self.tokenizer.decode(prompt_tokens, skip_special_tokens=True)).groups()
        width = len(a) + 1
        out = []
        for _ in range(n):
            total = int(a) + int(b) + (0 if self.rng.random() < self.p_correct else 1)
            text = f"{total:0{width}d}"[-width:]
            tokens = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.tokenizer.eos_token_id]
            out.append(
                Completion(
                    np.asarray(tokens, dtype=np.int32),
                    np.full(len(tokens), -0.7, dtype=np.float32),
                    [(self.version, 0, len(tokens))],
                    text,
                    "stop",
                )
            )
        return out

    def info(self) -> dict[str, str]:
        return {"engine": "scripted"}

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.thread.shutdown(wait=False)


# ---- a real vLLM engine for the integration tests ------------------------------------------------


def write_tiny_moe(folder):
    """A tiny Qwen3-MoE (4 experts, 2 a token, its LM head tied to the embedding) saved to `folder` with
    the tiny model's tokenizer; returns the policy. vLLM's CPU MoE kernel wants the hidden and expert
    widths in multiples of 32, CPU attention heads of 32."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tidal.tiny import build_tiny_model

    _, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
    )
    policy = Qwen3MoeForCausalLM(config).eval()
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return policy


def engine_on_a_thread(model_path: str, *overrides: str, adapter_rank: int = 0):
    """A real vLLM engine (tidal's Engine, the tiny preset's actor settings and `overrides`, pinned to
    one core as `tidal run` pins its actors) on an event loop thread of its own; yields it with that
    loop as `.loop` (tests hand it coroutines through `on_engine`) and shuts it down after."""
    import asyncio
    import threading

    from tidal.actor.engine import Engine
    from tidal.config import load_config

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="engine-loop", daemon=True)
    thread.start()
    actor = load_config(
        ROOT / "configs/tiny.yaml", [f"actor.cpu_cores={max(os.sched_getaffinity(0))}", *overrides]
    ).actor

    async def start():
        engine = Engine(actor, model_path, "float32", adapter_rank=adapter_rank)
        await engine.set_version(0)
        return engine

    engine = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=600)
    engine.loop = loop
    yield engine
    engine.shutdown()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=30)


def on_engine(engine, coro):
    """Run `coro` on the loop of an engine from `engine_on_a_thread`; its result."""
    import asyncio

    return asyncio.run_coroutine_threadsafe(coro, engine.loop).result(timeout=300)


def learner_logprobs(policy, prompt: list[int], tokens: np.ndarray) -> np.ndarray:
    """What the learner computes for these completion tokens: its fused-kernel forward, temperature 1."""
    from tidal.learner.every_rank.trainer import PolicyLogprobs

    module = PolicyLogprobs(policy, temperature=1.0, backend="torch").eval()
    ids = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        logp, _ = module(
            ids,
            torch.ones_like(ids),
            torch.arange(len(prompt) - 1, ids.shape[1] - 1),
            torch.from_numpy(tokens.astype(np.int64)),
        )
    return logp.numpy()


def perturbed(policy, seed: int, scale: float = 0.05):
    """The policy one large step later: every parameter moved (a tied LM head with the embedding)."""
    import copy

    new = copy.deepcopy(policy)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in new.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return new


def gpu_check_report(name: str, **numbers) -> None:
    """A GPU check's numbers: printed, and added to $GPU_CHECK_LOG, which scripts/gpu-check.sh collects."""
    import json

    line = json.dumps({"check": name, **numbers})
    print(f"\nGPU-CHECK {line}")
    if os.environ.get("GPU_CHECK_LOG"):
        with open(os.environ["GPU_CHECK_LOG"], "a") as f:
            f.write(line + "\n")


# ---- fused logprob kernels against the naive reference -------------------------------------------

KERNEL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def kernel_inputs(num_tokens, dim, vocab, dtype, device="cpu", seed=0, logit_scale=2.0):
    """Random hidden [T, D], weight [V, D] (logits of std ~logit_scale), targets [T]."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen) * (logit_scale / math.sqrt(dim))
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    return hidden.to(device, dtype), weight.to(device, dtype), targets.to(device)


def kernel_upstream(num_tokens, device, seed=1):
    """Random dL/dlogprob and dL/dentropy [T], so both backward paths count."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, generator=gen).to(device), torch.randn(num_tokens, generator=gen).to(device))


def run_kernel(backend, hidden, weight, targets, temperature=1.0, dtype=None, **kwargs):
    """Forward + backward; returns (logprob, entropy, dhidden, dweight) in fp64."""
    dtype = dtype or hidden.dtype
    hidden = hidden.detach().to(dtype).requires_grad_()
    weight = weight.detach().to(dtype).requires_grad_()
    logp, entropy = logprobs(hidden, weight, targets, temperature, backend=backend, **kwargs)
    grad_logp, grad_entropy = kernel_upstream(len(targets), hidden.device)
    loss = (logp * grad_logp.to(logp.dtype)).sum() + (entropy * grad_entropy.to(logp.dtype)).sum()
    loss.backward()
    return [t.detach().double() for t in (logp, entropy, hidden.grad, weight.grad)]


def assert_kernel_matches_reference(backend, hidden, weight, targets, temperature=1.0, **kwargs):
    """Compare a backend with the naive backend evaluated in fp64 on the same input values."""
    got = run_kernel(backend, hidden, weight, targets, temperature, **kwargs)
    want = run_kernel(
        "naive",
        hidden,
        weight,
        targets,
        temperature,
        dtype=torch.float64,
        **{k: v for k, v in kwargs.items() if k != "chunk_size"},
    )
    tol = KERNEL_TOL[hidden.dtype]
    for name, g, w in zip(("logprob", "entropy", "dhidden", "dweight"), got, want):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, atol=tol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}")
    return got, want


# ---- a real redis-server ------------------------------------------------------------------------


class RedisServer:
    """A real redis-server on a free port, its data (AOF, fsync per write) in a temp folder."""

    def __init__(self, directory, port: int | None = None, extra: tuple[str, ...] = ()):
        if port is None:
            port = free_port()
        self.port, self.directory, self.extra = port, directory, extra
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = None

    def start(self) -> RedisServer:
        import subprocess
        import time

        import redis

        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.directory),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=0.2).ping()
                return self
            except redis.AuthenticationError:
                return self  # up, and asking for a password
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: redis flushes the AOF and exits
            self.proc.wait(timeout=20)


def require_redis_server() -> None:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            raise RuntimeError("redis-server is not installed; .ci/run installs it")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")


@pytest.fixture
def redis_server(tmp_path):
    require_redis_server()
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def wait_until_group_is_gone(pgid: int, timeout_s: float = 15.0) -> bool:
    """SIGKILLed processes linger a moment until they are reaped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split():
            return True
        time.sleep(0.5)
    return False


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


class PrometheusServer:
    """Debian's `prometheus` scraping the given jobs every second, its data in `root`, its HTTP API on a
    free loopback port; `query` answers an instant PromQL query as {labels: value}."""

    def __init__(self, root: Path, jobs: dict[str, list[str]]):
        if shutil.which("prometheus") is None:
            if os.environ.get("CI"):
                raise RuntimeError("prometheus is not installed; .ci/run installs it")
            pytest.skip("prometheus is not installed (apt-get install prometheus)")
        self.root, self.port = root, free_port()
        scrape = [{"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in jobs.items()]
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": scrape}
        (root / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = open(root / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={root / 'prometheus.yml'}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def query(self, promql: str) -> dict[tuple, float]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert body["status"] == "success", body
        return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in body["data"]["result"]}

    def wait_for(self, promql: str, ok, timeout_s: float = 120.0) -> dict[tuple, float]:
        """The query's answer once `ok(answer)` holds (the scrapes come every second)."""
        deadline, answer = time.monotonic() + timeout_s, {}
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "prometheus.log").read_text()[-2000:]
            try:
                answer = self.query(promql)
            except OSError:  # not listening yet
                answer = {}
            if answer and ok(answer):
                return answer
            time.sleep(0.5)
        raise AssertionError(f"{promql}: {answer} after {timeout_s:.0f} s")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def leave_ranks(accelerator) -> None:
    """The end of a script run under torchrun: leave the process group, then exit without the interpreter's
    teardown, where torch's gloo threads can abort a rank that has finished ("terminate called without an
    active exception", SIGABRT: once in four full runs of the sharded-load script). Its results are written
    by then, so teardown has nothing left to do."""
    accelerator.end_training()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
