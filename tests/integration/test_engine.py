"""The real vLLM engine on the tiny model: what the actor gets back from `generate` lines up with
the model the learner trains."""
import asyncio

import numpy as np
import pytest

from tidal.actor.length_control import generate, to_sample
from tidal.broker.schema import InterruptParams, PromptGroup, RolloutGroup, SamplingParams, int32s
from tidal.config import load_config


def test_interruptions_on_the_real_engine_line_up_with_the_model(tmp_path):
    """vLLM on the tiny model: interrupted samples are spliced so that a plain forward pass over
    prompt + completion reproduces every generated token's behavior logprob (about 35 s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidal.tiny import cached_model_path

    cfg = load_config("configs/tiny.yaml")
    path = cached_model_path(cfg.model, cfg.task)
    if not (path / "config.json").is_file():
        pytest.skip(f"no cached tiny model at {path} (tidal prepare configs/tiny.yaml)")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompt = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    interrupt = InterruptParams(tuple(tokenizer("==", add_special_tokens=False)["input_ids"]), "==", 1, 2, 3)
    sampling = SamplingParams(1.0, 1.0, 7, (tokenizer.eos_token_id,), interrupt)
    group = PromptGroup(run_id="r", group_id="r-int", prompt_id=0, prompt_tokens=int32s(prompt), task="arithmetic",
                        payload={"answer": "46"}, n=8, sampling=sampling, min_version=0)
    completions = asyncio.run(_generate_on_tiny_engine(cfg, str(path), group))

    assert sum(bool(c.injected_spans) for c in completions) >= 1  # budgets of 1-2 tokens cut "46<eos>" short
    rollout = RolloutGroup(group_id="r-int", prompt_id=0, actor_id="a", prompt_tokens=int32s(prompt),
                           samples=[to_sample(c, 0.0, sampling) for c in completions])
    rollout.check()
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    for s in rollout.samples:
        tokens = s.tokens.numpy("i4", "tokens").astype(np.int64)
        ids = torch.tensor([prompt + tokens.tolist()])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [seq, vocab], temperature 1
        mine = logp[len(prompt) - 1:-1].gather(1, torch.from_numpy(tokens)[:, None])[:, 0].numpy()
        generated = ~s.injected_mask()
        np.testing.assert_allclose(s.logprobs.numpy("f4", "l")[generated], mine[generated], atol=1e-4)
        assert np.all(s.logprobs.numpy("f4", "l")[~generated] == 0.0)
        assert s.version_spans == [(0, 0, s.num_tokens)]


async def _generate_on_tiny_engine(cfg, model_path: str, group: PromptGroup):
    from tidal.actor.engine import Engine

    engine = Engine(cfg.actor, model_path, "float32")
    try:
        await engine.set_version(0)
        return await generate(engine, group)
    finally:
        engine.shutdown()
