"""`tidal ledger check`: a run's exactly-once promise from its ledger, each violation named with its ids."""

import json
import os
import time

import pytest

from tidal.learner.rank0.ledger import Ledger
from tidal.learner.tools.ledger_check import check_ledger
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
