"""No-positive-resampling curriculum: prompts whose pass rate reaches curriculum.retire_pass_rate
are never dispatched again, also after a resume; a fully retired dataset fails loudly."""

import json
import time

import pytest

from tidal.broker.inproc import InprocBroker
from tidal.broker.schema import SamplingParams, WireCodec
from tidal.config import CurriculumConfig
from tidal.learner.rank0.coordinator import Coordinator, DispatchPlan
from tidal.learner.rank0.curriculum import Curriculum, CurriculumExhausted
from tidal.learner.rank0.groups import GroupBook
from tidal.learner.rank0.ledger import Ledger, read_ledger
from tidal.tasks import Prompt

ALL_PASS, ONE_PASS = [1.0] * 4, [1.0, 0.0, 0.0, 0.0]


class Released:
    """The prompt groups the coordinator thread submitted, as the in-process broker queues them (no
    actor takes any here, so every one is still in the queue, in order)."""

    def __init__(self):
        self.broker = InprocBroker(WireCodec(1 << 20))
        self.transport = self.broker.learner()

    @property
    def groups(self):
        with self.broker.lock:
            return list(self.broker.grants.pending)

    def count(self) -> int:
        return len(self.groups)


def wait_for(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def build(tmp_path, num_prompts, groups_per_step, cfg=CurriculumConfig(min_samples=4), name="ledger.jsonl"):
    plan = DispatchPlan(
        run_id="r",
        task="arithmetic",
        n=4,
        sampling=SamplingParams(),
        eval_n=1,
        eval_sampling=SamplingParams(),
        groups_per_step=groups_per_step,
        max_lag=0,
        seed=0,
    )
    train = [Prompt(prompt_id=10 + i, text="1+1=", payload={"answer": "02"}) for i in range(num_prompts)]
    released = Released()
    coordinator = Coordinator(
        plan, train, [], lambda text: [1, 2], released.transport, GroupBook(Ledger(tmp_path / name)), cfg
    )
    return coordinator, released


def train_rounds(coordinator, transport, rounds, easy, seen_from=0):
    """Consume each released window like the learner: rewards in, then one step frees the slots.
    Returns the prompt ids released after each prompt of `easy` was retired."""
    after_retired, retired = [], set()
    for _ in range(rounds):
        wait_for(lambda seen=seen_from: transport.count() >= seen + coordinator.window)
        window = transport.groups[seen_from : seen_from + coordinator.window]
        seen_from += len(window)
        after_retired += [g.prompt_id for g in window if g.prompt_id in retired]
        for g in window:
            assert coordinator.book.claim(g.group_id)
            coordinator.on_rewards(g.prompt_id, ALL_PASS if g.prompt_id in easy else ONE_PASS)
            retired |= {g.prompt_id} & easy  # min_samples = 4 = one group: judged at once
        coordinator.on_step(coordinator.version + 1, [g.group_id for g in window])
    return after_retired, seen_from


# ---- the pass-rate bookkeeping -------------------------------------------------------------------


def test_a_prompt_is_judged_after_min_samples_and_retired_at_the_threshold():
    cur = Curriculum(CurriculumConfig(retire_pass_rate=0.75, min_samples=8), prompt_ids=[1, 2])
    assert cur.add(1, [1.0] * 4) is None  # 4 of 8 samples: not judged yet
    assert cur.add(1, [1.0, 1.0, 0.0, 0.0]) == (8, 0.75)  # 6 of 8 = 0.75 >= 0.75: retired
    assert cur.is_retired(1) and not cur.is_retired(2)
    # prompt 2: 5 of 8 is judged and kept; the next judgement starts from fresh samples
    assert cur.add(2, [1.0, 1.0, 1.0, 0.0]) is None
    assert cur.add(2, [1.0, 1.0, 0.0, 0.0]) is None
    assert 2 not in cur.pending and not cur.is_retired(2)
    assert cur.add(2, [1.0] * 8) == (8, 1.0)
    assert cur.exhausted


def test_unknown_prompts_and_a_disabled_curriculum_change_nothing():
    cur = Curriculum(CurriculumConfig(min_samples=1), prompt_ids=[1])
    assert cur.add(99, [1.0]) is None and not cur.pending  # an eval or foreign prompt id
    off = Curriculum(CurriculumConfig(enabled=False, min_samples=1), prompt_ids=[1])
    assert off.add(1, [1.0]) is None and not off.retired and not off.exhausted
    assert Curriculum(None, prompt_ids=[1]).add(1, [1.0]) is None  # a coordinator built without a config


def test_a_pass_means_a_reward_at_least_the_pass_threshold():
    cur = Curriculum(CurriculumConfig(retire_pass_rate=0.5, min_samples=4), prompt_ids=[1])
    assert cur.add(1, [0.1, 0.1, 0.9, 1.0]) is None  # partial credit is no pass: 1 of 4 at 1.0, 0.25 < 0.5
    assert cur.add(1, [1.0, 1.5, -1.0, 0.0]) == (4, 0.5)
    low = Curriculum(CurriculumConfig(retire_pass_rate=0.5, min_samples=4), prompt_ids=[1], pass_threshold=0.5)
    assert low.add(1, [0.1, 0.5, 0.9, 0.0]) == (4, 0.5)  # 0.5 and 0.9 reach task.pass_threshold = 0.5


def test_state_round_trips_through_json():
    cur = Curriculum(CurriculumConfig(min_samples=4), prompt_ids=[1, 2])
    cur.add(1, ALL_PASS)
    cur.add(2, [1.0, 1.0])
    again = Curriculum(CurriculumConfig(min_samples=4), prompt_ids=[1, 2])
    again.load_state_dict(json.loads(json.dumps(cur.state_dict())))
    assert again.retired == {1} and again.pending == {2: [2, 2]}
    assert again.add(2, [1.0, 1.0]) == (4, 1.0)  # the two pending samples still count


# ---- the coordinator -----------------------------------------------------------------------------


def test_retired_prompts_are_never_dispatched_again(tmp_path):
    coordinator, transport = build(tmp_path, num_prompts=4, groups_per_step=2)
    coordinator.start()
    try:
        after_retired, _ = train_rounds(coordinator, transport, rounds=12, easy={10, 12})
    finally:
        coordinator.stop()
    assert after_retired == []
    late = [g.prompt_id for g in transport.groups[-8:]]
    assert set(late) == {11, 13}  # the hard prompts keep coming, epoch after epoch
    assert coordinator.num_retired_prompts == 2
    events = read_ledger(tmp_path / "ledger.jsonl")
    retired = [e for e in events if e["event"] == "retired"]
    assert sorted(e["prompt_id"] for e in retired) == [10, 12]
    assert all(e["pass_rate"] == 1.0 and e["samples"] == 4 for e in retired)


def test_a_resumed_coordinator_never_dispatches_a_retired_prompt(tmp_path):
    first, transport = build(tmp_path, num_prompts=4, groups_per_step=2)
    first.start()
    try:
        train_rounds(first, transport, rounds=6, easy={10, 12})
    finally:
        first.stop()
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    assert state["curriculum"]["retired"] == [10, 12]
    resumed, transport = build(tmp_path, num_prompts=4, groups_per_step=2, name="resumed.jsonl")
    resumed.load_state_dict(state)
    resumed.book.outstanding.clear()  # what was in flight at the checkpoint is not what this test is about
    resumed.start()
    try:
        train_rounds(resumed, transport, rounds=6, easy=set())
    finally:
        resumed.stop()
    assert {g.prompt_id for g in transport.groups} == {11, 13}
    assert resumed.num_retired_prompts == 2


def test_every_prompt_retired_stops_dispatch_and_fails_once_nothing_is_in_flight(tmp_path):
    # 2 prompts, 3 groups in the window: epoch 0 is both prompts, the third group opens epoch 1
    coordinator, transport = build(tmp_path, num_prompts=2, groups_per_step=3)
    coordinator.start()
    try:
        wait_for(lambda: transport.count() == 3)
        first, second, third = transport.groups
        assert first.prompt_id != second.prompt_id
        for g in (first, second):
            coordinator.book.claim(g.group_id)
            coordinator.check()  # one prompt left, or a group still in flight
            coordinator.on_rewards(g.prompt_id, ALL_PASS)
        assert coordinator.curriculum.exhausted
        coordinator.check()  # the third group is still to come: it may complete the step
        coordinator.book.claim(third.group_id)
        with pytest.raises(CurriculumExhausted, match="curriculum.retire_pass_rate = 0.9"):
            coordinator.check()
        coordinator.on_step(1, [first.group_id, second.group_id, third.group_id])
        time.sleep(0.2)
        assert transport.count() == 3  # free slots, and nothing more released
    finally:
        coordinator.stop()
    events = [e["event"] for e in read_ledger(tmp_path / "ledger.jsonl")]
    assert events.count("retired") == 2 and "curriculum_exhausted" in events


def test_without_a_curriculum_every_prompt_comes_back(tmp_path):
    coordinator, transport = build(tmp_path, num_prompts=4, groups_per_step=2, cfg=None)
    coordinator.start()
    try:
        train_rounds(coordinator, transport, rounds=8, easy={10, 12})
    finally:
        coordinator.stop()
    assert {g.prompt_id for g in transport.groups[-8:]} == {10, 11, 12, 13}
    assert coordinator.num_retired_prompts == 0
