"""The real vLLM engine, shared by the tests here: started once, on a checkpoint of the tiny model
exported by `tidal export`. What it serves must be the model the learner trained, token by token.

    cached tiny model ─► one training step ─► checkpoint ─► tidal export ─► vLLM engine (one, shared)
"""
import asyncio
import threading

import numpy as np
import pytest
import torch

from conftest import ROOT, step_batch
from tidal.actor.length_control import generate, to_sample
from tidal.broker.schema import InterruptParams, PromptGroup, RolloutGroup, SamplingParams, int32s
from tidal.config import load_config, resolve


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_path):
    """(the exported folder, the checkpoint's policy as the learner holds it)."""
    from accelerate import Accelerator

    from tidal.learner.checkpoint import Checkpointer
    from tidal.learner.export import export_checkpoint, load_checkpoint_policy
    from tidal.learner.main import write_config
    from tidal.learner.trainer import Trainer, load_policy

    run_dir = tmp_path_factory.mktemp("export") / "run"
    cfg = resolve(load_config(ROOT / "configs/tiny.yaml", [f"model.path={tiny_model_path}", f"run_dir={run_dir}",
                                                           "learner.optim.lr=0.01"]))
    write_config(cfg, run_dir)
    accelerator = Accelerator(cpu=True)
    trainer = Trainer(cfg.learner, load_policy(cfg.model.path, "float32"), accelerator, temperature=1.0)
    groups, masks = step_batch(4)
    trainer.step(groups, masks, version=2)  # the checkpoint differs from the model it started from
    Checkpointer(cfg.checkpoint, run_dir / "checkpoints", accelerator, trainer).save(1, {})
    folder = export_checkpoint(run_dir, 1, run_dir / "exported")
    return folder, load_checkpoint_policy(run_dir / "checkpoints" / "step-000001", cfg.model.path)


@pytest.fixture(scope="module")
def engine(exported):
    """One engine on its own event loop thread; tests hand it coroutines through `on_engine`."""
    from tidal.actor.engine import Engine

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="engine-loop", daemon=True)
    thread.start()

    async def start():
        e = Engine(load_config(ROOT / "configs/tiny.yaml").actor, str(exported[0]), "float32")
        await e.set_version(0)
        return e

    e = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=600)
    e.loop = loop
    yield e
    e.shutdown()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=30)


def on_engine(engine, coro):
    return asyncio.run_coroutine_threadsafe(coro, engine.loop).result(timeout=300)


def learner_logprobs(policy, prompt: list[int], tokens: np.ndarray) -> np.ndarray:
    """What the learner computes for these completion tokens: its fused-kernel forward, temperature 1."""
    from tidal.learner.trainer import PolicyLogprobs

    module = PolicyLogprobs(policy, temperature=1.0, backend="torch").eval()
    ids = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        logp, _ = module(ids, torch.ones_like(ids), torch.arange(len(prompt) - 1, ids.shape[1] - 1),
                         torch.from_numpy(tokens.astype(np.int64)))
    return logp.numpy()


def tokenize(folder, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))(text, add_special_tokens=False)["input_ids"]


def test_an_exported_checkpoint_serves_in_vllm_with_the_learners_logprobs(exported, engine):
    folder, policy = exported
    prompt = tokenize(folder, "37+48=")
    sampling = SamplingParams(1.0, 1.0, 6, ())  # no stop token: every sample runs 6 tokens
    completions = on_engine(engine, engine.sample(prompt, 16, sampling, request_id="export-check"))
    worst = max(float(np.abs(c.logprobs - learner_logprobs(policy, prompt, c.tokens)).max()) for c in completions)
    print(f"\nexported model in vLLM vs the learner: max |logprob difference| {worst:.2e} over 96 tokens")
    assert worst <= 1e-4


def test_interruptions_on_the_real_engine_line_up_with_the_model(exported, engine):
    """Interrupted samples are spliced so that the learner's forward pass over prompt + completion
    reproduces every generated token's behavior logprob."""
    folder, policy = exported
    prompt = tokenize(folder, "12+34=")
    eos = policy.config.eos_token_id
    interrupt = InterruptParams(tuple(tokenize(folder, "==")), "==", 1, 2, 3)
    sampling = SamplingParams(1.0, 1.0, 7, (eos,), interrupt)
    group = PromptGroup(run_id="r", group_id="r-int", prompt_id=0, prompt_tokens=int32s(prompt), task="arithmetic",
                        payload={"answer": "46"}, n=8, sampling=sampling, min_version=0)
    completions = on_engine(engine, generate(engine, group))

    assert sum(bool(c.injected_spans) for c in completions) >= 1  # budgets of 1-2 tokens cut "46<eos>" short
    rollout = RolloutGroup(group_id="r-int", prompt_id=0, actor_id="a", prompt_tokens=int32s(prompt),
                           samples=[to_sample(c, 0.0, sampling) for c in completions])
    rollout.check()
    for s in rollout.samples:
        tokens = s.tokens.numpy("i4", "tokens")
        mine = learner_logprobs(policy, prompt, tokens)
        generated = ~s.injected_mask()
        np.testing.assert_allclose(s.logprobs.numpy("f4", "l")[generated], mine[generated], atol=1e-4)
        assert np.all(s.logprobs.numpy("f4", "l")[~generated] == 0.0)
        assert s.version_spans == [(0, 0, s.num_tokens)]
