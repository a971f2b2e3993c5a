"""The collective weight channel over gloo (NCCL's code path, on CPU): each worker forms a process
group with the learner and receives every version by broadcast, exactly; a refused version, a
damaged bucket, a learner gone or a new learner process are named and leave the engine's weights
whole; a worker process killed mid-transfer fails only its own group."""
import asyncio
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import torch

from conftest import ScriptedEngine, served_weights, weights_config
from tidal.broker.schema import WeightUpdate
from tidal.broker.weights import build_publisher, build_receiver, collective
from tidal.broker.weights.tcp import tensors_of
from tidal.config import WeightsConfig


def config(**keys) -> WeightsConfig:
    return weights_config("gloo", **keys)


@pytest.fixture
def served():
    yield from served_weights("gloo")
    collective.leave()


@pytest.mark.parametrize("prefetch", [True, False])
def test_versions_reach_the_engine_by_broadcast_into_one_reused_buffer(served, prefetch):
    """Prefetch: received in a worker thread before the pause, loaded in it. No prefetch: both in it."""
    publisher, update, state, tokenizer = served
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(config(tcp_prefetch=prefetch))
    assert update.transport == "gloo" and len(update.buckets) > 1
    asyncio.run(receiver.apply(update, engine))
    assert engine.swaps == [3] and engine.loaded.keys() == state.keys()
    assert all(torch.equal(engine.loaded[k], v) for k, v in state.items())
    member = collective._members[update.location]
    buffer = member.buffer
    moved = {k: v + 1 for k, v in state.items()}
    asyncio.run(receiver.apply(publisher.publish(moved, version=4), engine))
    assert engine.swaps == [3, 4] and all(torch.equal(engine.loaded[k], v) for k, v in moved.items())
    assert collective._members == {update.location: member} and member.buffer is buffer  # one group, one buffer


def test_a_refused_or_damaged_version_names_why_and_the_group_carries_on(served):
    publisher, update, state, tokenizer = served
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(config())
    asyncio.run(receiver.apply(update, engine))
    member = collective._members[update.location]
    with pytest.raises(ValueError, match=r"weights v9 .* by gloo: refused by the learner: version 9 is not served "
                                         r"here \(served: \[3\]\)"):
        asyncio.run(receiver.apply(msgspec.structs.replace(update, version=9), engine))
    moved = publisher.publish({k: v + 1 for k, v in state.items()}, version=4)
    bad = [*moved.buckets]
    bad[1] = msgspec.structs.replace(bad[1], crc32=bad[1].crc32 ^ 1)
    with pytest.raises(ValueError, match=r"weights v4 .* damaged in transit, refused \(bucket 1: crc32"):
        asyncio.run(receiver.apply(msgspec.structs.replace(moved, buckets=bad), engine))
    assert engine.swaps == [3] and all(torch.equal(engine.loaded[k], v) for k, v in state.items())
    asyncio.run(receiver.apply(moved, engine))  # every bucket was received: the group is still in step
    assert engine.swaps == [3, 4] and collective._members[update.location] is member


def test_a_learner_gone_is_named_and_a_new_learner_process_gets_a_new_group(served):
    publisher, update, state, tokenizer = served
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(config())
    asyncio.run(receiver.apply(update, engine))
    publisher.close()
    with pytest.raises(ConnectionError, match=rf"weights v3 from the learner at {update.location} by gloo"):
        asyncio.run(receiver.apply(update, engine))
    assert not collective._members and engine.swaps == [3]
    resumed = build_publisher(config(), "inc-2", "run", "/unused")
    try:
        asyncio.run(receiver.apply(resumed.publish(state, version=3), engine))
        assert engine.swaps == [3, 3] and collective._members[resumed.location].learner == (resumed.location, "inc-2")
    finally:
        resumed.close()


def test_a_wrong_transport_or_a_malformed_announcement_is_refused_before_the_pause(served):
    _, update, _, tokenizer = served
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(config())
    with pytest.raises(ValueError, match="weights v3 came by 'tcp'; this actor takes 'gloo'"):
        asyncio.run(receiver.apply(msgspec.structs.replace(update, transport="tcp"), engine))
    with pytest.raises(ValueError, match="bucket 1 starts at byte 4095, expected 4096"):
        bad = [*update.buckets]
        bad[1] = msgspec.structs.replace(bad[1], offset=4095)
        asyncio.run(receiver.apply(msgspec.structs.replace(update, buckets=bad), engine))
    assert engine.swaps == []


def test_nccl_is_refused_by_name_where_there_is_no_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="'weights.transport' = 'nccl' needs CUDA"):
        build_publisher(WeightsConfig(transport="nccl"), "inc", "run", "/unused")


DIES_AFTER_ONE_BUCKET = """
import os, signal, sys
import msgspec
from tidal.broker.schema import WeightUpdate
from tidal.broker.weights import collective
update = msgspec.json.decode(sys.stdin.buffer.read(), type=WeightUpdate)
member = collective.join(update.location, update.incarnation, "gloo", 5.0)
member.conn.sendall(collective.CONTROL.pack(collective.CONTROL_MAGIC, collective.FETCH, update.version))
collective.read_reply(member.conn, "test")
import torch
collective.broadcast(member.group, torch.empty(update.buckets[0].nbytes, dtype=torch.uint8))
print("one bucket in", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_killed_mid_transfer_fails_only_its_own_group(served):
    """A real worker process joins, takes the first of many buckets and is SIGKILLed: the learner's
    thread for it ends, the learner publishes on, and another worker's group receives exactly."""
    publisher, _, state, tokenizer = served
    big = {"w": torch.randn(64, 4096)}  # 1 MiB: 256 buckets, so the kill lands mid-version
    update = publisher.publish(big, version=5)
    worker = subprocess.run([sys.executable, "-c", DIES_AFTER_ONE_BUCKET], input=msgspec.json.encode(update),
                            capture_output=True, timeout=60)
    assert worker.returncode == -signal.SIGKILL and b"one bucket in" in worker.stdout, worker.stderr.decode()[-2000:]
    deadline = time.monotonic() + 10
    while publisher.server.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not publisher.server.connections  # its thread saw the peer gone and let go
    after = publisher.publish(state, version=6)  # the learner was never held up
    received = collective.receive(msgspec.convert(msgspec.to_builtins(after), WeightUpdate), "gloo", 5.0)
    assert all(torch.equal(t, state[name]) for name, t in tensors_of(after.manifest, received))


def split_rows(state: dict, world: int) -> list[dict]:
    """Each of `world` ranks' rows of every tensor, as a sharded learner holds them (torch.chunk on dim 0)."""
    ranks = [{} for _ in range(world)]
    for name, tensor in state.items():
        chunk = -(-tensor.shape[0] // world)
        for rank in range(world):
            rows = tensor[rank * chunk:(rank + 1) * chunk]
            if rows.shape[0]:
                ranks[rank][name] = (rows, rank * chunk)
    return ranks


@pytest.fixture
def two_ranks(served):
    """A second learner rank beside `served`'s publisher: each serves its rows of the tiny model."""
    publisher, _, state, tokenizer = served
    second = build_publisher(config(), "", "run", "/unused", local_rank=1)
    second.bucket_bytes = 4096
    try:
        yield [publisher, second], state, tokenizer
    finally:
        second.close()


def sharded_update(publishers, state: dict, version: int):
    sources = [p.publish_shards(rows, version) for p, rows in zip(publishers, split_rows(state, len(publishers)))]
    return publishers[0].announce(sources, version)


def test_a_sharded_learner_serves_each_ranks_rows_and_the_worker_puts_them_together(two_ranks):
    """No rank publishes the whole model: each serves its rows, the worker forms a group with each
    and receives every part, then loads the whole tensors, version after version."""
    publishers, state, tokenizer = two_ranks
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(config())
    update = sharded_update(publishers, state, 3)
    assert [s.location for s in update.sources] == [p.location for p in publishers] and not update.buckets
    assert sum(len(s.manifest) for s in update.sources) > len(state)  # tensors split between the ranks
    asyncio.run(receiver.apply(update, engine))
    assert engine.swaps == [3] and engine.loaded.keys() == state.keys()
    assert all(torch.equal(engine.loaded[k], v) for k, v in state.items())
    members, assembled = dict(collective._members), collective._assembled
    moved = {k: v * 2 for k, v in state.items()}
    asyncio.run(receiver.apply(sharded_update(publishers, moved, 4), engine))
    assert engine.swaps == [3, 4] and all(torch.equal(engine.loaded[k], v) for k, v in moved.items())
    assert collective._members == members and collective._assembled is assembled  # kept across versions


def test_pieces_that_do_not_make_the_whole_or_a_damaged_part_are_refused_by_name(two_ranks):
    publishers, state, tokenizer = two_ranks
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(config())
    update = sharded_update(publishers, state, 3)
    first, second = update.sources
    gap = msgspec.structs.replace(second, manifest=second.manifest[1:])  # rank 1's rows of one tensor missing
    missing = second.manifest[0].name
    with pytest.raises(ValueError, match=rf"weights v3: the pieces of '{missing}' \(rows from \[0\]\) do not cover"):
        asyncio.run(receiver.apply(msgspec.structs.replace(update, sources=[first, gap]), engine))
    bad = [*second.buckets]
    bad[0] = msgspec.structs.replace(bad[0], crc32=bad[0].crc32 ^ 1)
    damaged = msgspec.structs.replace(update, sources=[first, msgspec.structs.replace(second, buckets=bad)])
    with pytest.raises(ValueError, match=rf"weights v3 from the learner at {second.location} by gloo: damaged"):
        asyncio.run(receiver.apply(damaged, engine))
    assert engine.swaps == []
    asyncio.run(receiver.apply(update, engine))  # both groups stayed in step
    assert engine.swaps == [3] and all(torch.equal(engine.loaded[k], v) for k, v in state.items())
