"""The step runner issues the same collectives in the same order on rank 0 and on the others, and its
guard stops ranks out of step with an error naming what each called (two real ranks:
tests/integration/test_rank_faults.py)."""

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import step_batch
from tidal.health import HealthFile
from tidal.learner.every_rank.ranks import Collective, Position, RankGroup, RanksOutOfStep, WeightPush
from tidal.learner.rank0.admission import StepBatch
from tidal.learner.steps import Follower, StepRunner

RESTORE, BATCH, TRAIN, PUSH, SAVE, EXPORT = (
    Collective.RESTORE,
    Collective.BATCH,
    Collective.TRAIN,
    Collective.PUSH,
    Collective.SAVE,
    Collective.EXPORT,
)


class Ranks(RankGroup):
    """One of two ranks whose peer is always at the same collective: records each, and the batches."""

    def __init__(self, rank: int, received: list | None = None):
        super().__init__(SimpleNamespace(process_index=rank, num_processes=2, device="cpu"))
        self.positions: list[Position] = []
        self.sent: list[tuple[list, list]] = []
        self.received = received or []  # what rank 0 sent, in order

    def _positions(self, here: Position) -> list[Position]:
        self.positions.append(here)
        return [here, here]

    def send(self, groups, masks) -> None:
        self.sent.append((groups, masks))

    def recv(self):
        return self.received.pop(0)


class Trainer:
    policy = None

    def step(self, groups, masks, version: int) -> dict[str, float]:
        return {"learner/num_groups": float(len(groups))}

    def weights(self, dtype: str):
        return [], iter([])

    def export_state(self, dtype: str) -> dict:
        return {}


class Checkpointer:
    def __init__(self):
        self.saved: list[int] = []

    def due(self, version: int) -> bool:
        return version % 2 == 0

    def save(self, version: int, state: dict) -> None:
        self.saved.append(version)

    def load(self, path: Path) -> dict:
        return {"version": 1}


class Collector(Follower):
    """Rank 0's role, reduced to its step batches: `num_batches` of them, then None (the run ends early)."""

    def __init__(self, steps: StepRunner, num_batches: int):
        super().__init__(steps, HealthFile(""))
        self.num_batches = num_batches

    def collect(self) -> StepBatch | None:
        self.num_batches -= 1
        return StepBatch(*step_batch(2)) if self.num_batches >= 0 else None


def runner(ranks: Ranks, max_steps: int) -> StepRunner:
    return StepRunner(Trainer(), Checkpointer(), ranks, WeightPush("float32"), None, max_steps)


def run_both(max_steps: int, num_batches: int) -> tuple[StepRunner, StepRunner]:
    """Rank 0, then rank 1 on what rank 0 sent; both restored from a checkpoint at version 1."""
    rank0 = runner(Ranks(0), max_steps)
    rank0.restore(Path("step-000001"))
    Collector(rank0, num_batches).run()
    rank1 = runner(Ranks(1, received=list(rank0.ranks.sent)), max_steps)
    rank1.restore(Path("step-000001"))
    Follower(rank1, HealthFile("")).run()
    return rank0, rank1


def collectives(steps: StepRunner) -> list[tuple[Collective, int]]:
    return [(p.what, p.version) for p in steps.ranks.positions]


def test_rank_0_and_a_follower_issue_the_same_collectives_in_the_same_order():
    rank0, rank1 = run_both(max_steps=4, num_batches=10)
    assert (
        collectives(rank0)
        == collectives(rank1)
        == [
            (RESTORE, 0),
            (PUSH, 1),  # version 1 once restored
            (BATCH, 1),
            (TRAIN, 1),
            (PUSH, 2),
            (SAVE, 2),  # due at 2
            (BATCH, 2),
            (TRAIN, 2),
            (PUSH, 3),
            (BATCH, 3),
            (TRAIN, 3),
            (PUSH, 4),
            (SAVE, 4),
            (SAVE, 4),
            (EXPORT, 4),
        ]
    )  # the final save and the final gather
    assert [p.count for p in rank1.ranks.positions] == list(range(1, 16))
    assert rank0.version == rank1.version == 4 and rank0.checkpointer.saved == rank1.checkpointer.saved == [2, 4, 4]


def test_a_run_rank_0_ends_early_ends_on_every_rank_with_the_same_collectives():
    rank0, rank1 = run_both(max_steps=4, num_batches=1)
    assert [len(groups) for groups, _ in rank0.ranks.sent] == [2, 0]  # the second batch: empty, the run is over
    assert (
        collectives(rank0)
        == collectives(rank1)
        == [(RESTORE, 0), (PUSH, 1), (BATCH, 1), (TRAIN, 1), (PUSH, 2), (SAVE, 2), (BATCH, 2), (SAVE, 2), (EXPORT, 2)]
    )


class Peer(Ranks):
    """Rank 0 of two whose peer, rank 1, is at `theirs`."""

    def __init__(self, theirs: Position):
        super().__init__(0)
        self.theirs = theirs

    def _positions(self, here: Position) -> list[Position]:
        return [here, self.theirs]


def test_ranks_out_of_step_raise_before_the_collective_naming_what_each_called():
    ranks = Peer(Position(1, SAVE, 3))
    with pytest.raises(RanksOutOfStep) as raised, ranks.collective(PUSH, version=3):
        pytest.fail("the collective ran with a rank out of step")
    assert str(raised.value) == (
        "learner ranks out of step: rank 1 called checkpoint save (collective #1, version 3) "
        "while rank 0 called weight push (collective #1, version 3)"
    )
    ranks = Peer(Position(1, PUSH, 4))  # the same collective at another version: out of step too
    with pytest.raises(RanksOutOfStep, match="rank 1 called weight push .collective #1, version 4. while rank 0"):
        with ranks.collective(PUSH, version=3):
            pass


def test_an_error_inside_a_collective_keeps_its_type_and_message_and_is_noted_with_the_collective():
    ranks = Ranks(1)
    with ranks.collective(PUSH, version=0):
        pass
    with pytest.raises(ValueError) as raised, ranks.collective(TRAIN, version=0):
        raise ValueError("learner.groups_per_step too small")
    assert str(raised.value) == "learner.groups_per_step too small"
    assert raised.value.__notes__ == ["raised on learner rank 1 inside train step (collective #2, version 0)"]


def test_one_rank_exchanges_nothing():
    ranks = RankGroup(SimpleNamespace(process_index=0, num_processes=1, device="cpu"))
    with ranks.collective(TRAIN, version=0):
        pass
    assert ranks.num_collectives == 0
    batch = StepBatch(*step_batch(2))
    assert runner(ranks, 1).exchange(batch) is batch


class SlowCollector(Collector):
    """Rank 0 whose batches take `wait_s` to arrive; keeps each step's metrics."""

    def __init__(self, steps: StepRunner, num_batches: int, wait_s: float):
        super().__init__(steps, num_batches)
        self.wait_s, self.metrics = wait_s, []

    def collect(self) -> StepBatch | None:
        time.sleep(self.wait_s)
        return super().collect()

    def on_step(self, batch: StepBatch, metrics: dict[str, float]) -> None:
        self.metrics.append(metrics)


def test_each_step_says_how_long_its_batch_took_to_arrive():
    role = SlowCollector(runner(Ranks(0), max_steps=2), num_batches=2, wait_s=0.05)
    role.run()
    assert len(role.metrics) == 2
    assert all(0.05 <= m["timing/collect_s"] < 1.0 for m in role.metrics)
    assert all(m["timing/weight_push_s"] >= 0 for m in role.metrics)
