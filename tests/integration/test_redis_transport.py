"""Redis Streams transport against a real redis-server: acknowledgement, redelivery, takeover,
dead letters, trimming, reconnection and credentials."""

import asyncio
import os
import time

import msgspec
import numpy as np
import pytest
import redis

from conftest import RedisServer, require_redis_server, rollout, sample
from conftest import prompt_group as prompt
from tidal.actor.engine import Completion
from tidal.actor.episode import Episodes
from tidal.actor.loop import Actor
from tidal.broker.redis_transport import BrokerAuthError, BrokerUnavailable, RedisActorTransport, RedisLearnerTransport
from tidal.broker.schema import Episode, Heartbeat, RolloutGroup, Shutdown, WeightUpdate, WireCodec
from tidal.config import ActorConfig, EnvConfig, RedisConfig
from tidal.tasks import SingleTurn


def config(server, **kw) -> RedisConfig:
    return RedisConfig(url=server.url, block_ms=100, **kw)


def learner(cfg, fresh=True) -> RedisLearnerTransport:
    return RedisLearnerTransport(cfg, WireCodec(1 << 20), "t", actor_timeout_s=5, fresh=fresh)


def run(coro):
    return asyncio.run(coro)


def reply_for(group, actor_id: str) -> RolloutGroup:
    return rollout(group_id=group.group_id, actor_id=actor_id)


async def work(cfg, actor_id, max_samples=100, reply=True, timeout_s=2.0):
    """One actor incarnation: take what it is granted, answer it (or die holding it)."""
    t = RedisActorTransport(cfg, WireCodec(1 << 20), actor_id, "t")
    groups = await t.request_work(max_samples, timeout_s=timeout_s)
    if reply:
        for g in groups:
            await t.send_rollout(reply_for(g, actor_id))
    await t.r.aclose()
    return [g.group_id for g in groups]


def drain(side, want, timeout_s=5.0):
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        g = side.recv_rollout(timeout_s=0.2)
        if g is not None:
            got.append(g.group_id)
    return got


def test_round_trip_acknowledges_prompt_and_rollout(redis_server):
    cfg = config(redis_server)
    side = learner(cfg)
    side.submit_prompts([prompt(i) for i in range(3)])
    assert run(work(cfg, "a0", max_samples=8)) == ["r-0", "r-1"]  # two groups of 4 fit in 8 slots
    assert drain(side, 2) == ["r-0", "r-1"]
    m = side.metrics()
    assert m["broker/prompt_pending"] == 2 and m["broker/prompt_lag"] == 1  # actors acknowledge nothing
    assert m["broker/rollout_pending"] == 2  # handled, not yet covered by a checkpoint
    side.commit()  # the learner acknowledges rollout and prompt once a checkpoint covers them
    m = side.metrics()
    assert m["broker/rollout_pending"] == 0 and m["broker/prompt_pending"] == 0


def test_an_episodes_rollout_crosses_redis_whole(redis_server):
    """A rollout of episodes (injected spans between turns, the episode's counts) arrives as it was sent."""
    cfg = config(redis_server)
    side = learner(cfg)
    side.submit_prompts([prompt(0)])
    episode = Episode(turns=3, tool_calls=2, tool_errors=1, tool_timeouts=0, env_seconds=0.25, env_error="")

    async def actor():
        t = RedisActorTransport(cfg, WireCodec(1 << 20), "a0", "t")
        [group] = await t.request_work(8, timeout_s=2.0)
        sent = RolloutGroup.pack(
            [sample([(0, 3), (1, 6)], 1.0, injected_spans=[(2, 4), (6, 7)], episode=episode)],
            group_id=group.group_id,
            prompt_id=0,
            actor_id="a0",
            prompt_tokens=group.prompt_tokens,
        )
        await t.send_rollout(sent)
        await t.r.aclose()
        return sent

    sent = run(actor())
    got = side.recv_rollout(timeout_s=2.0)
    assert got.samples == sent.samples and got.samples[0].episode == episode


def test_restarted_actor_takes_back_its_own_prompts(redis_server):
    cfg = config(redis_server)
    side = learner(cfg)
    side.submit_prompts([prompt(i) for i in range(2)])
    assert run(work(cfg, "a0", reply=False)) == ["r-0", "r-1"]  # dies holding both
    assert run(work(cfg, "a0")) == ["r-0", "r-1"]  # same id, restarted: its pending entries first
    assert sorted(drain(side, 2)) == ["r-0", "r-1"]


def test_silent_actors_prompts_are_claimed_and_heartbeats_keep_them(redis_server):
    cfg = config(redis_server, claim_idle_ms=300)
    side = learner(cfg)
    side.submit_prompts([prompt(0), prompt(1)])

    async def scenario():
        alive = RedisActorTransport(cfg, WireCodec(1 << 20), "alive", "t")
        held = await alive.request_work(4, timeout_s=2)  # r-0, kept fresh by heartbeats
        assert await work(cfg, "dead", max_samples=4, reply=False) == ["r-1"]
        for _ in range(4):
            await asyncio.sleep(0.15)
            await alive.heartbeat(Heartbeat(actor_id="alive", version=0, engine={}, outstanding=[held[0].group_id]))
        other = RedisActorTransport(cfg, WireCodec(1 << 20), "other", "t")
        claimed = await other.request_work(100, timeout_s=0.5)
        await alive.r.aclose()
        await other.r.aclose()
        return [g.group_id for g in claimed]

    assert run(scenario()) == ["r-1"]  # the dead actor's group, not the live one's


def test_overdelivered_prompts_are_dead_lettered_and_reported(redis_server):
    cfg = config(redis_server, claim_idle_ms=100, max_deliveries=2)
    side = learner(cfg)
    side.submit_prompts([prompt(0)])
    assert run(work(cfg, "a0", reply=False)) == ["r-0"]  # delivery 1
    time.sleep(0.2)
    assert run(work(cfg, "a1", reply=False, timeout_s=0.3)) == ["r-0"]  # claimed: delivery 2
    time.sleep(0.2)
    assert run(work(cfg, "a2", timeout_s=0.3)) == []  # delivery 3 > 2: dead-lettered, not worked on
    assert side.take_dead_letters() == ["r-0"]
    assert side.metrics()["broker/prompt_pending"] == 0


def test_restarted_learner_gets_what_it_had_not_committed_and_nothing_else(redis_server):
    cfg = config(redis_server)
    side = learner(cfg)
    side.submit_prompts([prompt(i) for i in range(4)])
    run(work(cfg, "a0"))
    assert drain(side, 2) == ["r-0", "r-1"]
    side.commit()  # a checkpoint covered r-0 and r-1
    assert drain(side, 1) == ["r-2"]  # handed out, then the learner dies before its next checkpoint
    side.close()
    again = learner(cfg, fresh=False)
    assert drain(again, 2) == ["r-2", "r-3"]
    assert drain(again, 1, timeout_s=0.5) == []


def test_fresh_learner_clears_an_earlier_runs_streams(redis_server):
    cfg = config(redis_server)
    learner(cfg).submit_prompts([prompt(0)])
    learner(cfg, fresh=True)
    assert run(work(cfg, "a0", timeout_s=0.3)) == []


def test_trimming_keeps_unacknowledged_entries(redis_server):
    cfg = config(redis_server)
    side = learner(cfg)
    side.submit_prompts([prompt(i) for i in range(6)])
    run(work(cfg, "a0", max_samples=8, reply=False))  # r-0, r-1 pending at a dead actor
    run(work(cfg, "a1", max_samples=8))  # r-2, r-3 done
    drain(side, 2)
    side.commit()
    r = redis.Redis.from_url(cfg.url)
    ids = [fields[b"m"] for _, fields in r.xrange("tidal:t:prompts")]
    assert len(ids) == 6  # the oldest pending entry (r-0) bounds the trim
    assert run(work(cfg, "a0", max_samples=8)) == ["r-0", "r-1"]


def test_bad_rollout_frames_are_rejected_counted_and_dead_lettered(redis_server):
    cfg = config(redis_server)
    side = learner(cfg)
    side.submit_prompts([prompt(0)])
    assert run(work(cfg, "a0", max_samples=4, reply=False)) == ["r-0"]
    r = redis.Redis.from_url(cfg.url)
    codec = WireCodec(1 << 20)
    r.xadd("tidal:t:rollouts", {"m": b"not msgpack"})
    r.xadd("tidal:t:rollouts", {"other": b"field"})
    r.xadd("tidal:t:rollouts", {"m": codec.encode(rollout(group_id="r-0", actor_id="a1"))})  # not a1's prompt
    r.xadd("tidal:t:rollouts", {"m": codec.encode(rollout(group_id="r-77", actor_id="a0"))})  # never released
    r.xadd("tidal:t:rollouts", {"m": codec.encode(rollout(group_id="r-0", actor_id="a0"))})
    assert drain(side, 1) == ["r-0"] and drain(side, 1, timeout_s=0.5) == []
    m = side.metrics()
    assert m["broker/rejected_frames"] == 4
    assert m["broker/rejected/wrong_actor"] == 1 and m["broker/rejected/ungranted"] == 1
    assert r.xlen("tidal:t:dead") == 2  # the unreadable ones; refused ones free no slot
    assert m["broker/rollout_pending"] == 1  # only the good one waits for a commit


def test_weights_latest_and_next(redis_server):
    cfg = config(redis_server)
    side = learner(cfg)
    side.publish_weights(WeightUpdate(version=2, transport="file", location="/w", manifest=[], checksum="c"))

    async def actor():
        t = RedisActorTransport(cfg, WireCodec(1 << 20), "a0", "t")
        latest = await asyncio.wait_for(t.next_announcement(), 5)  # the first call: the current weights
        side.publish_weights(WeightUpdate(version=3, transport="file", location="/w", manifest=[], checksum="c"))
        side.publish_weights(WeightUpdate(version=4, transport="file", location="/w", manifest=[], checksum="c"))
        newest = await asyncio.wait_for(t.next_announcement(), 5)
        side.shutdown_actors("done")
        stop = await asyncio.wait_for(t.next_announcement(), 5)
        await t.r.aclose()
        return latest.version, newest.version, stop

    latest, newest, stop = run(actor())
    assert (latest, newest) == (2, 4) and isinstance(stop, Shutdown)  # conflated: the newest wins


def test_survives_a_redis_restart_and_gives_up_after_the_timeout(redis_server):
    cfg = config(redis_server, reconnect_timeout_s=2.0)
    side = learner(cfg)
    side.submit_prompts([prompt(0)])
    redis_server.stop()
    redis_server.start()  # AOF replayed: the stream and its groups are back
    assert run(work(cfg, "a0")) == ["r-0"]
    assert drain(side, 1) == ["r-0"]
    redis_server.stop()
    with pytest.raises(BrokerUnavailable, match="unreachable"):
        side.recv_rollout(timeout_s=1)


def test_password_comes_from_the_environment_and_acl_users_work(tmp_path, monkeypatch):
    require_redis_server()
    server = RedisServer(
        tmp_path, extra=("--user", "default", "off", "--user", "learner", "on", ">s3cret", "~tidal:*", "+@all")
    ).start()
    try:
        cfg = RedisConfig(
            url=server.url, username="learner", password_env="TEST_REDIS_PW", block_ms=100, reconnect_timeout_s=1
        )
        monkeypatch.setenv("TEST_REDIS_PW", "s3cret")
        learner(cfg).submit_prompts([prompt(0)])
        monkeypatch.setenv("TEST_REDIS_PW", "wrong")
        with pytest.raises(BrokerAuthError, match="TEST_REDIS_PW"):
            learner(cfg)
    finally:
        server.stop()
    assert "s3cret" not in str(cfg)


def test_a_request_too_small_for_any_group_yields_to_the_event_loop(redis_server):
    cfg = config(redis_server)
    learner(cfg).submit_prompts([prompt(0), prompt(1)])

    async def scenario():
        t = RedisActorTransport(cfg, WireCodec(1 << 20), "a0", "t")
        assert len(await t.request_work(4, timeout_s=1)) == 1  # learns that groups are 4 samples
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        assert await t.request_work(2, timeout_s=1) == []  # 2 free slots fit no group
        task.cancel()
        await t.r.aclose()
        return ticks

    assert run(scenario()) > 0  # the actor's other tasks (heartbeats, rollouts) got to run


def test_rollouts_finished_together_go_out_in_one_pipeline_and_share_its_failure(redis_server):
    cfg = config(redis_server)
    side = learner(cfg)
    side.submit_prompts([prompt(i) for i in range(12)])

    async def send_together(t, groups) -> tuple[list, list[int]]:
        writes, write = [], t._outbox._write

        async def counted(frames):
            writes.append(len(frames))
            await write(frames)

        t._outbox._write = counted
        results = await asyncio.gather(
            *(t.send_rollout(reply_for(g, t.actor_id)) for g in groups), return_exceptions=True
        )
        t._outbox._write = write
        return results, writes

    async def scenario():
        t = RedisActorTransport(cfg, WireCodec(1 << 20), "a0", "t")
        groups = await t.request_work(48, timeout_s=2.0)
        sent = await send_together(t, groups)
        # a rollouts key that is not a stream: every XADD of the pipeline fails, and every sender hears it
        t.keys.rollouts = "not-a-stream"
        await t.r.set(t.keys.rollouts, "x")
        failed = await send_together(t, groups[:3])
        await t.r.aclose()
        return len(groups), sent, failed

    n, (results, writes), (errors, failed_writes) = run(scenario())
    assert n == 12 and results == [None] * 12 and writes == [12]  # twelve rollouts, one round trip
    assert sorted(drain(side, 12)) == sorted(f"r-{i}" for i in range(12))
    assert failed_writes == [3] and all(isinstance(e, redis.ResponseError) and "WRONGTYPE" in str(e) for e in errors)


def test_a_group_left_pending_is_not_acknowledged_by_the_next_commit(redis_server):
    cfg = config(redis_server)
    side = learner(cfg)
    side.submit_prompts([prompt(0), prompt(1)])
    run(work(cfg, "a0"))
    _, second = side.recv_rollout(timeout_s=2), side.recv_rollout(timeout_s=2)
    side.leave_pending(second)  # e.g. a training group arriving during the final evaluation
    side.commit()
    assert side.metrics()["broker/rollout_pending"] == 1
    side.close()
    assert drain(learner(cfg, fresh=False), 1) == [second.group_id]  # a resumed learner still gets it


def test_the_embedded_redis_server_has_a_password_of_its_own(tmp_path, monkeypatch):
    """`broker.redis.embedded` servers refuse a client without the password, which reaches the run's
    processes through the environment only (never config.yaml, never a command line); its files are in a
    folder no other user can enter."""
    from tidal.config import load_config
    from tidal.ops.launcher import start_redis, stop_children

    require_redis_server()
    monkeypatch.delenv("TIDAL_REDIS_PASSWORD", raising=False)
    cfg = load_config("configs/tiny.yaml", ["broker.type=redis", "broker.redis.embedded=true"])
    child, url = start_redis(cfg, tmp_path)
    try:
        password = os.environ["TIDAL_REDIS_PASSWORD"]
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url).ping()
        assert redis.Redis.from_url(url, password=password).ping()
        assert password not in " ".join(child.args) and len(password) >= 32
        assert oct((tmp_path / "redis" / "redis.conf").stat().st_mode & 0o777) == "0o600"
        # the AOF (announcements, weight tokens) is written under redis-server's umask: its folder keeps it
        assert redis.Redis.from_url(url, password=password).set("k", "v")
        assert any((tmp_path / "redis").rglob("*.aof"))
        assert oct((tmp_path / "redis").stat().st_mode & 0o777) == "0o700"
    finally:
        stop_children([child])


def test_groups_a_restarted_learner_sends_again_replace_entries_no_actor_had_read(redis_server):
    """The learner dies with prompts in the stream that no actor has read yet, and the restarted one
    sends its outstanding groups again: the old entries are gone (acknowledged and deleted), so a
    restarted actor works on each group once, under the entry the learner waits for."""
    cfg = config(redis_server)
    side = learner(cfg)
    side.submit_prompts([prompt(i) for i in range(4)])
    assert run(work(cfg, "a0", max_samples=8, reply=False)) == ["r-0", "r-1"]  # dies holding two; two unread
    side.close()
    again = learner(cfg, fresh=False)
    again.submit_prompts([prompt(i) for i in range(4)])  # outstanding at its checkpoint: sent again
    assert again.r.xlen(again.keys.prompts) == 4  # the old entries are gone, read or not
    assert sorted(run(work(cfg, "a0", max_samples=100))) == ["r-0", "r-1", "r-2", "r-3"]
    assert sorted(drain(again, 4)) == ["r-0", "r-1", "r-2", "r-3"]
    assert again.metrics()["broker/rejected_frames"] == 0


def test_an_actor_holding_a_group_takes_the_entry_the_learner_sent_again(redis_server):
    cfg = config(redis_server)
    side = learner(cfg)
    side.submit_prompts([prompt(0)])

    async def scenario():
        actor = RedisActorTransport(cfg, WireCodec(1 << 20), "a0", "t")
        first = await actor.request_work(4, timeout_s=2)  # held, not answered yet
        side.submit_prompts([prompt(0)])  # the learner sends it again (as a restarted one would)
        again = await actor.request_work(4, timeout_s=2)
        await actor.send_rollout(reply_for(again[0], "a0"))
        await actor.r.aclose()
        return [g.group_id for g in first], [g.group_id for g in again]

    assert run(scenario()) == (["r-0"], ["r-0"])  # not skipped as "ours already"
    assert drain(side, 1) == ["r-0"]


class VersionSeven:
    """An engine running the resumed learner's weights, v7: answers at once."""

    version = 7

    async def sample(self, prompt_tokens, n, params, request_id, max_tokens=None):
        return [
            Completion(
                np.asarray([3, 1], dtype=np.int32),
                np.asarray([-0.5, -0.1], dtype=np.float32),
                [(self.version, 0, 2)],
                "3",
                "stop",
            )
            for _ in range(n)
        ]


def test_a_resumed_learner_withdraws_groups_released_after_its_checkpoint(redis_server):
    """The learner releases groups at v8 (min_version 8) and dies before its checkpoint at 8 is saved;
    its actor, which dies too, had read one of them, two are unread. The learner resumes at v7 and sends
    again what was outstanding at its checkpoint. Were the v8 groups still in the stream, the actor
    would take back and read them first, and they would fill its slots waiting for v8, which the
    learner reaches only with the rollouts of the groups it sent again: nobody would ever ask for
    those. So the resumed learner withdraws them, and the actor works on what it waits for."""
    cfg = config(redis_server)
    side = learner(cfg)
    at_checkpoint = [msgspec.structs.replace(prompt(i), min_version=7) for i in range(2)]
    after_it = [msgspec.structs.replace(prompt(i), min_version=8) for i in range(2, 5)]
    side.submit_prompts(at_checkpoint + after_it)
    assert run(work(cfg, "a0", max_samples=12, reply=False)) == ["r-0", "r-1", "r-2"]  # dies holding three
    side.close()
    again = learner(cfg, fresh=False)
    again.resubmit_prompts(at_checkpoint)

    async def restarted_actor():
        episodes = Episodes(SingleTurn(lambda text, payload: 1.0), EnvConfig(), tokenizer=None, chat_template=False)
        actor = Actor(
            ActorConfig(id="a0", max_inflight=8),
            VersionSeven(),
            RedisActorTransport(cfg, WireCodec(1 << 20), "a0", "t"),
            receiver=None,
            episodes=episodes,
        )
        filling = actor.spawn(actor.fill_slots())
        got = await asyncio.to_thread(drain, again, 2)
        for task in [filling, *actor.tasks]:
            task.cancel()
        await actor.transport.r.aclose()
        return sorted(got), set(actor.outstanding)

    got, holding = run(restarted_actor())
    # its last rollout may reach the learner before the actor forgets the group: only v8 ones would be wrong
    assert got == ["r-0", "r-1"] and holding <= {"r-0", "r-1"}
    assert again.r.xlen(again.keys.prompts) == 2  # the entries sent again, and nothing else


def test_prompts_no_actor_can_answer_are_sent_again_and_a_forged_retry_count_dead_letters_nothing(redis_server):
    """An actor user can read prompts with NOACK (pending at no one: no rollout of them can be taken), hold
    them, or claim another's with RETRYCOUNT 100. Each once stopped the run or dead-lettered the prompt.
    The learner sends the first again at its next poll, the held and the claimed ones after
    broker.grant_timeout_s, and dead-letters none of them; honest actors answer every group, and groups
    answered but not yet committed are never sent again."""
    from tidal.broker.redis_transport import ACTORS

    cfg = config(redis_server)
    side = RedisLearnerTransport(cfg, WireCodec(1 << 20), "t", actor_timeout_s=5, fresh=True, grant_timeout_s=2.0)
    side.submit_prompts([prompt(i) for i in range(3)])
    thief = redis.Redis.from_url(cfg.url)
    try:
        thief.xreadgroup(ACTORS, "thief", {side.keys.prompts: ">"}, count=1, noack=True)  # r-0, acknowledged by no one
        [[_, [(held, _)]]] = thief.xreadgroup(ACTORS, "hoarder", {side.keys.prompts: ">"}, count=1)  # r-1
        assert side.take_dead_letters() == [] and side.sent_again["unpending"] == 1
        assert run(work(cfg, "honest")) == ["r-2", "r-0"]  # r-0 again, as a new entry; both answered
        assert sorted(drain(side, 2)) == ["r-0", "r-2"]  # taken: waited on no more, though not yet committed
        side.submit_prompts([prompt(3)])
        [[_, [(entry, _)]]] = thief.xreadgroup(ACTORS, "honest", {side.keys.prompts: ">"}, count=1)  # r-3
        thief.xclaim(side.keys.prompts, ACTORS, "thief", 0, [entry], retrycount=100)  # "delivered 100 times"
        assert side.take_dead_letters() == []  # too young to have been claimed that often by silent actors
        for _ in range(600):  # r-1 (held), then r-3 (claimed), each once grant_timeout_s has passed
            if side.receipts.entry_of["r-3"] != entry:
                break
            assert side.take_dead_letters() == []
            time.sleep(0.1)
        assert side.receipts.entry_of["r-1"] != held and side.sent_again["overdue"] >= 2
        assert sorted(run(work(cfg, "other"))) == ["r-1", "r-3"]
        assert sorted(drain(side, 2)) == ["r-1", "r-3"]
        assert thief.xpending_range(side.keys.prompts, ACTORS, held, held, 1) == []  # the held entry withdrawn
        metrics = side.metrics()
        assert metrics["broker/sent_again/unpending"] == 1 and metrics["broker/sent_again/overdue"] >= 2
    finally:
        thief.close()
        side.close()


def test_a_barred_actors_rollouts_are_refused_and_what_it_holds_goes_to_the_others(redis_server):
    cfg = config(redis_server)
    side = learner(cfg)
    side.submit_prompts([prompt(0), prompt(1)])
    assert run(work(cfg, "liar", max_samples=4)) == ["r-0"]  # answered, but the learner has barred it meanwhile
    side.bar("liar")
    assert drain(side, 1, timeout_s=1.0) == []
    assert side.metrics()["broker/rejected/barred"] == 1
    side.take_dead_letters()  # the learner's poll: r-0, held by the barred actor, goes out again
    assert side.sent_again["barred"] == 1
    assert sorted(run(work(cfg, "honest"))) == ["r-0", "r-1"]
    assert sorted(drain(side, 2)) == ["r-0", "r-1"]
    assert side.metrics()["broker/barred_actors"] == 1
