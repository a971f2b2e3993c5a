"""ZeroMQ transport over real sockets: prompt grants, weight announcements, rollouts, bad frames."""
import asyncio

import pytest
import zmq

from conftest import prompt_group as prompt
from conftest import rollout
from tidal.broker.schema import RolloutGroup, Shutdown, WeightUpdate, WireCodec
from tidal.broker.zmq_transport import ZmqActorTransport, ZmqLearnerTransport
from tidal.config import ZmqConfig


@pytest.fixture
def learner_side():
    transport = ZmqLearnerTransport(ZmqConfig(), WireCodec(4096))
    yield transport
    transport.close()


def actor_config(learner: ZmqLearnerTransport) -> ZmqConfig:
    p = learner.ports
    return ZmqConfig(control_port=p["control"], rollout_port=p["rollout"], weights_port=p["weights"])


def test_bad_frames_on_the_rollout_stream_are_counted_and_the_stream_goes_on(learner_side):
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{learner_side.ports['rollout']}")
    codec = WireCodec(1 << 20)
    push.send(b"not msgpack at all")
    push.send(b"x" * 5000)  # above the learner's 4096-byte limit
    push.send(codec.encode(rollout()))
    got = learner_side.recv_rollout(timeout_s=5)
    assert isinstance(got, RolloutGroup) and got.group_id == "g1"
    m = learner_side.metrics()
    assert m["broker/rejected_frames"] == 2
    assert m["broker/rejected/malformed"] == 1 and m["broker/rejected/oversized"] == 1
    ctx.destroy(linger=0)


def test_actor_gets_whole_groups_that_fit_and_hears_weights(learner_side):
    learner_side.submit_prompts([prompt(i) for i in range(5)])
    update = WeightUpdate(version=3, transport="file", location="/w", manifest=[], checksum="c")

    async def actor():
        t = ZmqActorTransport(actor_config(learner_side), WireCodec(1 << 20), "actor-7")
        first = await t.request_work(max_samples=10, timeout_s=5)  # 10 slots: two groups of 4
        learner_side.publish_weights(update)
        second = await t.request_work(max_samples=100, timeout_s=5)
        heard = await asyncio.wait_for(t.next_announcement(), 5)
        await t.send_rollout(rollout())
        learner_side.shutdown_actors("done")
        stop = await asyncio.wait_for(t.next_announcement(), 5)
        t.close()
        return first, second, heard, stop

    first, second, heard, stop = asyncio.run(actor())
    assert [g.group_id for g in first] == ["r-0", "r-1"]
    assert [g.group_id for g in second] == ["r-2", "r-3", "r-4"]
    assert heard.version == 3 and isinstance(stop, Shutdown)
    assert learner_side.recv_rollout(timeout_s=5).group_id == "g1"


def test_an_actor_that_joins_late_hears_the_current_weights_first(learner_side):
    learner_side.publish_weights(WeightUpdate(version=5, transport="file", location="/w", manifest=[], checksum="c"))

    async def late_actor():
        await asyncio.sleep(0.3)  # long after the announcement went out
        t = ZmqActorTransport(actor_config(learner_side), WireCodec(1 << 20), "late")
        heard = await asyncio.wait_for(t.next_announcement(), 5)
        t.close()
        return heard

    assert asyncio.run(late_actor()).version == 5


def test_groups_of_a_silent_or_restarted_actor_are_dispatched_again():
    from tidal.broker.schema import Heartbeat

    side = ZmqLearnerTransport(ZmqConfig(), WireCodec(1 << 20), actor_timeout_s=0.5)
    side.submit_prompts([prompt(i) for i in range(3)])

    async def scenario():
        def actor(actor_id):
            return ZmqActorTransport(actor_config(side), WireCodec(1 << 20), actor_id)

        hello = lambda a: Heartbeat(actor_id=a, version=0, engine={}, outstanding=[], hello=True)  # noqa: E731
        a = actor("a")
        await a.heartbeat(hello("a"))
        held = await a.request_work(4, timeout_s=5)  # r-0, then silence
        a.close()
        b = actor("b")
        await b.heartbeat(hello("b"))
        taken = await b.request_work(8, timeout_s=5)  # r-1, r-2 (r-0 is still a's)
        for _ in range(5):  # a is past the actor timeout; b keeps beating
            await asyncio.sleep(0.2)
            await b.heartbeat(Heartbeat(actor_id="b", version=0, engine={}, outstanding=[]))
        again = await b.request_work(8, timeout_s=5)
        b.close()
        b2 = actor("b")  # b restarts under the same id: its groups go back at once
        await b2.heartbeat(hello("b"))
        back = await b2.request_work(12, timeout_s=5)
        b2.close()
        return held, taken, again, back

    held, taken, again, back = asyncio.run(scenario())
    side.close()
    assert [g.group_id for g in held] == ["r-0"]
    assert [g.group_id for g in taken] == ["r-1", "r-2"]
    assert [g.group_id for g in again] == ["r-0"]
    assert sorted(g.group_id for g in back) == ["r-0", "r-1", "r-2"]
    assert side.metrics()["broker/redispatched_groups"] == 1 + 3
    assert [j.actor_id for j in side.take_joins()] == ["a", "b", "b"]
