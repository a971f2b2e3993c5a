"""Two gloo ranks out of step fail at once, naming the collective, instead of hanging: every collective
of the step runner in turn, skipped, raised in, or moved on rank 1 (rank_faults.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from rank_faults import CASES, TIMEOUT_S

from tidal.learner.every_rank.ranks import Collective

SCRIPT = Path(__file__).with_name("rank_faults.py")


def run_both_ranks(out_dir: Path) -> list[dict]:
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(rank), str(out_dir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        logs = [rank.communicate(timeout=120)[0] for rank in ranks]  # a hang fails here
    finally:
        for rank in ranks:
            rank.kill()
    assert all(rank.returncode == 0 for rank in ranks), "\n".join(log[-3000:] for log in logs)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def noted(outcome: dict, what: Collective | None = None) -> bool:
    """A note on the rank's error names `what` (None: any collective of the step runner)."""
    return any(c.value in note for note in outcome["notes"] for c in ([what] if what else Collective))


# 2 processes, 15 cases of a restore and two steps, one of them waiting out the 3 s timeout: about 10 s on 2 cores
def test_a_rank_out_of_step_fails_fast_naming_the_collective(tmp_path):
    rank0, rank1 = run_both_ranks(tmp_path)
    assert set(rank0) == set(rank1) == set(CASES)
    # in step: a restore, the starting push, two steps of batch, train and push, the due and the final save,
    # the export
    for ranks in (rank0, rank1):
        assert ranks["in step"] | {"seconds": 0} == {
            "error": None,
            "message": "",
            "notes": [],
            "seconds": 0,
            "version": 2,
            "collectives": 11,
        }
    for case in CASES:
        if case != "skip EXPORT and stay":  # nothing else waits for the process group's timeout
            assert rank0[case]["seconds"] < TIMEOUT_S and rank1[case]["seconds"] < TIMEOUT_S, case
    # skipped or moved: both ranks name what each called, at the first collective they differ in
    moved = [(f"skip {what.name}", what) for what in Collective if what != Collective.EXPORT]
    for case, what in [*moved, ("save before push", Collective.PUSH)]:
        assert rank0[case]["error"] == rank1[case]["error"] == "RanksOutOfStep", case
        assert rank0[case]["message"] == rank1[case]["message"], case
        assert f"while rank 0 called {what.value} (collective #" in rank0[case]["message"], case
    assert "rank 1 called checkpoint save" in rank0["save before push"]["message"]
    assert "rank 1 called train step" in rank0["skip BATCH"]["message"]
    # rank 1 raises inside a collective: its error keeps its type, with a note naming the collective; rank 0,
    # left inside it (or the next), fails as soon as rank 1 leaves, its error noted with where it was
    for what in Collective:
        case = f"raise {what.name}"
        assert rank1[case]["error"] == "InjectedFault", case
        assert rank1[case]["notes"] == [
            f"raised on learner rank 1 inside {what.value} (collective "
            f"#{rank1[case]['collectives']}, version {rank1[case]['version']})"
        ], case
        assert rank0[case]["error"] is not None and noted(rank0[case]), case
    # rank 1 ends without the final export: rank 0 fails when rank 1 leaves the group, or, where rank 1
    # stays in it, after the process group's timeout, never later
    for case in ("skip EXPORT", "skip EXPORT and stay"):
        assert rank1[case]["error"] is None and rank1[case]["collectives"] == 10, case
        assert noted(rank0[case], Collective.EXPORT), case
        assert "waiting for the other ranks" in rank0[case]["notes"][0], case
    assert TIMEOUT_S <= rank0["skip EXPORT and stay"]["seconds"] < TIMEOUT_S + 5
