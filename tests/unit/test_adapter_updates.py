"""Adapter updates (learner.lora) through every weight channel's worker side: the adapter's tensors
land in the worker's stash, never in the model; a version counts only once it arrived whole, and
what is not an adapter's (or an adapter sent to an engine without LoRA) is refused by name."""

import asyncio

import msgspec
import pytest
import torch

from conftest import ScriptedEngine, weights_config
from tidal.actor.adapter import AdapterStash
from tidal.broker.schema import AdapterSpec
from tidal.broker.weights import build_publisher, build_receiver

SPEC = AdapterSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


def adapter(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for module in SPEC.target_modules:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(4, 32, generator=generator)
            out[f"{prefix}.lora_B.weight"] = torch.randn(32, 4, generator=generator)
    return out


def publish(publisher, tensors: dict, version: int, spec=SPEC):
    return msgspec.structs.replace(publisher.publish(tensors, version=version), adapter=spec)


@pytest.fixture(params=["tcp", "gloo", "file"])
def channel(request, tmp_path):
    cfg = weights_config(request.param, bucket_mib=1, dir=str(tmp_path / "weights"))
    publisher = build_publisher(cfg, "inc", "run", str(tmp_path))
    yield publisher, build_receiver(cfg)
    for engine in engines:  # their groups' ends first: the learner's then end at once, not at their timeout
        engine.shutdown()
    engines.clear()
    publisher.close()


engines: list[ScriptedEngine] = []


def scripted(adapter: bool) -> ScriptedEngine:
    engines.append(ScriptedEngine(None, adapter=adapter))
    return engines[-1]


def stash(engine: ScriptedEngine) -> AdapterStash:
    return engine.worker.stash


def test_each_version_lands_in_the_stash_whole_and_the_model_is_never_touched(channel):
    publisher, receiver = channel
    engine = scripted(adapter=True)
    for version in (1, 2):
        tensors = adapter(version)
        asyncio.run(receiver.apply(publish(publisher, tensors, version), engine))
        spec, got, installed = stash(engine).current
        assert (spec, installed, engine.version) == (SPEC, version, version)
        assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())
    assert engine.loaded == {}  # the model's own load_weights never ran


def test_a_whole_model_for_an_adapter_engine_and_an_adapter_for_a_full_one_are_refused(channel):
    publisher, receiver = channel
    with pytest.raises(Exception, match="are a whole model, but this engine serves a LoRA adapter"):
        asyncio.run(receiver.apply(publisher.publish(adapter(1), version=1), scripted(adapter=True)))
    full = scripted(adapter=False)
    with pytest.raises(Exception, match="are a LoRA adapter, but this engine started without LoRA"):
        asyncio.run(receiver.apply(publish(publisher, adapter(1), 2), full))
    assert full.loaded == {} and full.version == 0


def test_tensors_that_are_not_an_adapters_are_refused_and_the_last_version_stays(channel):
    publisher, receiver = channel
    engine = scripted(adapter=True)
    asyncio.run(receiver.apply(publish(publisher, adapter(1), 1), engine))
    bad = {**adapter(2), "model.layers.0.mlp.up_proj.weight": torch.zeros(4, 4)}
    with pytest.raises(Exception, match=r"1 tensors are not a LoRA adapter's .*up_proj\.weight"):
        asyncio.run(receiver.apply(publish(publisher, bad, 2), engine))
    assert stash(engine).current[2] == 1 and engine.version == 1


def test_an_adapter_missing_a_tensor_never_becomes_the_current_one():
    """The stash's own rule, as a channel that delivered part of a version would reach it."""
    from types import SimpleNamespace

    box = AdapterStash()
    tensors = adapter(1)
    manifest = [SimpleNamespace(name=name) for name in tensors]
    box.begin(SimpleNamespace(adapter=SPEC, version=5, manifest=manifest))
    box.load_weights(list(tensors.items())[:-1])
    with pytest.raises(ValueError, match="weights v5: 1 adapter tensors never arrived"):
        box.received()
    assert box.current is None
    with pytest.raises(ValueError, match="is not in its announcement"):
        box.load_weights([("base_model.model.x.lora_A.weight", torch.zeros(1))])


def manifest_of(tensors: dict) -> list:
    from types import SimpleNamespace

    return [SimpleNamespace(name=name, shape=tuple(t.shape)) for name, t in tensors.items()]


def test_an_adapter_is_checked_against_the_served_rank_modules_and_shapes():
    """The rule the engine applies from an announcement (its modules read from vLLM's layers in
    tests/integration/test_lora_engine.py), here over a model of two layers of 32 features."""
    from tidal.actor.adapter import Served

    served = Served(
        max_rank=4,
        features={f"model.layers.{i}.self_attn.{m}": (32, 32) for i in range(2) for m in ("q_proj", "v_proj")},
    )
    good = adapter(1)
    assert served.problem(SPEC, manifest_of(good)) is None
    wide = msgspec.structs.replace(SPEC, rank=8)
    assert "rank 8, above the engine's max_lora_rank 4" in served.problem(wide, manifest_of(good))
    narrow = msgspec.structs.replace(SPEC, rank=2)  # tensors of rank 4 announced as rank 2
    assert "is [4, 32], not [2, 32]" in served.problem(narrow, manifest_of(good))
    other_base = {k: torch.zeros(v.shape[0], 48) if "lora_A" in k else v for k, v in good.items()}
    assert "another base model" in served.problem(SPEC, manifest_of(other_base))
    extra = {**good, "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)}
    assert "a module the served model lacks (model.layers.7.self_attn.q_proj)" in served.problem(
        SPEC, manifest_of(extra)
    )


def test_an_adapter_that_fails_to_install_puts_the_one_before_back():
    from types import SimpleNamespace

    box, installed = AdapterStash(), []

    def install(manager):
        version = box.current[2] if box.current is not None else -1
        if version == 2:
            raise RuntimeError("no room")
        installed.append(version)
        return version

    box._install = install
    for version in (1, 2):
        tensors = adapter(version)
        box.begin(SimpleNamespace(adapter=SPEC, version=version, manifest=manifest_of(tensors)))
        box.load_weights(tensors.items())
        box.received()
        if version == 1:
            assert box.install(None) == 1
    with pytest.raises(RuntimeError, match=r"the adapter of weights v2 did not install \(no room\); v1 serves on"):
        box.install(None)
    assert installed == [1, 1] and box.current[2] == 1
