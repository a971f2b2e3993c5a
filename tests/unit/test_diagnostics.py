"""The bounded samples a run's figures are drawn from, and the evaluation's completion table."""
from types import SimpleNamespace

import numpy as np

from conftest import rollout
from tidal.learner.diagnostics import Diagnostics, Reservoir


def test_reservoir_is_bounded_and_uniform():
    r = Reservoir(1000, seed=0)
    r.extend(np.arange(100_000))
    values = r.sample()
    assert values.size == 1000 and r.seen == 100_000
    assert 40_000 < values.mean() < 60_000  # a prefix would average 500


def test_the_completion_table_says_which_rewards_pass_the_threshold(tmp_path):
    tables = []
    tracker = SimpleNamespace(log_table=lambda columns, name: tables.append(columns))
    diagnostics = Diagnostics(tracker, lambda ids: "text", tmp_path, completions_per_eval=4, max_lag=1,
                              pass_threshold=0.5)
    diagnostics.expect_eval(2, ["a", "b"], n=1)
    for gid, reward in (("a", 0.1), ("b", 0.75)):
        group = rollout(reward=reward, group_id=gid)
        group.eval_version = 2
        diagnostics.on_eval_group(group, 2)
    diagnostics.eval_done(2)
    [columns] = tables
    assert columns["reward"] == [0.1, 0.75] and columns["passed"] == [False, True]
