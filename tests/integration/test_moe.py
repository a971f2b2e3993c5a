"""A mixture-of-experts policy through a real vLLM engine on the CPU. transformers keeps each MoE
layer's experts fused, one tensor per projection (`mlp.experts.gate_up_proj` [experts, 2 x width,
hidden]); the learner sends them as the checkpoint's files name them (`mlp.experts.3.up_proj.weight`,
as save_pretrained writes them), which vLLM's loaders read. After an update the engine serves the
learner's weights token for token, by the gloo channel (each bucket loaded as it lands, the nccl
channel's path) and by the file channel (a whole version at once).

    tiny Qwen3-MoE ─► vLLM engine (one, shared)
    the policy one step later ─► checkpoint names ─► gloo / file ─► engine ─► its logprobs = the learner's
"""

import numpy as np
import pytest
import torch

from conftest import ALPHABET, TINY, engine_on_a_thread, learner_logprobs, on_engine, perturbed
from tidal.broker.schema import SamplingParams


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(the model's folder, the policy as the learner holds it)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tidal.tiny import build_tiny_model

    _, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    torch.manual_seed(0)
    # vLLM's CPU MoE kernel wants the hidden and expert widths in multiples of 32, CPU attention heads of 32
    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, vocab_size=len(tokenizer), tie_word_embeddings=False,
                            max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id)
    policy = Qwen3MoeForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("moe") / "model"
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, policy


@pytest.fixture(scope="module")
def engine(moe):
    """The MoE's engine, its linear layers packed (updates by the layer-wise reload, as on the CPU backend
    a MoE layer's experts always are)."""
    yield from engine_on_a_thread(str(moe[0]), "actor.vllm.cpu_linear=packed")


def serves(engine, policy, version: int) -> float:
    """The worst gap between the engine's and the learner's logprobs over 16 samples of 6 tokens."""
    prompt = [3, 4, 5, 6]
    samples = on_engine(engine, engine.sample(prompt, 16, SamplingParams(1.0, 1.0, 6, ()), request_id=f"moe-{version}"))
    assert all(s.version_spans == [(version, 0, len(s.tokens))] for s in samples)
    return max(float(np.abs(s.logprobs - learner_logprobs(policy, prompt, s.tokens)).max()) for s in samples)


def checkpoint_pairs(policy):
    """What a weight push sends of `policy`: (entries, pairs) under the checkpoint's names."""
    from tidal.learner.ranks import checkpoint_format

    state = policy.state_dict()
    return checkpoint_format(policy, [(k, v.dtype, tuple(v.shape)) for k, v in state.items()], iter(state.items()))


@pytest.mark.parametrize("transport", ["gloo", "file"])
def test_a_moe_policy_reaches_the_engine_under_its_checkpoint_names(moe, engine, transport, tmp_path):
    from tidal.broker.weights import build_publisher, build_receiver
    from tidal.config import WeightsConfig

    folder, policy = moe
    assert serves(engine, policy, 0) < 1e-4  # as loaded from the folder
    new = perturbed(policy, seed={"gloo": 1, "file": 2}[transport], scale=0.1)
    assert "model.layers.0.mlp.experts.gate_up_proj" in new.state_dict()  # fused, as transformers holds them
    entries, pairs = checkpoint_pairs(new)
    cfg = WeightsConfig(transport=transport, bucket_mib=1, tcp_timeout_s=30.0, dir=str(tmp_path / "weights"))
    publisher, receiver = build_publisher(cfg, "inc", "run", str(tmp_path)), build_receiver(cfg)
    try:
        update = publisher.publish(pairs, 7, entries)
        names = {s.name for s in update.manifest}
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in names and not any("gate_up" in n for n in names)
        paused = on_engine(engine, receiver.apply(update, engine))
        worst = serves(engine, new, 7)
        print(f"\n{transport}: {len(update.manifest)} tensors, engine paused {paused:.3f} s; engine against "
              f"learner after the update: max |logprob difference| {worst:.2e}")
        assert worst < 1e-4
        entries, pairs = checkpoint_pairs(policy)  # the folder's weights back, for the next test
        on_engine(engine, receiver.apply(publisher.publish(pairs, 8, entries), engine))
        assert serves(engine, policy, 8) < 1e-4
    finally:
        publisher.close()
        on_engine(engine, engine.set_version(0))
