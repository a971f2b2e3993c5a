"""The collective weight channel over gloo (the nccl channel's control plane, with host memory):
an actor's engine joins the learner once, forms its group, and receives each version through it by
broadcast, a bucket of whole tensors at a time, loaded as it lands; a refused version leaves the
group in step; a damaged bucket or a learner gone mid-transfer leaves the engine torn (paused) until
a whole version loads; a worker killed mid-transfer costs only its own group."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import msgspec
import pytest
import torch

from conftest import ScriptedEngine, served_weights, weights_config
from tidal.broker.weights import build_publisher, build_receiver, collective, gloo, server
from tidal.config import WeightsConfig

TIMEOUT_S = 2.0  # a transfer stalled this long is given up: the tests of failures wait for it


def config(**keys) -> WeightsConfig:
    return weights_config("gloo", **{"tcp_timeout_s": TIMEOUT_S, **keys})


@pytest.fixture
def served():
    yield from served_weights("gloo", tcp_timeout_s=TIMEOUT_S)


def test_versions_reach_the_engine_by_broadcast_through_one_group(served):
    publisher, update, state, tokenizer = served
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(config())
    assert update.transport == "gloo" and len(update.buckets) > 1
    specs = {s.name: s for s in update.manifest}
    for bucket in update.buckets:  # whole tensors in each, so each loads as it lands
        inside = [s for s in update.manifest if bucket.offset <= s.offset < bucket.offset + bucket.nbytes]
        assert inside and all(s.offset + s.nbytes <= bucket.offset + bucket.nbytes for s in inside)
    assert sum(b.nbytes for b in update.buckets) >= sum(s.nbytes for s in specs.values())
    asyncio.run(receiver.apply(update, engine))
    assert "lm_head.weight" in state and engine.loaded.keys() == state.keys()  # tied: under both names
    assert engine.swaps == [3] and all(torch.equal(engine.loaded[k], state[k]) for k in engine.loaded)
    member, conn = engine.worker.member, receiver.conn
    moved = {k: v + 1 for k, v in state.items()}
    asyncio.run(receiver.apply(publisher.publish(moved, version=4), engine))
    assert engine.swaps == [3, 4] and all(torch.equal(engine.loaded[k], moved[k]) for k in engine.loaded)
    assert engine.worker.member is member and receiver.conn is conn  # formed once, kept across versions
    assert len(publisher.server.groups) == 1


def test_a_refused_version_leaves_the_group_in_step_and_a_damaged_one_leaves_the_engine_torn(served):
    publisher, update, state, tokenizer = served
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(config())
    asyncio.run(receiver.apply(update, engine))
    member = engine.worker.member
    with pytest.raises(
        ValueError,
        match=r"weights v9 .* by gloo: refused by the learner: version 9 is not served "
        r"here \(served: \[3\]\)",
    ):
        asyncio.run(receiver.apply(msgspec.structs.replace(update, version=9), engine))
    assert engine.worker.member is member and not engine.torn  # nothing moved: the group carries on
    moved = publisher.publish({k: v + 1 for k, v in state.items()}, version=4)
    bad = [*moved.buckets]
    bad[1] = msgspec.structs.replace(bad[1], sha256=bytes(32))
    with pytest.raises(ConnectionError, match=r"weights v4 .* bucket 1: .* have sha256 .* damaged in transit, refused"):
        asyncio.run(receiver.apply(msgspec.structs.replace(moved, buckets=bad), engine))
    assert engine.swaps == [3] and engine.torn  # bucket 0 was loaded: paused until a whole version is in
    asyncio.run(receiver.apply(moved, engine))  # joins again: a new group
    assert engine.swaps == [3, 4] and not engine.torn
    assert all(torch.equal(engine.loaded[k], state[k] + 1) for k in engine.loaded)


def test_a_learner_gone_mid_transfer_tears_the_engine_and_a_new_learner_process_makes_it_whole(served, monkeypatch):
    publisher, update, state, tokenizer = served
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(config())

    def dies_after_one_bucket(self, group, served, progress):  # the learner's process ends mid-version
        gloo.broadcast(group.group, served.payload[: served.buckets[0].nbytes])
        group.abort()

    monkeypatch.setattr(gloo.GlooPlane, "send", dies_after_one_bucket)
    with pytest.raises(ConnectionError, match=rf"weights v3 from the learner at {update.location} by gloo"):
        asyncio.run(receiver.apply(update, engine))
    assert engine.torn and engine.swaps == [] and receiver.conn is None
    monkeypatch.undo()
    publisher.close()
    resumed = build_publisher(config(), "inc-2", "run", "/unused")
    try:
        asyncio.run(receiver.apply(resumed.publish(state, version=3), engine))
        assert engine.swaps == [3] and not engine.torn and receiver.learner == (resumed.location, "inc-2")
        assert all(torch.equal(engine.loaded[k], state[k]) for k in engine.loaded)
    finally:
        resumed.close()


def test_a_wrong_transport_or_a_malformed_announcement_is_refused_before_the_pause(served):
    _, update, _, tokenizer = served
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(config())
    with pytest.raises(ValueError, match="weights v3 came by 'tcp'; this actor takes 'gloo'"):
        asyncio.run(receiver.apply(msgspec.structs.replace(update, transport="tcp"), engine))
    bad = [*update.buckets]
    bad[1] = msgspec.structs.replace(bad[1], offset=bad[1].offset - 1)
    with pytest.raises(ValueError, match=f"bucket 1 starts at byte {bad[1].offset}, expected {bad[1].offset + 1}"):
        asyncio.run(receiver.apply(msgspec.structs.replace(update, buckets=bad), engine))
    assert engine.swaps == [] and receiver.conn is None


def test_nccl_is_refused_by_name_where_there_is_no_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="'weights.transport' = 'nccl' needs CUDA"):
        build_publisher(WeightsConfig(transport="nccl"), "inc", "run", "/unused")


DIES_AFTER_ONE_BUCKET = """
import json, os, signal, socket, sys, types
import msgspec, torch
from tidal.broker.schema import WeightUpdate
from tidal.broker.weights import collective, gloo, server
from tidal.broker.weights.base import InitInfo
update = msgspec.json.decode(sys.stdin.buffer.read(), type=WeightUpdate)
conn = socket.create_connection(server.parse_location(update.location))
conn.sendall(collective.control(update.token, collective.JOIN, 1))
spec = json.loads(server.read_reply(conn, "join"))
worker = types.SimpleNamespace(worker_rank=0, model=None, load_target=None, model_config=None)
member = gloo.GlooPlane.join(worker, InitInfo("gloo", {**spec, "location": update.location,
                                                       "token": update.token.hex()}, 5.0))
conn.sendall(collective.control(update.token, collective.FETCH, update.version))
server.read_reply(conn, "fetch")
gloo.broadcast(member.group, torch.empty(update.buckets[0].nbytes, dtype=torch.uint8))
print("one bucket in", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_killed_mid_transfer_costs_only_its_own_group(served):
    """A real process joins, takes the first of many buckets and is SIGKILLed: the learner's thread
    for it ends, the learner publishes on, and another actor joins and receives exactly."""
    publisher, _, state, tokenizer = served
    big = {"w": torch.randn(64, 4096)}  # 1 MiB: 256 buckets, so the kill lands mid-version
    update = publisher.publish(big, version=5)
    worker = subprocess.run(
        [sys.executable, "-c", DIES_AFTER_ONE_BUCKET],
        input=msgspec.json.encode(update),
        capture_output=True,
        timeout=60,
    )
    assert worker.returncode == -signal.SIGKILL and b"one bucket in" in worker.stdout, worker.stderr.decode()[-2000:]
    deadline = time.monotonic() + 10
    while publisher.server.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not publisher.server.connections and not publisher.server.groups  # its thread let go of it
    start = time.monotonic()
    after = publisher.publish(state, version=6)  # the learner was never held up
    assert time.monotonic() - start < 2.0
    engine = ScriptedEngine(tokenizer)
    asyncio.run(build_receiver(config()).apply(after, engine))
    assert engine.swaps == [6] and all(torch.equal(engine.loaded[k], state[k]) for k in engine.loaded)


def test_a_stalled_peer_is_aborted_after_the_timeout_and_the_learner_serves_on(served):
    """A peer that joins, asks for a version and never receives: the learner's connection thread
    aborts the transfer after weights.tcp_timeout_s, says why, and ends."""
    publisher, update, _, _ = served
    conn = socket.create_connection(server.parse_location(update.location))
    conn.sendall(collective.control(update.token, collective.JOIN, 1))
    spec = json.loads(server.read_reply(conn, "join"))
    from types import SimpleNamespace

    from tidal.broker.weights.base import InitInfo

    peer = SimpleNamespace(worker_rank=0, model=None, load_target=None, model_config=None)
    gloo.GlooPlane.join(
        peer,  # the peer's own side waits
        InitInfo("gloo", {**spec, "location": update.location, "token": update.token.hex()}, 30.0),
    )
    conn.sendall(collective.control(update.token, collective.FETCH, update.version))
    server.read_reply(conn, "fetch")
    conn.settimeout(30)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"refused by the learner: version 3: "):
        server.read_reply(conn, "the learner's end")
    assert time.monotonic() - started < 5 * TIMEOUT_S
    conn.close()
    assert os.getpid()  # this process (the learner's) lives on


def test_a_group_idle_between_versions_for_longer_than_the_timeout_stays_joined():
    """Between versions a connection idles for as long as a step takes: no read timeout ends it
    (a vanished peer is found by TCP keepalive instead), so the next version goes through the same group."""
    from conftest import served_weights

    served = served_weights("gloo", tcp_timeout_s=0.5)
    publisher, update, state, tokenizer = next(served)
    try:
        engine, receiver = ScriptedEngine(tokenizer), build_receiver(config(tcp_timeout_s=0.5))
        asyncio.run(receiver.apply(update, engine))
        member = engine.worker.member
        time.sleep(0.8)
        moved = {k: v * 2 for k, v in state.items()}
        asyncio.run(receiver.apply(publisher.publish(moved, version=4), engine))
        assert engine.swaps == [3, 4] and engine.worker.member is member and len(publisher.server.groups) == 1
        assert all(torch.equal(engine.loaded[k], moved[k]) for k in engine.loaded)
        conn = next(iter(publisher.server.connections))
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
    finally:
        served.close()


def test_actors_that_join_at_once_form_their_groups_at_once_each_with_its_own_keys(served, monkeypatch):
    publisher, update, state, tokenizer = served
    new_group = gloo.new_group
    monkeypatch.setattr(gloo, "new_group", lambda *a, **k: (time.sleep(0.3), new_group(*a, **k))[1])
    engines, receivers = [ScriptedEngine(tokenizer) for _ in range(3)], [build_receiver(config()) for _ in range(3)]

    async def together():
        await asyncio.gather(*(receiver.apply(update, engine) for receiver, engine in zip(receivers, engines)))

    asyncio.run(together())
    assert all(e.swaps == [3] and all(torch.equal(e.loaded[k], state[k]) for k in e.loaded) for e in engines)
    assert len(publisher.server.groups) == 3 and len(publisher.plane.stores) == 3


def test_a_bug_in_one_connections_thread_is_logged_and_counted_and_the_learner_serves_on(served, monkeypatch, caplog):
    publisher, update, state, tokenizer = served
    mint = publisher.plane.mint
    monkeypatch.setattr(publisher.plane, "mint", lambda *a: {}["no such key"])
    with pytest.raises(ConnectionError, match="connection closed"):
        asyncio.run(build_receiver(config()).apply(update, ScriptedEngine(tokenizer)))
    deadline = time.monotonic() + 5
    while not publisher.server.errors and time.monotonic() < deadline:
        time.sleep(0.02)
    assert publisher.server.errors == 1 and "KeyError" in caplog.text and "carries on" in caplog.text
    monkeypatch.setattr(publisher.plane, "mint", mint)
    engine = ScriptedEngine(tokenizer)
    asyncio.run(build_receiver(config()).apply(update, engine))
    assert engine.swaps == [3]


def test_a_torn_engine_tries_the_same_version_again_and_an_unreachable_learner_never_stops_the_actor(
    served, monkeypatch
):
    """A transfer that fails part-way leaves the engine paused: with no newer announcement coming (the
    learner waits for this actor's rollouts) the actor tries the same version again, backing off, and
    the learner being unreachable meanwhile never counts toward the failures that stop an actor."""
    from tidal.actor import loop
    from tidal.config import ActorConfig

    publisher, update, state, tokenizer = served
    engine = ScriptedEngine(tokenizer)
    actor = loop.Actor(ActorConfig(), engine, transport=None, receiver=build_receiver(config()))
    actor.retry_s = 0.05
    send, tries = gloo.GlooPlane.send, []

    def fails_twice(self, group, served, progress):  # one bucket, then the learner gives up on the transfer
        tries.append(1)
        if len(tries) > 2:
            return send(self, group, served, progress)
        gloo.broadcast(group.group, served.payload[: served.buckets[0].nbytes])
        raise RuntimeError("the learner's side failed")

    monkeypatch.setattr(gloo.GlooPlane, "send", fails_twice)

    async def until_loaded():
        actor.note_announcement(update)
        applying = asyncio.create_task(actor.apply_newest())
        # until the load has returned, not just swapped: the learner's last word comes after the swap
        while not actor.stats["weight_updates"] and not applying.done():
            await asyncio.sleep(0.05)
        applying.cancel()

    asyncio.run(asyncio.wait_for(until_loaded(), 60))
    assert len(tries) == 3 and engine.swaps == [3] and not engine.torn
    assert actor.stats["weight_load_failures"] == 2 and actor.retry_s == loop.RETRY_TORN_S[0]

    unreachable = msgspec.structs.replace(update, version=4, location="127.0.0.1:1")
    actor.note_announcement(unreachable)
    for _ in range(loop.MAX_WEIGHT_LOAD_FAILURES + 2):
        assert asyncio.run(actor.load_newest(tolerate=False)) is False
        actor.latest = unreachable
    assert actor.stats["weight_load_failures_in_a_row"] == 0


def test_workers_that_never_form_their_group_stop_the_actor_to_be_restarted(served, monkeypatch):
    """A worker left waiting inside a call that cannot be cancelled can take no later update: the
    actor says so and stops, rather than retrying on a wedged engine."""
    from tidal.actor import loop
    from tidal.broker.weights import EngineStuck
    from tidal.config import ActorConfig

    publisher, update, _, tokenizer = served
    engine = ScriptedEngine(tokenizer)

    async def never(init_info):
        await asyncio.sleep(3600)

    monkeypatch.setattr(engine, "init_weight_transfer", never)
    actor = loop.Actor(ActorConfig(), engine, transport=None, receiver=build_receiver(config(tcp_timeout_s=0.5)))
    actor.note_announcement(update)
    with pytest.raises(EngineStuck, match=r"did not form their group within 1 s .* the actor must restart"):
        asyncio.run(actor.load_newest(tolerate=True))
