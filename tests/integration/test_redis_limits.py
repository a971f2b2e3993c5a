"""The Redis transport against a real redis-server with a small maxmemory: what actors write is
trimmed by the learner, a full Redis is back-pressure (not an error), a learner restarted on a full
AOF comes up and trims, and what one peer sends costs bounded bytes and log lines."""

import asyncio
import logging
import threading

import pytest
import redis

from conftest import prompt_group as prompt
from tidal.broker import redis_transport
from tidal.broker.redis_transport import (
    DEAD_FRAME_BYTES,
    RedisActorTransport,
    RedisLearnerTransport,
    dead_letter_fields,
)
from tidal.broker.schema import Heartbeat, WireCodec
from tidal.config import RedisConfig

JUNK = b"x" * 32 * 1024  # an entry larger than a stream node: each one is freed on its own when deleted
NUM_JUNK = 48  # 1.5 MiB of junk


def learner(server, fresh=True, max_actors=1024) -> RedisLearnerTransport:
    return RedisLearnerTransport(
        RedisConfig(url=server.url, block_ms=50),
        WireCodec(1 << 20),
        "t",
        actor_timeout_s=5,
        fresh=fresh,
        max_actors=max_actors,
    )


def fill(r: redis.Redis, key: str) -> int:
    """NUM_JUNK entries by XADD without MAXLEN (what an actor's password allows); returns the memory
    limit that makes Redis full: half a MiB below what it uses then (a limit at the very edge would
    race with the AOF buffer, which Redis does not count)."""
    for _ in range(NUM_JUNK):
        r.xadd(key, {"m": JUNK})
    return r.info("memory")["used_memory"] - 512 * 1024


def make_full(r: redis.Redis, key: str) -> None:
    r.config_set("maxmemory", fill(r, key))
    with pytest.raises(redis.ResponseError, match="maxmemory"):
        r.xadd("tidal:t:probe", {"m": b"1"})


def test_a_full_redis_makes_the_learner_wait_and_trim_not_fail(redis_server, caplog):
    side = learner(redis_server)
    r = redis.Redis.from_url(redis_server.url)
    make_full(r, "tidal:t:heartbeats")
    with caplog.at_level(logging.WARNING, logger="tidal.broker.redis_transport"):
        side.submit_prompts([prompt(0), prompt(1)])  # raised an OOM error before
    assert r.xlen("tidal:t:prompts") == 2
    assert r.xlen("tidal:t:heartbeats") <= 1  # the learner read the junk, refused it and trimmed it
    assert side.metrics()["broker/redis_oom_waits"] >= 1
    full = [rec for rec in caplog.records if "is full" in rec.getMessage()]
    assert len(full) == 1, "one warning per episode of pressure"
    assert sum("rejected" in rec.getMessage() and "heartbeat" in rec.getMessage() for rec in caplog.records) <= 2


def test_a_learner_restarted_on_a_full_aof_comes_up_and_trims(redis_server):
    first = learner(redis_server)
    first.close()
    r = redis.Redis.from_url(redis_server.url)
    limit = fill(r, "tidal:t:rollouts")  # made-up rollouts, never read
    r.close()
    redis_server.stop()
    redis_server.extra = ("--maxmemory", str(limit), "--maxmemory-policy", "noeviction")
    redis_server.start()  # replays the AOF: full
    r = redis.Redis.from_url(redis_server.url)
    with pytest.raises(redis.ResponseError, match="maxmemory"):
        r.xadd("tidal:t:prompts", {"m": b"1"})

    side = learner(redis_server, fresh=False)  # failed on XGROUP CREATE before
    assert side.recv_rollout(timeout_s=1.0) is None  # the junk is dead-lettered and deleted
    while r.xlen("tidal:t:rollouts"):
        assert side.recv_rollout(timeout_s=0.2) is None
    side.submit_prompts([prompt(0)])
    assert r.xlen("tidal:t:prompts") == 1
    dead = r.xrange("tidal:t:dead", count=1)
    assert dead and len(dead[0][1][b"m"]) <= DEAD_FRAME_BYTES


def test_an_actor_waits_on_a_full_redis_and_writes_once_there_is_room(redis_server):
    side = learner(redis_server)
    r = redis.Redis.from_url(redis_server.url)
    make_full(r, "tidal:t:junk")
    actor = RedisActorTransport(RedisConfig(url=redis_server.url, block_ms=50), WireCodec(1 << 20), "a0", "t")
    freed = threading.Timer(0.3, lambda: redis.Redis.from_url(redis_server.url).delete("tidal:t:junk"))

    async def beat():
        freed.start()
        await actor.heartbeat(Heartbeat(actor_id="a0", version=0, engine={}, outstanding=[], hello=True))
        await actor.r.aclose()

    asyncio.run(beat())  # raised an OOM error before
    freed.join()
    assert actor.link.oom_waits >= 1
    assert list(side.actors()) == ["a0"]


def test_dead_letters_keep_a_bounded_part_of_their_frame():
    record = dead_letter_fields(b"y" * (4 * DEAD_FRAME_BYTES), "rollouts", "decode")
    assert len(record["m"]) == DEAD_FRAME_BYTES and record["bytes"] == 4 * DEAD_FRAME_BYTES


def test_hellos_are_logged_on_change_only_and_new_ids_are_bounded(redis_server, monkeypatch, caplog):
    monkeypatch.setattr(redis_transport, "HEARTBEAT_POLL_S", 0.0)
    side = learner(redis_server, max_actors=3)
    codec = WireCodec(1 << 20)
    r = redis.Redis.from_url(redis_server.url)
    engine = {"model": "m" * 1000, "pid": "1"}
    with caplog.at_level(logging.INFO, logger="tidal.broker.base"):
        for _ in range(50):  # the same hello again and again
            r.xadd(
                "tidal:t:heartbeats",
                {"m": codec.encode(Heartbeat(actor_id="a0", version=0, engine=engine, outstanding=[], hello=True))},
            )
        side.actors()
        for i in range(1, 6):  # fresh ids beyond the table's bound
            r.xadd(
                "tidal:t:heartbeats",
                {"m": codec.encode(Heartbeat(actor_id=f"a{i}", version=0, engine={}, outstanding=[], hello=True))},
            )
        assert sorted(side.actors()) == ["a0", "a1", "a2"]
    joined = [rec.getMessage() for rec in caplog.records if "joined" in rec.getMessage()]
    assert sum(m.startswith("actor a0 ") for m in joined) == 1
    assert max(len(m) for m in joined) < 700  # the engine description is cut
    assert side.metrics()["broker/rejected/too_many_actors"] == 3
    assert len(side.take_joins()) == 3
    assert r.xlen("tidal:t:heartbeats") <= 1  # read heartbeats are trimmed by the learner
