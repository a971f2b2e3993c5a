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

    return msgspec.structs.replace(update, location=str(location), manifest=read_manifest(location),
                                   buckets=split_buckets(memoryview(open(location, "rb").read()), 4096))


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
    with pytest.raises(ValueError, match=rf"\(range {last}\) have crc32 .*: damaged, refused"):
        asyncio.run(build_receiver(cfg).apply(update, engine))
    with pytest.raises(ValueError, match="carries no checksums"):
        asyncio.run(build_receiver(cfg).apply(msgspec.structs.replace(update, buckets=[]), engine))
    assert engine.swaps == []
