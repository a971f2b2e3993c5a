"""`tidal ledger check --redis` against a real redis-server, its streams written by the real Redis
transports: a run that kept its promise passes, in flight and after its learner resumed; a prompt entry
removed behind the learner's back is a lost group, named."""

import asyncio

import msgspec
import pytest
import redis

from conftest import prompt_group, rollout
from tidal.broker.redis_transport import RedisActorTransport, RedisLearnerTransport, StreamKeys
from tidal.broker.schema import WireCodec
from tidal.config import load_config
from tidal.config.run import write_config
from tidal.learner.rank0.groups import GroupBook, Release
from tidal.learner.rank0.ledger import Ledger
from tidal.learner.tools.ledger_check import LOST, check_with_redis, streams_of
from tidal.ops.cli import main

RUN = "t"  # the run's name: its streams are tidal:t:*
GROUPS = {g.group_id: g for g in map(prompt_group, range(6))}  # r-0 ... r-5


@pytest.fixture
def run_dir(tmp_path, redis_server):
    """A run folder whose config.yaml names the run and its Redis."""
    run_dir = tmp_path / "run"
    redis_keys = ["broker.type=redis", f"broker.redis.url={redis_server.url}", "broker.redis.block_ms=100"]
    write_config(load_config(None, [f"name={RUN}", f"run_dir={run_dir}", *redis_keys]), run_dir)
    return run_dir


def learner_side(run_dir, fresh: bool) -> RedisLearnerTransport:
    cfg = load_config(run_dir / "config.yaml").broker.redis
    return RedisLearnerTransport(cfg, WireCodec(1 << 20), RUN, actor_timeout_s=5, fresh=fresh)


def release(book: GroupBook, side: RedisLearnerTransport, groups) -> None:
    """As the coordinator does: into the book (a ledger line) first, then into Redis."""
    book.release({g.group_id: Release(g.prompt_id, 0, g.n, "") for g in groups})
    side.submit_prompts(groups)


async def actor_answers(run_dir, answer: list[str], junk_for: str, max_samples: int) -> list[str]:
    """One actor takes what fits `max_samples`, answers the groups in `answer`, sends a frame the learner cannot
    read for `junk_for` (it is dead-lettered), and holds the rest."""
    cfg = load_config(run_dir / "config.yaml").broker.redis
    actor = RedisActorTransport(cfg, WireCodec(1 << 20), "a0", RUN)
    taken = await actor.request_work(max_samples, timeout_s=2.0)
    for group in taken:
        if group.group_id in answer:
            await actor.send_rollout(rollout(group_id=group.group_id, actor_id="a0"))
        elif group.group_id == junk_for:
            await actor.r.xadd(StreamKeys("tidal", RUN).rollouts, {"m": msgspec.msgpack.encode({"group_id": junk_for})})
    await actor.r.aclose()
    return [g.group_id for g in taken]


def take(side: RedisLearnerTransport, book: GroupBook, want: str) -> None:
    group = side.recv_rollout(timeout_s=5.0)  # returns as soon as a rollout is in
    assert group is not None and group.group_id == want
    assert book.claim(want) == "new"


def a_run_in_flight(run_dir) -> tuple[RedisLearnerTransport, GroupBook, dict]:
    """r-0 trained and r-1 discarded, both acknowledged at a checkpoint; r-2 dead-lettered (its rollout
    unreadable); r-3 trained after the checkpoint, not yet acknowledged; r-4 at the actor, r-5 and an
    evaluation group not delivered. Returns the transport, the book and what the checkpoint holds."""
    side, book = learner_side(run_dir, fresh=True), GroupBook(Ledger(run_dir / "ledger.jsonl"))
    release(book, side, list(GROUPS.values()))
    side.submit_prompts([prompt_group(6, eval_version=0)])  # evaluations are not in the ledger
    held = asyncio.run(actor_answers(run_dir, ["r-0", "r-1", "r-3"], junk_for="r-2", max_samples=20))
    assert held == ["r-0", "r-1", "r-2", "r-3", "r-4"]
    take(side, book, "r-0")
    take(side, book, "r-1")
    book.trained(1, ["r-0"])
    book.discard("r-1", "zero_variance")
    checkpoint = {"ledger_offset": book.ledger.offset(), "outstanding": sorted(book.outstanding)}
    side.commit()
    take(side, book, "r-3")
    book.trained(2, ["r-3"])
    for group_id in side.take_dead_letters():
        book.dead_letter(group_id)
    return side, book, checkpoint


def test_a_run_in_flight_agrees_with_redis_until_a_prompt_entry_is_removed(run_dir, redis_server, capsys):
    side, book, _ = a_run_in_flight(run_dir)
    elsewhere = redis_server.url.removesuffix("/0") + "/1"  # another database: none of the run's streams
    assert main(["ledger", "check", str(run_dir), "--redis", elsewhere]) == 2
    assert f"Redis at {elsewhere} holds none of run 't'" in capsys.readouterr().out
    assert main(["ledger", "check", str(run_dir), "--redis", redis_server.url]) == 0, capsys.readouterr().out
    assert "redis agrees" in capsys.readouterr().out
    view, against = check_with_redis(run_dir, streams_of(run_dir, ""))
    assert view.fateless == {"r-4", "r-5"} and view.dead == {"r-2"}
    assert against.tallies() == {
        "prompts_undelivered": 1,  # r-5 (the evaluation group is left out)
        "prompts_pending": 3,  # r-2 (dead-lettered from its rollout), r-3 (acknowledged at the next commit), r-4
        "rollouts_unacknowledged": 1,  # r-3
        "rollouts_acknowledged": 2,  # r-0 and r-1: the commit trims approximately, whole nodes only
        "dead": 1,
        "consumed_unacknowledged": 1,  # r-3: trained, acknowledged at the next checkpoint
        "dead_unrecorded": 0,
        "stranded_prompts": 1,  # r-2: its rollout dead-lettered, its prompt stays with the actor
        "sent_again": 0,
    }

    r = redis.Redis.from_url(redis_server.url)
    prompts = StreamKeys("tidal", RUN).prompts
    [entry] = [e for e, f in r.xrange(prompts) if msgspec.msgpack.decode(f[b"m"])["group_id"] == "r-4"]
    r.xack(prompts, "actors", entry)
    r.xdel(prompts, entry)  # gone: no actor will answer r-4, and the learner waits on it
    assert main(["ledger", "check", str(run_dir), "--redis", redis_server.url]) == 1
    assert f"VIOLATION: 1 groups {LOST}: r-4" in capsys.readouterr().out
    side.close()
    book.ledger.close()


def test_a_learner_resumed_from_its_checkpoint_agrees_with_redis(run_dir, redis_server, capsys):
    """Killed after r-3's step: the resumed learner cuts the ledger back to the checkpoint and sends again
    what was outstanding there; r-3, trained again later, is in flight, its old rollout still pending."""
    side, book, checkpoint = a_run_in_flight(run_dir)
    assert checkpoint["outstanding"] == ["r-2", "r-3", "r-4", "r-5"]
    side.close()
    book.ledger.close()
    resumed = learner_side(run_dir, fresh=False)
    book = GroupBook(Ledger(run_dir / "ledger.jsonl", truncate_to=checkpoint["ledger_offset"]))
    resumed.resubmit_prompts([GROUPS[g] for g in checkpoint["outstanding"]])
    assert main(["ledger", "check", str(run_dir), "--redis", redis_server.url]) == 0, capsys.readouterr().out
    _, against = check_with_redis(run_dir, streams_of(run_dir, redis_server.url))
    assert against.tallies()["dead_unrecorded"] == 1  # r-2's dead letter, cut from the ledger, read again
    assert against.tallies()["prompts_undelivered"] == 4  # r-2 ... r-5, sent again
    resumed.close()
    book.ledger.close()
