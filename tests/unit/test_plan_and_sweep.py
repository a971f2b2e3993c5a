"""Batch-size planner arithmetic and the sweep grid, without engines."""
import pytest

from tidal.plan_batch import RunEvidence, Throughput, plan, print_plan
from tidal.sweep import split_grid


def test_samples_to_target_follow_a_power_law_fitted_to_the_runs(capsys):
    throughput = [Throughput(8, 100.0, 500.0), Throughput(16, 180.0, 900.0), Throughput(32, 200.0, 1000.0)]
    # S(B) = 1000 x B^0.5: 2828 at B=8 and 4000 at B=16 measured; 5657 at B=32 extrapolated
    evidence = [RunEvidence(8, 1000 * 8 ** 0.5, 0.0), RunEvidence(16, 4000.0, 0.0)]
    rows, note = plan(throughput, evidence, overlap=True)
    assert [r.samples_to_target for r in rows] == pytest.approx([1000 * 8 ** 0.5, 4000.0, 1000 * 32 ** 0.5])
    assert [r.time_to_target_s for r in rows] == pytest.approx([28.28, 4000 / 180, 5657 / 200], rel=1e-3)
    assert "B^0.50" in note
    best = print_plan(rows, note)
    out = capsys.readouterr().out
    assert best == 16
    # 16 vs 8: time per sample falls 1.8x > samples grow 1.41x -> pays; 32 vs 16: 1.11x <= 1.41x -> does not
    assert "B'=16 vs B=8: time per sample falls 1.80x > S(B')/S(B) = 1.41 -> the larger batch pays" in out
    assert "B'=32 vs B=16: time per sample falls 1.11x <= S(B')/S(B) = 1.41 -> the larger batch does not pay" in out


def test_learner_time_adds_without_overlap_and_bounds_with_it():
    throughput = [Throughput(8, 100.0, 1.0), Throughput(32, 400.0, 1.0)]
    # the learner needs 5 ms a sample at either batch; generation 10 ms at B=8, 2.5 ms at B=32
    evidence = [RunEvidence(8, 1000.0, 0.005), RunEvidence(32, 1000.0, 0.005)]
    sync, _ = plan(throughput, evidence, overlap=False)
    overlapped, note = plan(throughput, evidence, overlap=True)
    assert [r.time_to_target_s for r in sync] == pytest.approx([15.0, 7.5])
    assert [r.time_to_target_s for r in overlapped] == pytest.approx([10.0, 5.0])  # the learner bounds B=32
    assert "overlap" in note


def test_one_batch_size_falls_back_to_the_sqrt_lr_assumption_and_says_so():
    evidence = [RunEvidence(8, 9_000.0, 0.001), RunEvidence(16, None, 0.001)]  # B=16 never reached the target
    rows, note = plan([Throughput(8, 100.0, 1.0), Throughput(16, 150.0, 1.0)], evidence, overlap=True)
    assert note.startswith("ASSUMPTION")
    assert [r.samples_to_target for r in rows] == [9_000.0, 9_000.0]
    rows, note = plan([Throughput(8, 100.0, 1.0)], [], overlap=True)
    assert "units of S" in note and "learner time not counted" in note


def test_sweep_grid_splits_axes_from_fixed_overrides():
    fixed, axes = split_grid(["staleness.max_lag=0,2,8", "learner.max_steps=40", "learner.groups_per_step=4,8"])
    assert fixed == ["learner.max_steps=40"]
    assert axes == [("staleness.max_lag", ["0", "2", "8"]), ("learner.groups_per_step", ["4", "8"])]
    with pytest.raises(ValueError, match="at least one"):
        split_grid(["learner.max_steps=40"])


def test_each_grid_point_is_its_own_run_folder_and_config(tmp_path):
    from tidal.sweep import grid_points

    points = grid_points(["tiny"], ["staleness.max_lag=0,2", "learner.max_steps=3"], tmp_path)
    assert [p.label for p in points] == ["staleness.max_lag=0", "staleness.max_lag=2"]
    assert [p.run_dir for p in points] == [tmp_path / "staleness.max_lag-0", tmp_path / "staleness.max_lag-2"]
    assert points[1].overrides == ("learner.max_steps=3", "staleness.max_lag=2",
                                   f"run_dir={tmp_path}/staleness.max_lag-2", "name=staleness.max_lag-2")


def test_a_run_of_the_grid_that_fails_stops_the_sweep_naming_its_logs(tmp_path, monkeypatch):
    import tidal.launcher
    from tidal.sweep import SweepRunFailed, grid_points, run_grid

    launched = []
    monkeypatch.setattr(tidal.launcher, "launch", lambda cfg: launched.append(cfg.staleness.max_lag) or 1)
    points = grid_points(["tiny"], ["staleness.max_lag=0,2"], tmp_path)
    with pytest.raises(SweepRunFailed, match=f"the run staleness.max_lag=0 failed; its logs: {tmp_path}/"):
        run_grid(["tiny"], points, tmp_path, "sqlite:///unused.db", "sweep", "parent")
    assert launched == [0]
