"""Evaluations: the version travels as a field; groups given up on complete an evaluation without them, refused
ones leave it unlogged; no newer version is announced while one is under way."""

import math

from conftest import rollout
from tidal.broker.schema import WeightUpdate
from tidal.learner.rank0.evaluation import Evaluations, HeldAnnouncements
from tidal.learner.rank0.groups import Release


def released(*ids: str, version: int) -> dict[str, Release]:
    return {gid: Release(i, version, 1, "", eval_version=version) for i, gid in enumerate(ids)}


def eval_group(group_id: str, version: int, reward: float):
    group = rollout(reward=reward, group_id=group_id)
    group.eval_version = version
    return group


def test_a_pass_rate_per_version_from_the_eval_version_field():
    evals = Evaluations()
    evals.expect(4, released("x", "y", version=4))
    evals.expect(6, released("z", version=6))
    assert evals.add(eval_group("x", 4, 1.0)) is None
    assert evals.add(eval_group("z", 6, 0.0)) == (6, 0.0)
    assert evals.add(eval_group("x", 4, 1.0)) is None  # a duplicate changes nothing
    assert evals.add(eval_group("y", 4, 0.0)) == (4, 0.5)
    assert not evals.waiting() and evals.results == {4: 0.5, 6: 0.0}


def test_a_dead_lettered_group_completes_its_evaluation_without_it():
    evals = Evaluations()
    evals.expect(2, released("a", "b", version=2))
    evals.add(eval_group("a", 2, 1.0))
    assert evals.owns("b") and not evals.owns("train-17")
    assert evals.drop("b") == (2, 1.0)
    assert evals.pending_versions() == []


def test_the_pass_rate_counts_rewards_at_the_threshold_and_the_mean_reward_is_kept_apart():
    evals = Evaluations(pass_threshold=1.0)
    evals.expect(3, released("a", "b", "c", "d", version=3))
    for gid, reward in zip("abcd", (1.0, 0.1, 0.1, 0.0)):  # partial credit for two wrong answers
        done = evals.add(eval_group(gid, 3, reward))
    assert done == (3, 0.25)  # the mean reward, 0.3, was logged as the pass rate
    assert abs(evals.reward_means[3] - 0.3) < 1e-9
    lenient = Evaluations(pass_threshold=0.1)
    lenient.expect(3, released("a", "b", version=3))
    lenient.add(eval_group("a", 3, 0.1))
    assert lenient.add(eval_group("b", 3, 0.0)) == (3, 0.5)


def test_an_evaluation_with_a_refused_group_is_not_a_pass_rate():
    """Refused groups (a reward outside task.reward_range) would leave out exactly the groups that scored
    highest: the evaluation completes, and says it is not a pass rate."""
    evals = Evaluations()
    evals.expect(5, released("a", "b", version=5))
    evals.add(eval_group("a", 5, 0.0))
    version, rate = evals.drop("b", refused="reward")
    assert version == 5 and math.isnan(rate) and 5 not in evals.results
    assert evals.refused[5] == {"reward": 1} and evals.sizes[5] == 2


def test_samples_made_by_another_version_are_counted():
    evals = Evaluations()
    evals.expect(4, released("x", version=4))
    group = eval_group("x", 4, 1.0)
    group.samples[0].version_spans = [(4, 0, 2), (5, 2, 3)]  # a weight update landed mid-sample
    evals.add(group)
    assert evals.off_version_samples == 1 and evals.multi_version_samples == 1


class FakeEvaluator:
    def __init__(self):
        self.started: list[int] = []
        self.pending = False

    def waiting(self) -> bool:
        return self.pending

    def start(self, version: int) -> None:
        self.started.append(version)
        self.pending = True


def update(version: int) -> WeightUpdate:
    return WeightUpdate(version=version, transport="file", location="/w", manifest=[], checksum="c")


def test_no_newer_version_is_announced_while_an_evaluation_is_under_way():
    evaluator, announced = FakeEvaluator(), []
    held = HeldAnnouncements(evaluator, lambda u: announced.append(u.version), clock=iter(range(100)).__next__)
    held.announce(update(0))
    held.evaluate()
    assert announced == [0] and evaluator.started == [0]
    held.announce(update(1))
    held.announce(update(2))  # the learner trains on: the actors stay on 0
    held.evaluate()  # due at 2 while 0's is under way: it waits for the hold to end
    assert announced == [0] and evaluator.started == [0] and held.due
    evaluator.pending = False  # 0's last group is in
    held.release()
    assert announced == [0, 2] and evaluator.started == [0, 2] and not held.due
    held.announce(update(3))
    assert announced == [0, 2] and held.held_s > 0  # 2's evaluation holds 3
    evaluator.pending = False
    held.release()
    assert announced == [0, 2, 3] and evaluator.started == [0, 2]
