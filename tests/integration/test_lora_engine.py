"""A LoRA adapter served by a real vLLM engine and replaced version by version through the weight
channels (learner.lora): requests in flight go on under each new adapter, the engine's logprobs are
the learner's (the base with peft's adapter), one adapter is held however many versions pass, and a
failed update leaves the previous one serving."""

import asyncio

import msgspec
import numpy as np
import pytest
import torch

from conftest import DyingWeightServer, engine_on_a_thread, learner_logprobs, on_engine
from tidal.broker.schema import AdapterSpec, SamplingParams

RANK, ALPHA = 8, 16.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def base(tiny_model_path):
    from tidal.learner.every_rank.trainer import load_policy

    return load_policy(tiny_model_path, "float32")


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    yield from engine_on_a_thread(tiny_model_path, adapter_rank=RANK)


def adapted(base, seed: int, rank: int = RANK):
    """(the base with a LoRA adapter of random weights, as the learner holds it; the adapter's tensors
    under PEFT's saved names)."""
    import copy

    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=ALPHA, target_modules=list(TARGETS)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # peft starts B at zero: an adapter that changes nothing
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.base_model.model, {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def publish(publisher, tensors: dict, version: int, rank: int = RANK):
    update = publisher.publish(tensors, version=version)
    return msgspec.structs.replace(update, adapter=AdapterSpec(rank, ALPHA, TARGETS))


def channel(transport="tcp", **keys):
    from tidal.broker.weights import build_publisher, build_receiver
    from tidal.config import WeightsConfig

    cfg = WeightsConfig(transport=transport, bucket_mib=1, **{"tcp_timeout_s": 10.0, **keys})
    return build_publisher(cfg, "inc", "run", "/unused"), build_receiver(cfg)


def tokenize(engine, text: str) -> list[int]:
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def served(engine, policy, version: int, request_id: str) -> float:
    """The engine's logprobs are `policy`'s, labelled `version`; the worst difference."""
    prompt = tokenize(engine, "37+48=")
    completions = on_engine(engine, engine.sample(prompt, 8, SamplingParams(1.0, 1.0, 6, ()), request_id=request_id))
    assert all(c.version_spans == [(version, 0, len(c.tokens))] for c in completions)
    worst = max(float(np.abs(c.logprobs - learner_logprobs(policy, prompt, c.tokens)).max()) for c in completions)
    assert worst <= 1e-4, worst
    return worst


async def update_in_flight(engine, prompt, receiver, update, after_tokens: int):
    from vllm import SamplingParams as VllmSamplingParams

    params = VllmSamplingParams(max_tokens=40, ignore_eos=True, logprobs=0)
    swap, last = None, None
    async for out in engine._llm.generate(
        {"prompt_token_ids": prompt}, params, request_id=f"lora-v{update.version}", lora_request=engine._lora
    ):
        last = out.outputs[0]
        if swap is None and len(last.token_ids) >= after_tokens:
            swap = asyncio.ensure_future(receiver.apply(update, engine))
    return last, await swap


def test_before_any_version_the_engine_serves_the_base_through_a_zero_adapter(engine, base):
    served(engine, base, 0, "lora-zero")
    assert on_engine(engine, engine._llm.collective_rpc("tidal_adapters")) == [[1]]


@pytest.mark.parametrize("transport", ["tcp", "gloo"])
def test_each_adapter_version_replaces_the_last_under_requests_in_flight(engine, base, transport):
    """The adapter alone travels (a few hundred KiB, not the model), a request in flight continues under
    the new adapter from where it was, and the engine's logprobs are the learner's with that adapter."""
    version = 7 if transport == "tcp" else 8
    policy, tensors = adapted(base, seed=version)
    publisher, receiver = channel(transport)
    try:
        update = publish(publisher, tensors, version)
        out, paused_s = on_engine(engine, update_in_flight(engine, tokenize(engine, "12+34="), receiver, update, 8))
    finally:
        publisher.close()
    spans = [(int(s.version), s.start, s.end) for s in out.weight_versions]
    adapter_bytes = sum(s.nbytes for s in update.manifest)
    full_bytes = sum(p.numel() * 4 for p in base.parameters())
    print(
        f"\n{transport} adapter v{version}: {adapter_bytes / 1024:.0f} KiB ({len(update.manifest)} tensors) against "
        f"{full_bytes / 1024:.0f} KiB for the model; engine paused {paused_s:.4f} s; spans {spans}"
    )
    assert all(".lora_A.weight" in s.name or ".lora_B.weight" in s.name for s in update.manifest)
    assert len(spans) == 2 and spans[1][0] == version and 8 <= spans[1][1] < spans[1][2] == 40
    served(engine, policy, version, f"lora-after-{transport}")
    assert on_engine(engine, engine._llm.collective_rpc("tidal_adapters")) == [[1]]


def test_a_failed_adapter_update_leaves_the_previous_adapter_serving(engine, base):
    """The learner dies mid-transfer: an adapter is never torn, the engine resumes on the last one whole."""
    policy, tensors = adapted(base, seed=21)
    publisher, receiver = channel("tcp", tcp_prefetch=False)  # the workers fetch, inside the pause
    try:
        on_engine(engine, receiver.apply(publish(publisher, tensors, 21), engine))
        doomed = publish(publisher, adapted(base, seed=22)[1], 22)
        dying = DyingWeightServer(publisher.server.versions[22].view, doomed.buckets, cut_at=0, sent=100)
        with pytest.raises(Exception, match="weights v22"):
            on_engine(engine, receiver.apply(msgspec.structs.replace(doomed, location=dying.location), engine))
    finally:
        publisher.close()
    assert engine.version == 21 and not engine.torn
    served(engine, policy, 21, "lora-survived")


def test_an_adapter_the_engine_cannot_serve_is_refused_before_it_lands_and_the_last_one_serves_on(engine, base):
    """Adapters a misconfigured (or forged) learner could send: each used to kill the engine or leave it
    serving something else under the new label. Each is refused from its announcement, naming why, and
    the engine serves the version before, alive and under its own label."""
    policy, tensors = adapted(base, seed=40)
    wider = {k: torch.randn(v.shape[0], 2 * v.shape[1]) if "lora_A" in k else v for k, v in tensors.items()}
    extra = "base_model.model.model.layers.99.self_attn.q_proj.lora_A.weight"
    bad = {
        41: (adapted(base, seed=41, rank=16)[1], 16, "rank 16, above the engine's max_lora_rank 8"),
        42: (adapted(base, seed=42, rank=4)[1], RANK, r"is \[4, \d+\], not \[8, \d+\]"),
        43: (wider, RANK, "an adapter of another rank or another base model"),
        44: ({**tensors, extra: torch.zeros(RANK, 64)}, RANK, r"for a module the served model lacks \(model.layers.99"),
    }
    publisher, receiver = channel("tcp")
    try:
        on_engine(engine, receiver.apply(publish(publisher, tensors, 40), engine))
        for version, (sent, rank, says) in bad.items():
            with pytest.raises(Exception, match=says):
                on_engine(engine, receiver.apply(publish(publisher, sent, version, rank), engine))
            assert engine.version == 40 and not engine.torn
    finally:
        publisher.close()
    served(engine, policy, 40, "lora-refused-four")
    assert on_engine(engine, engine._llm.collective_rpc("tidal_adapters")) == [[1]]


def test_a_whole_model_sent_to_an_adapter_engine_is_refused_naming_why(engine, base):
    publisher, receiver = channel("tcp")
    try:
        with pytest.raises(Exception, match="are a whole model, but this engine serves a LoRA adapter"):
            on_engine(engine, receiver.apply(publisher.publish(base.state_dict(), version=30), engine))
    finally:
        publisher.close()
    assert engine.version != 30


def test_an_exported_adapter_folder_is_served_by_vllm_with_the_learners_logprobs(tiny_model_path, base, tmp_path):
    """What `tidal export` writes for a LoRA run (PEFT's format) is an adapter vLLM serves from its folder,
    as any deployment would load it: an engine of its own, the adapter named by path."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.lora.request import LoRARequest

    from tidal.config import LoraConfig
    from tidal.learner.tools.export import export_adapter

    policy, tensors = adapted(base, seed=40)
    folder = export_adapter(
        tensors,
        LoraConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS),
        tiny_model_path,
        tmp_path / "adapter",
        "float32",
    )
    serving = engine_on_a_thread(tiny_model_path, adapter_rank=RANK)
    engine = next(serving)
    try:
        prompt = tokenize(engine, "37+48=")

        async def sample():
            params = VllmSamplingParams(n=8, max_tokens=6, ignore_eos=True, logprobs=0, temperature=1.0)
            request = LoRARequest("exported", 5, str(folder))
            return [
                out
                async for out in engine._llm.generate(
                    {"prompt_token_ids": prompt}, params, request_id="exported", lora_request=request
                )
            ][-1]

        out = on_engine(engine, sample())
    finally:
        next(serving, None)
    worst = max(
        float(
            np.abs(
                np.array([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])
                - learner_logprobs(policy, prompt, np.array(c.token_ids))
            ).max()
        )
        for c in out.outputs
    )
    assert worst <= 1e-4, worst
