"""The tcp weight channel's data plane: what the learner serves reaches the engine exactly, bucket
by bucket; a damaged, short or cut bucket and an unreachable learner are refused with errors that
name the version and the address, and the engine keeps its weights."""

import asyncio
import hashlib
import os

import msgspec
import pytest
import torch

from conftest import DyingWeightServer, ScriptedEngine, served_weights, weights_config
from tidal.actor.loop import Actor
from tidal.broker.weights import build_receiver, payload, server, staging, tcp
from tidal.config import ActorConfig, WeightsConfig


def config(**keys) -> WeightsConfig:
    return weights_config("tcp", **keys)


@pytest.fixture
def served():
    yield from served_weights("tcp")


def staged_files() -> set:
    return set(staging.staging_dir().glob(f"tidal-weights-{os.getpid()}-*"))


@pytest.mark.parametrize("prefetch", [True, False])
def test_published_weights_reach_the_engine_exactly(served, prefetch):
    _, update, state, tokenizer = served
    engine = ScriptedEngine(tokenizer)
    asyncio.run(build_receiver(config(tcp_prefetch=prefetch)).apply(update, engine))
    assert engine.version == 3 and engine.swaps == [3]
    assert engine.loaded.keys() == state.keys()
    assert all(torch.equal(engine.loaded[k], v) for k, v in state.items())
    assert staged_files() == set()  # the prefetched payload is gone once loaded


def test_later_versions_reuse_the_staging_map_and_a_failed_fetch_spoils_none(served):
    """The workers map the staging file once; its name is gone after the first load, and a fetch
    that fails half-way into the reused buffer leaves the engine, and the next version, whole."""
    publisher, update, state, tokenizer = served
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(config())
    asyncio.run(receiver.apply(update, engine))
    mapped = staging._worker_map[1]
    assert staged_files() == set()
    moved = {k: v + 1 for k, v in state.items()}
    dying = DyingWeightServer(publisher.server.versions[3].view, update.buckets, cut_at=2, sent=1000)
    with pytest.raises(ConnectionError, match="connection closed after 1000 of 4096 bytes"):
        asyncio.run(receiver.apply(msgspec.structs.replace(update, version=4, location=dying.location), engine))
    asyncio.run(receiver.apply(publisher.publish(moved, version=5), engine))
    assert engine.swaps == [3, 5] and staging._worker_map[1] is mapped
    assert all(torch.equal(engine.loaded[k], v) for k, v in moved.items())


def test_buckets_tile_the_payload_and_each_carries_its_sha256(served):
    publisher, update, state, _ = served
    view = publisher.server.versions[3].view
    total = payload.payload_bytes(update)
    assert len(view) == total >= sum(t.numel() * t.element_size() for t in state.values())
    assert len(update.buckets) == -(-total // 4096) > 1
    assert [b.offset for b in update.buckets] == list(range(0, total, 4096))
    assert all(b.sha256 == hashlib.sha256(view[b.offset : b.offset + b.nbytes]).digest() for b in update.buckets)
    assert all(spec.offset % payload.ALIGN_BYTES == 0 for spec in update.manifest)
    assert publisher.publish(state, version=4).buckets == update.buckets  # padding included: same bytes, same digests
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(update), type=type(update))
    assert decoded.buckets == update.buckets  # the bucket table travels in the announcement


def test_a_damaged_bucket_is_refused_and_the_engine_keeps_its_weights(served):
    _, update, _, tokenizer = served
    buckets = list(update.buckets)
    buckets[2] = msgspec.structs.replace(buckets[2], sha256=bytes(32))
    engine = ScriptedEngine(tokenizer)
    with pytest.raises(
        ValueError,
        match=r"weights v3 bucket 2 from 127\.0\.0\.1:\d+: .* have sha256 .* altered or "
        r"damaged in transit, refused",
    ):
        asyncio.run(build_receiver(config()).apply(msgspec.structs.replace(update, buckets=buckets), engine))
    assert engine.swaps == [] and engine.version == 0
    assert staged_files() == set()


def test_an_announcement_whose_tensors_leave_the_payload_is_refused_before_any_fetch(served):
    _, update, _, tokenizer = served
    manifest = list(update.manifest)
    manifest[0] = msgspec.structs.replace(manifest[0], offset=payload.payload_bytes(update))
    with pytest.raises(ValueError, match=f"tensor {manifest[0].name!r} .* does not fit"):
        asyncio.run(
            build_receiver(config(tcp_prefetch=False)).apply(
                msgspec.structs.replace(update, manifest=manifest), ScriptedEngine(tokenizer)
            )
        )


def test_a_learner_that_is_gone_is_named_with_the_version(served):
    publisher, update, _, tokenizer = served
    publisher.close()
    engine = ScriptedEngine(tokenizer)
    with pytest.raises(ConnectionError, match=rf"weights v3 from the learner at {update.location}: .*refused"):
        asyncio.run(build_receiver(config()).apply(update, engine))
    assert engine.swaps == []


def test_a_version_no_longer_served_is_refused_by_the_learner(served):
    publisher, update, state, tokenizer = served
    for version in (4, 5, 6):  # keep = 3: version 3 is dropped
        publisher.publish(state, version)
    with pytest.raises(ValueError, match=r"version 3 is not served here \(versions served: \[4, 5, 6\]\)"):
        asyncio.run(build_receiver(config()).apply(update, ScriptedEngine(tokenizer)))


def test_a_learner_that_dies_mid_transfer_is_named_with_the_progress(served):
    publisher, update, _, tokenizer = served
    server = DyingWeightServer(publisher.server.versions[3].view, update.buckets, cut_at=2, sent=1000)
    moved = msgspec.structs.replace(update, location=server.location)
    engine = ScriptedEngine(tokenizer)
    with pytest.raises(
        ConnectionError,
        match=rf"weights v3 from the learner at {server.location}: connection "
        r"closed after 1000 of 4096 bytes \(after 2 of \d+ buckets\)",
    ):
        asyncio.run(build_receiver(config()).apply(moved, engine))
    assert engine.swaps == [] and staged_files() == set()


def test_a_bucket_shorter_than_announced_is_refused(served):
    publisher, update, _, tokenizer = served
    server = DyingWeightServer(publisher.server.versions[3].view, update.buckets, cut_at=1, sent=100, announced=100)
    moved = msgspec.structs.replace(update, location=server.location)
    with pytest.raises(ValueError, match="bucket 1 .* sends 100 bytes, the announcement says 4096: refused"):
        asyncio.run(build_receiver(config()).apply(moved, ScriptedEngine(tokenizer)))


def test_the_actor_loop_survives_a_failed_load_and_takes_the_next_version(served):
    publisher, update, state, tokenizer = served
    engine = ScriptedEngine(tokenizer)
    actor = Actor(ActorConfig(), engine, transport=None, receiver=build_receiver(config()))
    actor.note_announcement(msgspec.structs.replace(update, location="127.0.0.1:1"))  # nothing listens there
    assert asyncio.run(actor.load_newest(tolerate=False)) is False
    assert actor.stats["weight_load_failures"] == 1 and engine.version == 0
    actor.note_announcement(publisher.publish(state, version=4))
    assert asyncio.run(actor.load_newest(tolerate=False)) is True and engine.version == 4


def test_an_unknown_transport_names_the_key():
    with pytest.raises(ValueError, match="'weights.transport' = 'tpc': expected one of file, tcp, gloo, nccl"):
        build_receiver(WeightsConfig(transport="tpc"))
    with pytest.raises(ValueError, match="'weights.bucket_mib' = 0: must be >= 1"):
        build_receiver(config(bucket_mib=0))


def test_an_actor_that_dies_or_stalls_mid_transfer_holds_up_neither_the_learner_nor_other_actors(served):
    import socket

    publisher, update, state, tokenizer = served
    host, port = server.parse_location(update.location)
    stalled = socket.create_connection((host, port))  # asks for a bucket and never reads it
    stalled.sendall(tcp.bucket_request(update.token, 3, 0))
    dying = socket.create_connection((host, port))  # reads a few bytes of a bucket, then is killed
    dying.sendall(tcp.bucket_request(update.token, 3, 1))
    dying.recv(16)
    dying.close()
    later = publisher.publish(state, version=4)  # the learner's next push does not wait for either
    engine = ScriptedEngine(tokenizer)
    asyncio.run(build_receiver(config()).apply(later, engine))  # another actor gets the new version whole
    assert engine.swaps == [4] and all(torch.equal(engine.loaded[k], v) for k, v in state.items())
    stalled.close()


def test_weights_staged_by_a_dead_actor_are_swept_and_a_live_ones_kept():
    import subprocess

    from tidal.ops.launcher import sweep_orphan_shm

    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid now names no process
    dead = staging.staging_dir() / f"{staging.STAGED_PREFIX}{gone.pid}-0123abcd.bin"
    live = staging.staging_dir() / f"{staging.STAGED_PREFIX}{os.getpid()}-0123abcd.bin"
    for path in (dead, live):
        path.write_bytes(b"weights")
    try:
        orphans = staging.orphaned_staging()
        assert dead in orphans and live not in orphans
        sweep_orphan_shm()
        assert not dead.exists() and live.exists()
    finally:
        dead.unlink(missing_ok=True)
        live.unlink(missing_ok=True)
