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

from conftest import engine_on_a_thread, learner_logprobs, on_engine, perturbed, write_tiny_moe
from tidal.broker.schema import SamplingParams


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(the model's folder, the policy as the learner holds it)."""
    folder = tmp_path_factory.mktemp("moe") / "model"
    return folder, write_tiny_moe(folder)


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
    from tidal.learner.every_rank.ranks import checkpoint_format

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
        print(
            f"\n{transport}: {len(update.manifest)} tensors, engine paused {paused:.3f} s; engine against "
            f"learner after the update: max |logprob difference| {worst:.2e}"
        )
        assert worst < 1e-4
        entries, pairs = checkpoint_pairs(policy)  # the folder's weights back, for the next test
        on_engine(engine, receiver.apply(publisher.publish(pairs, 8, entries), engine))
        assert serves(engine, policy, 8) < 1e-4
    finally:
        publisher.close()
        on_engine(engine, engine.set_version(0))


# two torchrun ranks load the MoE sharded: about 15 s on 2 cores
def test_a_sharded_learner_loads_a_moe_whose_checkpoint_names_its_experts_one_by_one(moe, tmp_path):
    """transformers fuses each MoE layer's experts as it loads them, so the checkpoint's per-expert
    tensors cannot be read by rows into the fused shards: rank 0 loads the model whole and sends each
    rank its shards, and the learner holds exactly what transformers loads."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_multirank import free_port

    script, out = Path(__file__).with_name("sharded_load.py"), tmp_path / "loaded.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(script),
            str(moe[0]),
            str(out),
        ],
        env=os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    loaded = json.loads(out.read_text())
    assert loaded["wrong"] == [] and "model.layers.0.mlp.experts.gate_up_proj" in loaded["names"]
