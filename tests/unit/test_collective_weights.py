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
    member, buffer = collective._member, collective._member.buffer
    moved = {k: v + 1 for k, v in state.items()}
    asyncio.run(receiver.apply(publisher.publish(moved, version=4), engine))
    assert engine.swaps == [3, 4] and all(torch.equal(engine.loaded[k], v) for k, v in moved.items())
    assert collective._member is member and member.buffer is buffer  # one group, one buffer, for every version


def test_a_refused_or_damaged_version_names_why_and_the_group_carries_on(served):
    publisher, update, state, tokenizer = served
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(config())
    asyncio.run(receiver.apply(update, engine))
    member = collective._member
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
    assert engine.swaps == [3, 4] and collective._member is member


def test_a_learner_gone_is_named_and_a_new_learner_process_gets_a_new_group(served):
    publisher, update, state, tokenizer = served
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(config())
    asyncio.run(receiver.apply(update, engine))
    publisher.close()
    with pytest.raises(ConnectionError, match=rf"weights v3 from the learner at {update.location} by gloo"):
        asyncio.run(receiver.apply(update, engine))
    assert collective._member is None and engine.swaps == [3]
    resumed = build_publisher(config(), "inc-2", "run", "/unused")
    try:
        asyncio.run(receiver.apply(resumed.publish(state, version=3), engine))
        assert engine.swaps == [3, 3] and collective._member.learner == (resumed.location, "inc-2")
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
member = collective.join(update, "gloo", 5.0)
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
