"""The learner's refusals are never silent: a reason that takes more than a few percent of a step's groups
is said once with the setting that fixes it; most groups refused for several steps stop the run."""

import logging

import pytest

from tidal.learner.rank0.refusals import RefusalWatch, RolloutsRefused

RANGE = "a reward of 10.2 (task reward 10.2) outside task.reward_range = [-10, 10]"


def test_a_reason_above_a_few_percent_of_a_step_is_said_once_with_its_setting(caplog):
    watch = RefusalWatch(groups_per_step=16, patience_steps=5)
    with caplog.at_level(logging.WARNING, logger="tidal.notice"):
        for _ in range(3):
            for i in range(16):
                watch.observe("reward" if i < 2 else None, RANGE if i < 2 else "")
            assert watch.step_metrics() == {"learner/refused_frac": 2 / 16}
    [line] = [r.getMessage() for r in caplog.records]
    assert line == (
        "the learner refused 2 of the last 16 rollout groups (12%) for 'reward' (" + RANGE + "): widen "
        "task.reward_range to hold every sample's reward (the reward functions' weighted sum), or rescale "
        "the rewards"
    )


def test_one_group_in_a_hundred_is_an_actors_glitch_and_says_nothing(caplog):
    watch = RefusalWatch(groups_per_step=100, patience_steps=5)
    with caplog.at_level(logging.WARNING, logger="tidal.notice"):
        for i in range(500):
            watch.observe("timing" if i % 100 == 0 else None)
    assert not caplog.records


def test_most_groups_refused_for_the_patience_stops_the_run_naming_the_reason():
    watch = RefusalWatch(groups_per_step=4, patience_steps=3)
    for _ in range(11):  # 11 of 12: the window is not full yet
        watch.observe("reward", RANGE)
    with pytest.raises(
        RolloutsRefused,
        match=r"refused 12 of the last 12 .* for 'reward' \(a reward of 10.2.*"
        r"stopping the run \(learner.refusal_patience_steps\)",
    ):
        watch.observe("reward", RANGE)


def test_half_refused_or_a_patience_of_zero_goes_on():
    half = RefusalWatch(groups_per_step=4, patience_steps=3)
    for i in range(40):
        half.observe("reward" if i % 2 else None)
    never = RefusalWatch(groups_per_step=4, patience_steps=0)
    for _ in range(40):
        never.observe("reward")


def test_one_actors_refusals_bar_that_actor_and_the_run_goes_on(caplog):
    """A key holder answering fast with rollouts the validator refuses once made most of what arrived
    refused, and stopped the run. Its refusals are its own: it is barred, the others train on."""
    barred = []
    watch = RefusalWatch(groups_per_step=4, patience_steps=3, bar=barred.append)
    with caplog.at_level(logging.WARNING, logger="tidal.notice"):
        for i in range(40):  # three of every four groups from the liar, all refused; the honest one's kept
            liar = i % 4 != 0
            watch.observe("reward" if liar else None, RANGE if liar else "", "liar" if liar else "honest")
    assert barred == ["liar"] and watch.barred == ["liar"]
    [line] = [r.getMessage() for r in caplog.records if "barred" in r.getMessage()]
    assert line.startswith("actor liar is barred: the learner refused 9 of its last 9 rollout groups ('reward': ")


@pytest.mark.parametrize("actors", [["a0", "a1", "a2"], ["a0"]])
def test_refusals_spread_over_every_actor_or_one_actor_alone_are_a_setting_and_stop_the_run(actors):
    """The same reason refusing most groups of every actor (a reward range too narrow), or of the only
    actor there is: nobody is barred; the run stops, as without the bar."""
    barred = []
    watch = RefusalWatch(groups_per_step=4, patience_steps=3, bar=barred.append)
    with pytest.raises(RolloutsRefused, match="stopping the run"):
        for i in range(40):
            watch.observe("reward" if i % 5 else None, RANGE, actors[i % len(actors)])
    assert barred == []
