"""ZeroMQ transport over real sockets: prompt grants, weight announcements, rollouts, bad frames,
and peers that are not who they say: never introduced, a second connection under a live id,
rollouts for groups granted to someone else, floods, oversized frames, and CURVE keys."""

import asyncio
import time

import msgspec
import pytest
import zmq

from conftest import prompt_group as prompt
from conftest import rollout
from tidal.broker.schema import SCHEMA_VERSION, Heartbeat, RolloutGroup, Shutdown, WeightUpdate, WireCodec, WorkRequest
from tidal.broker.zmq_keys import generate
from tidal.broker.zmq_transport import ZmqActorTransport, ZmqLearnerTransport
from tidal.config import BrokerConfig, ZmqConfig


def hello(actor_id: str) -> Heartbeat:
    return Heartbeat(actor_id=actor_id, version=0, engine={}, outstanding=[], hello=True)


@pytest.fixture
def learner_side():
    transport = ZmqLearnerTransport(BrokerConfig(max_message_bytes=4096), WireCodec(4096))
    yield transport
    transport.close()


def actor_config(learner: ZmqLearnerTransport, **zmq) -> BrokerConfig:
    p = learner.ports
    return BrokerConfig(
        zmq=ZmqConfig(control_port=p["control"], rollout_port=p["rollout"], weights_port=p["weights"], **zmq)
    )


def actor(learner, actor_id: str, **zmq) -> ZmqActorTransport:
    return ZmqActorTransport(actor_config(learner, **zmq), WireCodec(1 << 20), actor_id)


def test_an_unreachable_learner_never_blocks_the_actor(caplog):
    """Nothing listens: heartbeats and requests queue until the DEALER's high-water mark, then are
    dropped with one warning; no call waits longer than it was told to."""
    with zmq.Context() as ctx:  # three ports bound and closed again: nothing listens there
        socks = [ctx.socket(zmq.PULL) for _ in range(3)]
        ports = [sock.bind_to_random_port("tcp://127.0.0.1") for sock in socks]
        for sock in socks:
            sock.close(linger=0)
    cfg = BrokerConfig(zmq=ZmqConfig(control_port=ports[0], rollout_port=ports[1], weights_port=ports[2]))

    async def scenario():
        t = ZmqActorTransport(cfg, WireCodec(1 << 20), "lonely")
        t._dealer.setsockopt(zmq.SNDHWM, 4)  # full after a few messages, not a thousand
        start = time.monotonic()
        for _ in range(8):
            await asyncio.wait_for(t.heartbeat(hello("lonely")), 1)
        waited = time.monotonic() - start
        start = time.monotonic()
        groups = await t.request_work(4, timeout_s=0.2)
        asked = time.monotonic() - start
        t.close()
        return waited, groups, asked

    waited, groups, asked = asyncio.run(scenario())
    assert waited < 1 and groups == [] and 0.15 < asked < 2
    assert [r.message for r in caplog.records].count(
        "the learner takes no control messages (unreachable?): Heartbeat dropped, and every one until it does"
    ) == 1


def test_a_learner_side_closed_twice_closes_once():
    transport = ZmqLearnerTransport(BrokerConfig(), WireCodec(4096))
    transport.close()
    transport.close()  # used to fail on its wake-up pipe, closed by the first


def test_bad_frames_on_the_rollout_stream_are_dropped_and_the_stream_goes_on(learner_side):
    learner_side.submit_prompts([prompt(0)])

    async def granted():
        t = actor(learner_side, "actor-0")
        await t.heartbeat(hello("actor-0"))
        [group] = await t.request_work(4, timeout_s=5)
        return t, group

    t, group = asyncio.run(granted())
    ctx = zmq.Context()
    junk, oversized = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    for sock in (junk, oversized):
        sock.connect(f"tcp://127.0.0.1:{learner_side.ports['rollout']}")
    junk.send(b"not msgpack at all")
    oversized.send(b"x" * 5000)  # above ZMQ_MAXMSGSIZE (4096): the socket drops it, nothing is buffered
    asyncio.run(t.send_rollout(rollout(group_id=group.group_id)))
    got = learner_side.recv_rollout(timeout_s=5)
    assert isinstance(got, RolloutGroup) and got.group_id == "r-0"
    assert learner_side.recv_rollout(timeout_s=0.3) is None  # the junk is read (and dropped) in its turn
    m = learner_side.metrics()
    assert m["broker/rejected/malformed"] == 1
    ctx.destroy(linger=0)
    t.close()


def test_actor_gets_whole_groups_that_fit_and_hears_weights(learner_side):
    learner_side.submit_prompts([prompt(i) for i in range(5)])
    update = WeightUpdate(version=3, transport="file", location="/w", manifest=[], checksum="c")

    async def scenario():
        t = actor(learner_side, "actor-7")
        await t.heartbeat(hello("actor-7"))
        first = await t.request_work(max_samples=10, timeout_s=5)  # 10 slots: two groups of 4
        learner_side.publish_weights(update)
        second = await t.request_work(max_samples=100, timeout_s=5)
        heard = await asyncio.wait_for(t.next_announcement(), 5)
        await t.send_rollout(rollout(group_id="r-0", actor_id="actor-7"))
        learner_side.shutdown_actors("done")
        stop = await asyncio.wait_for(t.next_announcement(), 5)
        t.close()
        return first, second, heard, stop

    first, second, heard, stop = asyncio.run(scenario())
    assert [g.group_id for g in first] == ["r-0", "r-1"]
    assert [g.group_id for g in second] == ["r-2", "r-3", "r-4"]
    assert heard.version == 3 and isinstance(stop, Shutdown)
    assert learner_side.recv_rollout(timeout_s=5).group_id == "r-0"


def test_prompts_submitted_while_a_request_waits_wake_the_learner_to_grant_them(monkeypatch):
    # the I/O thread's own turns come only every 30 s here, and a request's long poll lasts as long: a grant
    # within the actor's 10 s wait can only come from the submission waking it
    monkeypatch.setattr("tidal.broker.zmq_transport.POLL_MS", 30_000)
    monkeypatch.setattr("tidal.broker.zmq_transport.LONG_POLL_S", 30.0)
    side = ZmqLearnerTransport(BrokerConfig(), WireCodec(1 << 20))

    async def scenario():
        t = actor(side, "a")
        await t.heartbeat(hello("a"))
        granted = []
        for i in range(2):  # once with the queue empty from the start, once emptied by the first grant
            asking = asyncio.ensure_future(t.request_work(4, timeout_s=10))
            while not side._control.parked:  # the request is parked, and found nothing to take
                await asyncio.sleep(0.01)
            side.submit_prompts([prompt(i)])
            granted.append([g.group_id for g in await asking])
        t.close()
        return granted

    try:
        assert asyncio.run(scenario()) == [["r-0"], ["r-1"]]
    finally:
        side.close()


def test_an_actor_that_joins_late_hears_the_current_weights_first(learner_side):
    learner_side.publish_weights(WeightUpdate(version=5, transport="file", location="/w", manifest=[], checksum="c"))

    async def late_actor():
        await asyncio.sleep(0.3)  # long after the announcement went out
        t = actor(learner_side, "late")
        heard = await asyncio.wait_for(t.next_announcement(), 5)
        t.close()
        return heard

    assert asyncio.run(late_actor()).version == 5


async def restart(side, actor_id: str, attempts: int = 20) -> list:
    """Connect again under `actor_id` (a new connection, a new routing id) and ask for work until the
    learner answers: its hello may reach the learner after the request, which then finds no live actor."""
    for _ in range(attempts):
        conn = actor(side, actor_id)
        await conn.heartbeat(hello(actor_id))
        groups = await conn.request_work(12, timeout_s=1)
        conn.close()
        if groups:
            return groups
    return []


def test_groups_of_a_silent_or_restarted_actor_are_dispatched_again():
    side = ZmqLearnerTransport(BrokerConfig(actor_timeout_s=0.5), WireCodec(1 << 20))
    side.submit_prompts([prompt(i) for i in range(3)])

    async def scenario():
        a = actor(side, "a")
        await a.heartbeat(hello("a"))
        held = await a.request_work(4, timeout_s=5)  # r-0, then silence
        a.close()
        b = actor(side, "b")
        await b.heartbeat(hello("b"))
        taken = await b.request_work(8, timeout_s=5)  # r-1, r-2 (r-0 is still a's)
        for _ in range(5):  # a is past the actor timeout; b keeps beating
            await asyncio.sleep(0.2)
            await b.heartbeat(Heartbeat(actor_id="b", version=0, engine={}, outstanding=[]))
        again = await b.request_work(8, timeout_s=5)
        b.close()
        back = await restart(side, "b")  # b restarts under the same id: its groups go back at once
        return held, taken, again, back

    held, taken, again, back = asyncio.run(scenario())
    side.close()
    assert [g.group_id for g in held] == ["r-0"]
    assert [g.group_id for g in taken] == ["r-1", "r-2"]
    assert [g.group_id for g in again] == ["r-0"]
    assert sorted(g.group_id for g in back) == ["r-0", "r-1", "r-2"]
    assert side.metrics()["broker/redispatched_groups"] == 1 + 3
    assert [j.actor_id for j in side.take_joins()] == ["a", "b"]  # b's newest hello, once


# ---- peers that are not who they say --------------------------------------------------------------


def raw_dealer(ctx, learner, identity: bytes) -> zmq.Socket:
    """A connection under the routing id `<identity>/nonce-0`, or `identity` itself where it holds a slash."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity if b"/" in identity else identity + b"/nonce-0")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{learner.ports['control']}")
    return sock


def test_a_peer_that_never_introduced_itself_is_granted_nothing(learner_side):
    learner_side.submit_prompts([prompt(i) for i in range(3)])
    codec, ctx = WireCodec(1 << 20), zmq.Context()
    stranger = raw_dealer(ctx, learner_side, b"stranger")
    stranger.send(codec.encode(WorkRequest(actor_id="stranger", max_samples=100)))
    assert stranger.poll(5000) and codec.decode(stranger.recv()).groups == []
    liar = raw_dealer(ctx, learner_side, b"liar")  # claims another id than its connection's
    liar.send(codec.encode(hello("actor-0")))
    liar.send(codec.encode(WorkRequest(actor_id="actor-0", max_samples=100)))
    assert not liar.poll(700)
    m = learner_side.metrics()
    assert m["broker/rejected/unknown_actor"] == 1 and m["broker/rejected/impersonation"] == 2
    assert m["broker/pending_prompt_groups"] == 3 and m["broker/live_actors"] == 0
    ctx.destroy(linger=0)


def test_a_second_connection_under_a_live_actors_id_gets_none_of_its_work(learner_side):
    learner_side.submit_prompts([prompt(i) for i in range(4)])
    codec, ctx = WireCodec(1 << 20), zmq.Context()
    first = raw_dealer(ctx, learner_side, b"actor-0")
    first.send(codec.encode(hello("actor-0")))
    time.sleep(0.3)
    second = raw_dealer(ctx, learner_side, b"actor-0")  # its routing id: refused by the ROUTER while the first holds it
    second.send(codec.encode(WorkRequest(actor_id="actor-0", max_samples=100)))
    assert not second.poll(1000)
    first.send(codec.encode(WorkRequest(actor_id="actor-0", max_samples=100)))
    assert first.poll(5000) and len(codec.decode(first.recv()).groups) == 4
    ctx.destroy(linger=0)


def test_rollouts_are_taken_only_from_the_actor_the_group_was_granted_to(learner_side):
    learner_side.submit_prompts([prompt(0)])

    async def scenario():
        a, b = actor(learner_side, "a"), actor(learner_side, "b")
        await a.heartbeat(hello("a"))
        await b.heartbeat(hello("b"))
        [group] = await a.request_work(4, timeout_s=5)
        await b.send_rollout(rollout(group_id=group.group_id, actor_id="b"))  # granted to a, not b
        await b.send_rollout(rollout(group_id="r-999", actor_id="b"))  # granted to nobody
        await asyncio.sleep(0.3)  # two connections deliver in no set order: b's are read first, on purpose
        assert learner_side.recv_rollout(timeout_s=0.3) is None
        await a.send_rollout(rollout(group_id=group.group_id, actor_id="a"))
        await asyncio.sleep(0.3)
        a.close()
        b.close()

    asyncio.run(scenario())
    got = learner_side.recv_rollout(timeout_s=5)
    assert (got.group_id, got.actor_id) == ("r-0", "a") and learner_side.recv_rollout(timeout_s=0.3) is None
    m = learner_side.metrics()
    assert m["broker/rejected/wrong_actor"] == 1 and m["broker/rejected/ungranted"] == 1


def test_a_learner_that_reads_nothing_holds_only_its_high_water_mark():
    """Rollouts the learner does not read stay with the actor beyond rollout_hwm (and the kernel's
    buffers): the learner never takes in a flood, and the actor's sends never block."""
    side = ZmqLearnerTransport(BrokerConfig(zmq=ZmqConfig(rollout_hwm=4)), WireCodec(1 << 20))
    side.submit_prompts([prompt(i, n=1) for i in range(200)])

    async def flood():
        t = actor(side, "a")  # an actor's own queue has no mark
        await t.heartbeat(hello("a"))
        groups = await t.request_work(200, timeout_s=5)
        big = (3,) * 65_536  # 512 KiB a frame, as in a flood that once grew the learner past 1 GiB
        for g in groups:  # queued at once: an actor holds no more than it was granted
            frame = rollout(
                tokens=big, logprobs=(-0.1,) * len(big), spans=((0, 0, len(big)),), group_id=g.group_id, actor_id="a"
            )
            await asyncio.wait_for(t.send_rollout(frame), 0.5)
        await asyncio.sleep(0.5)  # time to move all the learner's side would take
        t.close()  # what the actor still held goes with it
        return [g.group_id for g in groups]

    granted = asyncio.run(flood())
    received = []
    while (got := side.recv_rollout(timeout_s=1)) is not None:
        received.append(got.group_id)
    side.close()
    assert len(granted) == 200 and 0 < len(received) < 120
    assert received == granted[: len(received)]  # whole and in order


def test_curve_binds_each_actor_to_its_key(tmp_path):
    keys = generate(tmp_path / "keys", ["actor-0", "actor-1"])
    side = ZmqLearnerTransport(BrokerConfig(zmq=ZmqConfig(curve="on", keys_dir=str(keys))), WireCodec(1 << 20))
    side.submit_prompts([prompt(i) for i in range(2)])
    curve = dict(curve="on", keys_dir=str(keys))

    async def scenario():
        honest = actor(side, "actor-0", **curve)
        await honest.heartbeat(hello("actor-0"))
        [group] = await honest.request_work(4, timeout_s=5)
        # actor-1's key, claiming actor-0's rollout: refused, the key says who it is
        impostor = ZmqActorTransport(actor_config(side, **curve), WireCodec(1 << 20), "actor-1")
        await impostor.send_rollout(rollout(group_id=group.group_id, actor_id="actor-0"))
        await honest.send_rollout(rollout(group_id=group.group_id, actor_id="actor-0"))
        keyless = actor(side, "actor-1")  # no keys at all: the handshake fails, nothing arrives
        await keyless.heartbeat(hello("actor-1"))
        nothing = await keyless.request_work(4, timeout_s=1)
        for t in (honest, impostor, keyless):
            t.close()
        return nothing

    assert asyncio.run(scenario()) == []
    got = side.recv_rollout(timeout_s=5)
    assert got.actor_id == "actor-0" and side.recv_rollout(timeout_s=0.3) is None
    m = side.metrics()
    side.close()
    assert m["broker/rejected/impersonation"] == 1 and m["broker/live_actors"] == 1


def test_oversized_hellos_and_heartbeats_are_refused_and_hold_nothing():
    learner_side = ZmqLearnerTransport(BrokerConfig(max_control_bytes=65_536), WireCodec(1 << 20))
    codec, ctx = WireCodec(1 << 24), zmq.Context()
    big = raw_dealer(ctx, learner_side, b"big")
    many = [f"r-{i}" for i in range(100_000)]  # about 1 MB: above broker.max_control_bytes, dropped by the socket
    big.send(codec.encode(Heartbeat(actor_id="big", version=0, engine={}, outstanding=many, hello=True)))
    huge_id = raw_dealer(ctx, learner_side, b"y" * 200)
    huge_id.send(
        msgspec.msgpack.encode(
            {
                "kind": "heartbeat",
                "schema_version": SCHEMA_VERSION,
                "actor_id": "y" * 200,
                "version": 0,
                "engine": {},
                "outstanding": [],
                "hello": True,
            }
        )
    )
    time.sleep(0.5)
    m = learner_side.metrics()
    assert m["broker/live_actors"] == 0 and learner_side.take_joins() == []
    assert m["broker/rejected/malformed"] == 1  # the long id; the big heartbeat never got past the socket
    ctx.destroy(linger=0)
    learner_side.close()


def test_a_work_request_the_learner_lost_is_asked_again(monkeypatch):
    monkeypatch.setattr("tidal.broker.zmq_transport.REQUEST_AGAIN_S", 0.5)
    first = ZmqLearnerTransport(BrokerConfig(), WireCodec(1 << 20))
    ports = first.ports

    async def scenario():
        t = actor(first, "a")
        await t.heartbeat(hello("a"))
        assert await t.request_work(4, timeout_s=0.1) == []  # nothing to grant yet: the request stays open
        first.close()  # ... and is lost with the learner
        second = ZmqLearnerTransport(
            BrokerConfig(
                zmq=ZmqConfig(
                    control_port=ports["control"], rollout_port=ports["rollout"], weights_port=ports["weights"]
                )
            ),
            WireCodec(1 << 20),
        )
        second.submit_prompts([prompt(0)])
        await t.heartbeat(hello("a"))
        deadline, groups = time.monotonic() + 10, []
        while not groups and time.monotonic() < deadline:
            groups = await t.request_work(4, timeout_s=0.2)
        t.close()
        second.close()
        return groups

    assert [g.group_id for g in asyncio.run(scenario())] == ["r-0"]


def test_a_flood_of_control_messages_is_refused_but_an_actor_asking_at_its_pace_never_is(monkeypatch, learner_side):
    monkeypatch.setattr("tidal.broker.zmq_transport.REQUEST_EVERY_S", 2 / 10)
    learner_side._control.rate.rate = 10.0  # bursts of 20
    learner_side.submit_prompts([prompt(i, n=1) for i in range(24)])

    async def ask_as_fast_as_it_can():
        t = actor(learner_side, "a")
        await t.heartbeat(hello("a"))
        got = [g for _ in range(24) for g in await t.request_work(1, timeout_s=2)]
        t.close()
        return got

    assert len(asyncio.run(ask_as_fast_as_it_can())) == 24
    assert "broker/rejected/rate_limited" not in learner_side.metrics()
    ctx = zmq.Context()
    flood = raw_dealer(ctx, learner_side, b"a")
    for _ in range(40):
        flood.send(WireCodec(4096).encode(hello("a")))
    time.sleep(0.3)
    ctx.destroy(linger=0)
    assert learner_side.metrics()["broker/rejected/rate_limited"] >= 15
