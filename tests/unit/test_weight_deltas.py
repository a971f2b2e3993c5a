"""`weights.delta`: a version travels as what changed since the one the actor holds, on the tcp and
file channels, and what the engine loads is bit for bit the whole version: a base the actor does not
hold exactly, an actor too far behind or a resumed learner's versions get whole buckets, and a delta
that is not tidal's, or decodes past its bucket, is refused before it is applied."""

import asyncio
import os

import msgspec
import numpy as np
import pytest
import torch
import zstandard

from conftest import ALPHABET, TINY, ScriptedEngine, served_weights, weights_config
from tidal.broker.weights import build_publisher, build_receiver, delta, staging
from tidal.tiny import build_tiny_model


def nudged(state: dict, step: int, every: int = 97) -> dict:
    """`state` after a small update: one word in `every` of each tensor moves, as most do not under a
    small learning rate."""
    out = {}
    for name, tensor in state.items():
        moved = tensor.clone()
        moved.view(-1)[step % every :: every] += 1e-3
        out[name] = moved
    return out


def loaded_exactly(engine, state: dict) -> bool:
    return engine.loaded.keys() == state.keys() and all(torch.equal(engine.loaded[k], v) for k, v in state.items())


@pytest.fixture
def served():
    yield from served_weights("tcp", delta=True)


# ---- the encoding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("size", [4096, 4093])
@pytest.mark.parametrize("form", [delta.SPARSE, delta.PLANES])
def test_a_delta_rebuilds_the_new_bytes_exactly_whatever_the_form_word_width_and_tail(width, size, form):
    """Few words changed are listed; where every word changed a little, its low bytes go together."""
    rng = np.random.default_rng(width)
    base = rng.integers(0, 256, size, dtype=np.uint8)
    new = base.copy()
    if form == delta.SPARSE:
        new[rng.choice(size, size // 50, replace=False)] ^= rng.integers(1, 256, size // 50, dtype=np.uint8)
    else:
        new[:: max(width, 1)] ^= rng.integers(1, 4, len(new[:: max(width, 1)]), dtype=np.uint8)  # every low byte
    new[-1] ^= 0x80  # and the tail, where there is one
    encoded = delta.encode(new.data, base.data, width)
    assert encoded is not None and delta.HEADER.unpack_from(encoded)[1] == form
    assert len(encoded) < (0.5 if form == delta.SPARSE or width > 1 else 0.9) * size
    delta.apply(encoded, memoryview(base))
    assert np.array_equal(base, new)


def test_a_bucket_that_does_not_shrink_travels_whole():
    rng = np.random.default_rng(0)
    base, new = (rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(2))
    assert delta.encode(new.data, base.data, 2) is None


def test_a_delta_that_is_not_tidals_or_for_another_size_or_decodes_past_its_bucket_is_refused():
    base = np.zeros(4096, np.uint8)
    new = base.copy()
    new[::64] = 1
    encoded = delta.encode(new.data, base.data, 2)
    with pytest.raises(delta.DeltaError, match="not a delta for these 4095 bytes"):
        delta.apply(encoded, memoryview(base[:4095]))
    with pytest.raises(delta.DeltaError, match="magic"):
        delta.apply(b"XXXX" + encoded[4:], memoryview(base))
    with pytest.raises(delta.DeltaError, match="shorter than its header"):
        delta.apply(b"TD", memoryview(base))
    planes = delta.HEADER.pack(delta.MAGIC, delta.PLANES, 2, 4096, 0)
    bomb = planes + zstandard.ZstdCompressor().compress(bytes(1 << 24))
    unsized = planes + zstandard.ZstdCompressor(write_content_size=False).compress(bytes(4096))
    past = delta.HEADER.pack(delta.MAGIC, delta.SPARSE, 2, 4096, 1) + zstandard.ZstdCompressor().compress(
        np.array([2048], "<u4").tobytes() + b"\x01\x00"
    )  # word 2048 of 2048
    crowded = delta.HEADER.pack(delta.MAGIC, delta.SPARSE, 2, 4096, 2048)  # every word listed: never encoded so
    for refused in (bomb, unsized, past, crowded + b"\x00" * 64, encoded[:-3]):
        with pytest.raises(delta.DeltaError):
            delta.apply(refused, memoryview(base))
    assert not base.any()  # nothing applied


# ---- tcp --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [True, False])
def test_tcp_sends_what_changed_and_the_engine_loads_the_whole_version_exactly(served, prefetch):
    publisher, update, state, tokenizer = served
    receiver = build_receiver(weights_config("tcp", tcp_prefetch=prefetch, delta=True))
    engine = ScriptedEngine(tokenizer)
    asyncio.run(receiver.apply(update, engine))
    whole = publisher.server.sent["whole"]
    assert whole == sum(b.nbytes for b in update.buckets) and publisher.server.sent["delta"] == 0
    for version in (4, 5):
        state = nudged(state, version)
        asyncio.run(receiver.apply(publisher.publish(state, version=version), engine))
        assert loaded_exactly(engine, state)
    sent = publisher.server.sent
    assert sent["whole"] == whole and 0 < sent["delta"] < 0.25 * 2 * whole  # both versions as deltas, small
    assert engine.swaps == [3, 4, 5]


def test_a_base_the_actor_does_not_hold_exactly_is_fetched_whole_and_loads_exactly(served):
    publisher, update, state, tokenizer = served
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(weights_config("tcp"))
    asyncio.run(receiver.apply(update, engine))
    receiver.staging[engine].buffer[5000] ^= 0xFF  # the staged copy of v3 damaged in bucket 1
    state = nudged(state, 4)
    asyncio.run(receiver.apply(publisher.publish(state, version=4), engine))
    assert loaded_exactly(engine, state)
    total = sum(b.nbytes for b in update.buckets)
    assert receiver.received.refetched == 1 and receiver.received.whole == total + 4096  # v4's bucket 1, whole


def test_an_actor_too_far_behind_or_of_another_learner_gets_whole_versions(served):
    publisher, update, state, tokenizer = served
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(weights_config("tcp"))
    asyncio.run(receiver.apply(update, engine))
    total = sum(b.nbytes for b in update.buckets)
    for version in (4, 5, 6):  # keep=3: v3 is no longer served when v6 is
        state = nudged(state, version)
        latest = publisher.publish(state, version=version)
    asyncio.run(receiver.apply(latest, engine))
    assert loaded_exactly(engine, state) and receiver.received.whole == 2 * total and receiver.received.delta == 0
    resumed = msgspec.structs.replace(publisher.publish(nudged(state, 7), version=7), incarnation="resumed")
    assert receiver.staging[engine].base_for(resumed) == delta.NO_BASE  # a resumed learner counts versions again
    asyncio.run(receiver.apply(resumed, engine))
    assert receiver.received.whole == 3 * total and receiver.received.delta == 0


def test_with_deltas_off_the_learner_sends_whole_buckets():
    served = served_weights("tcp")
    publisher, update, state, tokenizer = next(served)
    try:
        engine, receiver = ScriptedEngine(tokenizer), build_receiver(weights_config("tcp"))
        asyncio.run(receiver.apply(update, engine))
        state = nudged(state, 4)
        asyncio.run(receiver.apply(publisher.publish(state, version=4), engine))  # the actor names v3 all the same
        assert loaded_exactly(engine, state) and publisher.server.sent["delta"] == 0
    finally:
        served.close()


# ---- file -------------------------------------------------------------------------------------------


@pytest.fixture
def file_channel(tmp_path):
    model, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    cfg = weights_config("file", dir=str(tmp_path / "weights"), delta=True, bucket_mib=1)
    publisher = build_publisher(cfg, "inc", "run", str(tmp_path))
    publisher.bucket_bytes = 4096
    return publisher, build_receiver(cfg), model.state_dict(), tokenizer


def test_the_file_channel_writes_a_delta_beside_each_version_and_the_engine_loads_it_exactly(file_channel):
    publisher, receiver, state, tokenizer = file_channel
    engine = ScriptedEngine(tokenizer)
    first = publisher.publish(state, version=1)
    assert first.delta_of == -1 and first.delta_parts == []
    asyncio.run(receiver.apply(first, engine))
    state = nudged(state, 2)
    second = publisher.publish(state, version=2)
    assert second.delta_of == 1 and len(second.delta_parts) == len(second.buckets)
    asyncio.run(receiver.apply(second, engine))
    assert loaded_exactly(engine, state)
    total = sum(b.nbytes for b in first.buckets)
    assert receiver.received.whole == total and 0 < receiver.received.delta < 0.25 * total


def loaded_then_nudged(file_channel):
    """(engine, receiver, the nudged state, its announcement): v1 loaded, v2 published beside its delta."""
    publisher, receiver, state, tokenizer = file_channel
    engine = ScriptedEngine(tokenizer)
    asyncio.run(receiver.apply(publisher.publish(state, version=1), engine))
    state = nudged(state, 2)
    return engine, receiver, state, publisher.publish(state, version=2)


def test_a_damaged_delta_file_or_base_is_read_whole_and_loads_exactly(file_channel):
    engine, receiver, state, second = loaded_then_nudged(file_channel)
    with open(second.delta_location, "r+b") as f:  # a writer of the folder alters bucket 0's delta
        f.seek(second.delta_parts[0].offset + 20)
        f.write(b"\x00\x01\x02")
    receiver.staging[engine].buffer[9000] ^= 0xFF  # and the staged base is damaged in bucket 2
    asyncio.run(receiver.apply(second, engine))
    assert loaded_exactly(engine, state) and receiver.received.refetched == 2


def test_an_actor_that_missed_the_base_reads_the_whole_file(file_channel):
    publisher, receiver, state, tokenizer = file_channel
    engine = ScriptedEngine(tokenizer)
    asyncio.run(receiver.apply(publisher.publish(state, version=1), engine))
    publisher.publish(nudged(state, 2), version=2)  # this actor does not load v2
    state = nudged(state, 3)
    third = publisher.publish(state, version=3)
    assert third.delta_of == 2
    asyncio.run(receiver.apply(third, engine))
    assert loaded_exactly(engine, state) and receiver.received.delta == 0
    assert staging.orphaned_staging() == []


def test_a_delta_file_that_is_gone_is_read_around_and_the_version_loads_whole(file_channel):
    engine, receiver, state, second = loaded_then_nudged(file_channel)
    os.unlink(second.delta_location)
    asyncio.run(receiver.apply(second, engine))
    assert loaded_exactly(engine, state) and receiver.received.delta == 0


def test_an_encoding_another_connection_never_finishes_is_not_waited_for():
    """A handler waits for another's encoding of its bucket at most a while, then sends it whole."""
    from tidal.broker.weights.tcp import DeltaCache

    cache = DeltaCache()
    cache.claim((2, 1, 0))  # claimed, never filled
    assert cache.get((2, 1, 0), lambda: b"never", wait_s=0.01) is None
    assert cache.get((2, 1, 1), lambda: b"made", wait_s=0.01) == b"made"
