"""The bounded samples a run's figures are drawn from."""
import numpy as np

from tidal.learner.diagnostics import Reservoir


def test_reservoir_is_bounded_and_uniform():
    r = Reservoir(1000, seed=0)
    r.extend(np.arange(100_000))
    values = r.sample()
    assert values.size == 1000 and r.seen == 100_000
    assert 40_000 < values.mean() < 60_000  # a prefix would average 500
