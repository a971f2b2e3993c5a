"""`tidal ledger check`: a run's exactly-once promise from its ledger, and with --redis from its Redis streams too
(their contents constructed here), each violation named with its ids."""

import json
import os
import time

import pytest

from conftest import free_port
from tidal.broker.redis_streams import RunStreams
from tidal.config import load_config
from tidal.config.run import write_config
from tidal.learner.rank0.ledger import Ledger
from tidal.learner.tools.ledger_check import (
    ACKNOWLEDGED_FATELESS,
    DEAD_PROMPT_OUTSTANDING,
    LOST,
    NEVER_RELEASED,
    check_ledger,
    check_with_redis,
    cross_check,
    read_view,
)
from tidal.ops.cli import main


def write_run(run_dir, events, outstanding=None):
    """A ledger of `events` ((event, fields) pairs) and, when `outstanding` is given, the summary a finished
    run leaves (written after the ledger's last line)."""
    run_dir.mkdir(exist_ok=True)
    ledger = Ledger(run_dir / "ledger.jsonl")
    for event, fields in events:
        ledger.record(event, **fields)
    ledger.close()
    if outstanding is not None:
        (run_dir / "summary.json").write_text(json.dumps({"outstanding_groups": outstanding}))
    return run_dir


HEALTHY = [
    ("released", {"ids": ["r-0", "r-1", "r-2", "r-3", "r-4"]}),
    ("discarded", {"reason": "zero_variance", "id": "r-1"}),
    ("duplicate", {"id": "r-0"}),
    ("trained", {"step": 1, "ids": ["r-0", "r-2"]}),
    ("dead_letter", {"id": "r-3"}),
]


def test_a_finished_run_that_kept_its_promise_passes_with_its_tallies(tmp_path, capsys):
    run = write_run(tmp_path / "run", HEALTHY, outstanding=["r-4"])
    result = check_ledger(run)
    assert result.violations == [] and result.finished
    assert result.tallies() == {
        "released": 5,
        "trained": 2,
        "discarded": 1,
        "dead": 1,
        "outstanding": 1,
        "duplicates": 1,
    }
    assert main(["ledger", "check", str(run)]) == 0
    out = capsys.readouterr().out
    assert "5 training groups released over 1 steps: 2 trained once, 1 discarded (1 zero_variance)" in out
    assert "exactly once" in out


def test_a_run_still_going_on_has_groups_in_flight_not_lost(tmp_path):
    result = check_ledger(write_run(tmp_path / "run", HEALTHY))
    assert result.violations == [] and not result.finished and result.in_flight == 1


@pytest.mark.parametrize(
    "extra, outstanding, violation",
    [
        ([("trained", {"step": 2, "ids": ["r-2"]})], ["r-4"], "1 groups trained more than once: r-2"),
        ([("discarded", {"reason": "stale", "id": "r-0"})], ["r-4"], "1 groups both trained and discarded: r-0"),
        ([("released", {"ids": ["r-4"]})], ["r-4"], "1 groups released more than once: r-4"),
        ([("trained", {"step": 2, "ids": ["x-9"]})], ["r-4"], "1 groups trained or discarded but never released: x-9"),
        ([], [], "1 groups released and never trained, discarded, dead-lettered or left outstanding (lost): r-4"),
        ([], ["r-4", "r-2"], "1 groups outstanding at the end but trained, discarded or dead-lettered: r-2"),
    ],
)
def test_each_broken_promise_is_named_with_its_groups_and_exits_1(tmp_path, capsys, extra, outstanding, violation):
    run = write_run(tmp_path / "run", HEALTHY + extra, outstanding=outstanding)
    assert check_ledger(run).violations == [violation]
    assert main(["ledger", "check", str(run)]) == 1
    assert f"VIOLATION: {violation}" in capsys.readouterr().out


def test_a_summary_older_than_the_ledger_is_an_earlier_incarnations_and_the_run_is_still_going_on(tmp_path):
    run = write_run(tmp_path / "run", HEALTHY, outstanding=[])  # r-4 would be lost at this summary
    old = time.time() - 60
    os.utime(run / "summary.json", (old, old))  # a resumed run writes its ledger on; its summary comes at the end
    result = check_ledger(run)
    assert result.violations == [] and not result.finished and result.in_flight == 1


def test_no_ledger_or_a_damaged_one_is_said_and_exits_2(tmp_path, capsys):
    assert main(["ledger", "check", str(tmp_path)]) == 2
    assert "no ledger" in capsys.readouterr().out
    run = write_run(tmp_path / "run", HEALTHY)
    with open(run / "ledger.jsonl", "a") as f:
        f.write('not json\n{"event": "released", "ids": []}\n')
    assert main(["ledger", "check", str(run)]) == 2
    assert "line 6 is not a JSON record" in capsys.readouterr().out


# ---- the run's Redis streams against the ledger (`--redis`) -----------------------------------


def streams(**held) -> RunStreams:
    """What Redis holds: keyword `<stream>_<state>` (prompts_pending=["r-4"], ...) and dead={id: stream}."""
    out = RunStreams(where="tidal:t:* at redis://127.0.0.1:6379/0", dead=dict(held.pop("dead", {})))
    for key, ids in held.items():
        stream, state = key.split("_", 1)
        getattr(getattr(out, stream), state).update(ids)
    return out


def test_a_run_in_flight_that_redis_agrees_with_passes_and_tallies_what_waits_on_a_checkpoint(tmp_path):
    run = write_run(tmp_path / "run", HEALTHY)  # r-4 in flight
    held = streams(
        prompts_pending=["r-4", "r-2"],
        rollouts_pending=["r-2"],  # trained since the last checkpoint
        rollouts_undelivered=["r-1"],  # a second copy of a discarded group
        rollouts_acknowledged=["r-0"],
        dead={"r-3": "prompts"},
    )
    result = cross_check(read_view(run), held)
    assert result.violations == {}
    assert result.consumed_unacknowledged == {"r-2", "r-1"} and result.dead_unrecorded == set()
    assert result.stranded_prompts == set()  # r-2's prompt waits on the commit of its rollout
    # a second prompt entry of a trained group (its XADD retried after a lost reply): no commit acknowledges it
    assert cross_check(read_view(run), streams(prompts_pending=["r-4", "r-0"])).stranded_prompts == {"r-0"}
    assert "redis agrees" in result.lines()[-1]
    # in flight as a dead letter only: the learner records it at its next look, once a second
    result = cross_check(read_view(run), streams(dead={"r-4": "prompts"}))
    assert result.violations == {} and result.dead_unrecorded == {"r-4"}


@pytest.mark.parametrize(
    "held, violation",
    [
        (streams(prompts_pending=["r-2"], rollouts_acknowledged=["r-0"]), LOST),
        (streams(rollouts_acknowledged=["r-4"]), LOST),  # acknowledged is no longer waiting
        (streams(prompts_pending=["r-4"], rollouts_acknowledged=["r-4"]), ACKNOWLEDGED_FATELESS),
    ],
)
def test_a_run_in_flight_whose_group_redis_lost_or_acknowledged_without_a_fate_fails_naming_it(
    tmp_path, held, violation
):
    run = write_run(tmp_path / "run", HEALTHY)
    assert cross_check(read_view(run), held).violations.get(violation) == {"r-4"}


@pytest.mark.parametrize(
    "held, summary, violations, tallied",
    [
        (streams(prompts_undelivered=["r-4"]), {}, {}, {}),
        (streams(rollouts_pending=["r-4"]), {}, {}, {}),  # arrived during the final evaluation, left pending
        (streams(), {}, {LOST: {"r-4"}}, {}),
        (
            streams(prompts_acknowledged=["r-4"], rollouts_acknowledged=["r-4"]),
            {},
            {ACKNOWLEDGED_FATELESS: {"r-4"}},
            {},
        ),
        # a run that stopped early acknowledged the batch it stopped with: its final checkpoint sends them again
        (streams(rollouts_acknowledged=["r-4"]), {"stopped_early": "curriculum"}, {}, {"sent_again": 1}),
        (streams(prompts_pending=["r-4"], dead={"r-4": "prompts"}), {}, {DEAD_PROMPT_OUTSTANDING: {"r-4"}}, {}),
        # a rollout dead-lettered after the learner's last look at the dead letters
        (streams(prompts_pending=["r-4"], dead={"r-4": "rollouts"}), {}, {}, {"dead_unrecorded": 1}),
        (streams(prompts_undelivered=["r-4", "x-9"]), {}, {NEVER_RELEASED: {"x-9"}}, {}),
    ],
)
def test_a_finished_run_holds_its_outstanding_groups_and_nothing_it_did_not_release(
    tmp_path, held, summary, violations, tallied
):
    run = write_run(tmp_path / "run", HEALTHY, outstanding=["r-4"])
    if summary:
        (run / "summary.json").write_text(json.dumps({"outstanding_groups": ["r-4"], **summary}))
    result = cross_check(read_view(run), held)
    assert result.violations == violations
    assert {k: v for k, v in result.tallies().items() if k in tallied} == tallied


class Looks:
    """Redis as a run still going shows it: each look first lets the learner write `lines` to the ledger."""

    def __init__(self, run_dir, *looks):
        self.run_dir, self.looks = run_dir, list(looks)

    def __call__(self) -> RunStreams:
        lines, held = self.looks.pop(0)
        ledger = Ledger(self.run_dir / "ledger.jsonl")
        for event, fields in lines:
            ledger.record(event, **fields)
        ledger.close()
        return held


def test_a_run_going_on_between_the_reads_is_not_taken_for_a_loss(tmp_path):
    run = write_run(tmp_path / "run", HEALTHY)
    # r-4 trained and its entries acknowledged and trimmed just before Redis was read: the fate is read after
    looks = Looks(run, ([("trained", {"step": 2, "ids": ["r-4"]})], streams()))
    view, result = check_with_redis(run, looks)
    assert result.violations == {} and not view.fateless and looks.looks == []
    # r-5 released after the first reading of the ledger and not yet added to Redis: not looked for
    looks = Looks(run, ([("released", {"ids": ["r-5"]})], streams()))
    assert check_with_redis(run, looks)[1].violations == {}


def test_a_loss_is_reported_only_when_a_second_look_finds_it_too(tmp_path):
    run = write_run(tmp_path / "run", [*HEALTHY, ("released", {"ids": ["r-5"]})])  # r-4, r-5 in flight
    # the first look misses r-5's prompt (added a moment after its release), the second finds it; r-4 stays lost
    looks = Looks(run, ([], streams(prompts_pending=["r-4"])), ([], streams(prompts_undelivered=["r-5"])))
    result = check_with_redis(run, looks)[1]
    assert result.violations == {} and looks.looks == []
    looks = Looks(run, ([], streams(prompts_pending=["r-4"])), ([], streams(prompts_pending=["r-4"])))
    assert check_with_redis(run, looks)[1].violations == {LOST: {"r-5"}}


def run_with_config(run_dir, url: str):
    write_config(
        load_config(None, ["name=t", "broker.type=redis", f"broker.redis.url={url}", f"run_dir={run_dir}"]), run_dir
    )
    return write_run(run_dir, HEALTHY)


def test_a_redis_that_cannot_be_reached_is_named_without_its_password_and_exits_2(tmp_path, capsys):
    port = free_port()
    run = run_with_config(tmp_path / "run", f"redis://:hunter2@127.0.0.1:{port}/0")
    assert main(["ledger", "check", str(run), "--redis"]) == 2  # the URL of the run's config.yaml
    out = capsys.readouterr().out
    assert f"Redis at redis://:***@127.0.0.1:{port}/0 unreachable" in out and "hunter2" not in out
    assert main(["ledger", "check", str(run), "--redis", f"redis://u:pw@127.0.0.1:{port}/1"]) == 2
    assert f"redis://u:***@127.0.0.1:{port}/1 unreachable" in capsys.readouterr().out
    (run / "config.yaml").unlink()
    assert main(["ledger", "check", str(run), "--redis", f"redis://127.0.0.1:{port}/0"]) == 2
    assert "no config.yaml, which names the run's Redis streams" in capsys.readouterr().out


def test_a_run_stopped_by_a_signal_holds_its_groups_in_flight_not_lost(tmp_path):
    """A killed or failed learner still writes a summary (its error), naming no outstanding groups: those it
    held were in flight when it stopped, for a resume to take up, not lost."""
    run = write_run(tmp_path / "run", HEALTHY)
    (run / "summary.json").write_text(json.dumps({"error": "learner stopped by a signal"}))
    result = check_ledger(run)
    assert result.violations == [] and not result.finished and result.in_flight == 1
    (run / "summary.json").write_text(json.dumps({"outstanding_groups": []}))  # finished, r-4 named nowhere
    assert check_ledger(run).violations
