"""The file weight channel: what the learner publishes reaches the engine exactly; an announcement
pointing outside weights.dir (a path or a link that leads out) is refused before anything is read."""

import asyncio
import os

import pytest
import torch

from conftest import ALPHABET, TINY, ScriptedEngine
from tidal.broker.weights import build_publisher, build_receiver
from tidal.broker.weights.base import split_buckets
from tidal.broker.weights.file import read_manifest
from tidal.config import WeightsConfig
from tidal.tiny import build_tiny_model


@pytest.fixture
def published(tmp_path):
    model, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    cfg = WeightsConfig(dir=str(tmp_path / "weights"))
    update = build_publisher(cfg, "inc", "run", str(tmp_path)).publish(model.state_dict(), version=3)
    return cfg, update, model, tokenizer


def test_published_weights_reach_the_engine_exactly(published):
    cfg, update, model, tokenizer = published
    engine = ScriptedEngine(tokenizer)
    asyncio.run(build_receiver(cfg).apply(update, engine))
    assert engine.version == 3
    assert all(torch.equal(engine.loaded[k], v) for k, v in model.state_dict().items())


def forged(update, location):
    """The same announcement with another location, and checksums and manifest matching that file."""
    import msgspec

    return msgspec.structs.replace(
        update,
        location=str(location),
        manifest=read_manifest(location),
        buckets=split_buckets(memoryview(open(location, "rb").read()), 4096),
    )


def test_a_location_outside_weights_dir_is_refused(published, tmp_path):
    cfg, update, _, tokenizer = published
    evil = tmp_path / "evil.safetensors"
    evil.write_bytes(open(update.location, "rb").read())
    engine = ScriptedEngine(tokenizer)
    for location in (tmp_path / "weights" / ".." / "evil.safetensors", evil):
        with pytest.raises(ValueError, match="outside weights.dir"):
            asyncio.run(build_receiver(cfg).apply(forged(update, location), engine))
    link = tmp_path / "weights" / "link.safetensors"
    os.symlink(evil, link)  # inside the folder by name, outside by where it leads
    with pytest.raises(ValueError, match="outside weights.dir"):
        asyncio.run(build_receiver(cfg).apply(forged(update, link), engine))
    assert engine.swaps == []


def test_a_damaged_range_of_the_file_is_refused_by_name(published):
    cfg, update, _, tokenizer = published
    import msgspec

    update = forged(update, update.location)  # 4 KiB ranges: the tiny model's file has several
    size = os.path.getsize(update.location)
    with open(update.location, "r+b") as f:
        f.seek(size - 10)
        byte = f.read(1)
        f.seek(size - 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    last = len(update.buckets) - 1
    engine = ScriptedEngine(tokenizer)
    with pytest.raises(ValueError, match=rf"\(range {last}\) have sha256 .*: altered or damaged, refused"):
        asyncio.run(build_receiver(cfg).apply(update, engine))
    with pytest.raises(ValueError, match="carries no digests"):
        asyncio.run(build_receiver(cfg).apply(msgspec.structs.replace(update, buckets=[]), engine))
    assert engine.swaps == []


class TwoLayers(torch.nn.Module):
    """A model with vLLM's `load_weights` contract: copies what it is given, returns the names loaded."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)

    def load_weights(self, weights) -> set[str]:
        params, loaded = dict(self.named_parameters()), set()
        for name, tensor in weights:  # once: like vLLM's loader, it may be handed an iterator
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


def test_a_model_with_its_weights_in_place_takes_an_update_by_copies_and_a_short_one_is_refused():
    from tidal.broker.weights.base import load_into_model, weight_layout

    model, source = TwoLayers(), TwoLayers()
    assert weight_layout(model) == "copy"
    assert load_into_model(model, list(source.state_dict().items()), model_config=None) == "copy"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), source.parameters()))
    short = [(k, v) for k, v in source.state_dict().items() if not k.startswith("b.")]
    with pytest.raises(ValueError, match=r"left 2 parameters .* unloaded \(e.g. \['b.bias', 'b.weight'\]\)"):
        load_into_model(model, short, model_config=None)
    model.b.weight = torch.nn.Parameter(torch.empty(0))  # what a kernel with a layout of its own leaves behind
    assert weight_layout(model) == "reload"


def test_copies_from_one_payload_layout_are_recorded_once_and_replayed_exactly():
    from tidal.broker.weights import base
    from tidal.broker.weights.payload import pack, tensors_of

    def load(model, state) -> str:
        payload, manifest = pack(state)
        key = tuple((s.name, s.offset) for s in manifest)
        return base.load_into_model(model, tensors_of(manifest, payload), None, payload=payload, key=key)

    base._plan = None
    model, first, second = TwoLayers(), TwoLayers(), TwoLayers()
    assert load(model, first.state_dict()) == "copy"
    assert load(model, second.state_dict()) == "replay"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), second.parameters()))

    class Scaling(TwoLayers):  # a loader that changes a weight after copying it: nothing to replay
        def load_weights(self, weights):
            loaded = super().load_weights(weights)
            self.a.weight.data.mul_(2)
            return loaded

    base._plan = None
    scaled = Scaling()
    assert [load(scaled, first.state_dict()), load(scaled, second.state_dict())] == ["copy", "copy"]
    assert torch.equal(scaled.a.weight, 2 * second.a.weight) and torch.equal(scaled.b.weight, second.b.weight)


@pytest.mark.parametrize("transport", ["file", "tcp"])
def test_the_version_the_actors_are_told_of_stays_whatever_keep_says(tmp_path, transport):
    """An evaluation holds newer announcements back while the learner publishes on: the announced version
    outlives `keep` (an actor that was away must still load it), and goes once another is announced."""
    publisher = build_publisher(WeightsConfig(transport=transport, dir=str(tmp_path), keep=2), "inc", "run", "/unused")

    def available() -> list[int]:
        if transport == "file":
            return sorted(int(p.stem.split("-v")[1]) for p in tmp_path.glob("weights-v*.safetensors"))
        return sorted(publisher.server.versions)

    try:
        for version in range(1, 6):
            publisher.publish({"w": torch.full((4,), float(version))}, version)
            if version == 2:
                publisher.retain(2)  # announced; 3, 4 and 5 are held back
        assert available() == [2, 4, 5]
        publisher.retain(5)
        publisher.publish({"w": torch.zeros(4)}, 6)
        assert available() == [5, 6]
    finally:
        publisher.close()
