"""Evaluations: the version travels as a field; groups given up on complete an evaluation without them."""
from conftest import rollout
from tidal.learner.evaluation import Evaluations
from tidal.learner.groups import Release


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
