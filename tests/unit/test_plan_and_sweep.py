"""Batch-size planner arithmetic and the sweep grid, without engines."""
import pytest

from tidal.plan_batch import Throughput, plan, print_plan
from tidal.sweep import split_grid


def test_time_to_target_uses_measured_samples_and_the_decision_rule(capsys):
    throughput = [Throughput(8, 100.0, 500.0), Throughput(16, 180.0, 900.0), Throughput(32, 200.0, 1000.0)]
    # S(B): 10k samples at B=8, 12k at B=16, 20k at B=32
    rows, note = plan(throughput, {8: 10_000.0, 16: 12_000.0, 32: 20_000.0})
    times = {b: t for b, _, _, _, t in rows}
    assert times == pytest.approx({8: 100.0, 16: 12_000 / 180, 32: 100.0})
    assert "interpolated" in note
    best = print_plan(rows, note)
    out = capsys.readouterr().out
    assert best == 16
    # 16 vs 8: throughput ratio 1.8 > samples ratio 1.2 -> pays; 32 vs 16: 1.11 < 1.67 -> does not
    assert "B'=16 vs B=8: Theta(B')/Theta(B) = 1.80 > S(B')/S(B) = 1.20 -> the larger batch pays" in out
    assert "B'=32 vs B=16: Theta(B')/Theta(B) = 1.11 <= S(B')/S(B) = 1.67 -> the larger batch does not pay" in out


def test_one_batch_size_falls_back_to_the_sqrt_lr_assumption_and_says_so():
    rows, note = plan([Throughput(8, 100.0, 1.0), Throughput(16, 150.0, 1.0)], {8: 9_000.0})
    assert note.startswith("ASSUMPTION")
    assert [r[3] for r in rows] == [9_000.0, 9_000.0]


def test_sweep_grid_splits_axes_from_fixed_overrides():
    fixed, axes = split_grid(["staleness.max_lag=0,2,8", "learner.max_steps=40", "learner.groups_per_step=4,8"])
    assert fixed == ["learner.max_steps=40"]
    assert axes == [("staleness.max_lag", ["0", "2", "8"]), ("learner.groups_per_step", ["4", "8"])]
    with pytest.raises(ValueError, match="at least one"):
        split_grid(["learner.max_steps=40"])
