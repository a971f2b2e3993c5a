"""The bounded samples a run's figures are drawn from, and the evaluation's completion table."""

from types import SimpleNamespace

import numpy as np

from conftest import rollout
from tidal.learner.rank0.diagnostics import Diagnostics, Reservoir


def test_reservoir_is_bounded_and_uniform():
    r = Reservoir(1000, seed=0)
    r.extend(np.arange(100_000))
    values = r.sample()
    assert values.size == 1000 and r.seen == 100_000
    assert 40_000 < values.mean() < 60_000  # a prefix would average 500


def test_the_completion_table_says_which_rewards_pass_the_threshold(tmp_path):
    tables = []
    tracker = SimpleNamespace(log_table=lambda columns, name: tables.append(columns))
    diagnostics = Diagnostics(
        tracker, lambda ids: "text", tmp_path, completions_per_eval=4, max_lag=1, pass_threshold=0.5
    )
    diagnostics.expect_eval(2, ["a", "b"], n=1)
    for gid, reward in (("a", 0.1), ("b", 0.75)):
        group = rollout(reward=reward, group_id=gid)
        group.eval_version = 2
        diagnostics.on_eval_group(group, 2)
    diagnostics.eval_done(2)
    [columns] = tables
    assert columns["reward"] == [0.1, 0.75] and columns["passed"] == [False, True]


def test_a_fresh_ratio_that_strays_for_several_steps_is_named_once(caplog):
    """Lag-0 tokens off 1 for DRIFT_STEPS steps in a row: one warning naming the likely setting; a step without
    fresh tokens neither counts nor breaks the run of steps, one back within the tolerance does."""
    import logging

    from tidal.config import load_config
    from tidal.learner.rank0.drift import DRIFT_STEPS, FreshRatioWatch, likely_causes

    causes = likely_causes(load_config("tiny", ["model.dtype=bfloat16"]))
    assert "model.head=served" in causes[0]
    watch = FreshRatioWatch(causes)
    with caplog.at_level(logging.WARNING, logger="tidal.learner.rank0.drift"):
        for version, ratio in enumerate([0.9, 0.9, 1.0, 0.95, None, 0.95]):  # broken by 1.0; the None skips
            watch.observe({} if ratio is None else {"offpolicy/fresh_ratio": ratio}, version)
        assert not caplog.records
        for version in range(6, 6 + DRIFT_STEPS):
            watch.observe({"offpolicy/fresh_ratio": 0.93}, version)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "0.9300" in message and "model.dtype=bfloat16 with model.head=fp32" in message
    assert FreshRatioWatch(likely_causes(load_config("tiny"))).causes[0].startswith("the engines compute")
