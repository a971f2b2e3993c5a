"""Batch-size planner arithmetic and the sweep grid, without engines."""

import pytest

from tidal.ops.plan_batch import Probe, RunEvidence, at_batch, eval_every, plan, print_plan
from tidal.ops.sweep import split_grid


def _probe(batch: int, step_s: float, eval_s: float = 0.0) -> Probe:
    return Probe(batch, first_step_s=step_s, step_s=step_s, eval_s=eval_s, gen_samples_per_s=100.0, train_step_s=0.01)


def test_samples_to_target_follow_a_power_law_fitted_to_the_runs(capsys):
    # 8 samples a group; runs evaluated every 2 steps saw the target at step 11 (B=8) and 5 (B=32): crossed
    # about a step before, 10 x 64 = 640 and 4 x 256 = 1024 trained samples
    evidence = [RunEvidence(8, 8, 2, 11), RunEvidence(32, 8, 2, 5)]
    assert [e.samples_to_target for e in evidence] == [640, 1024]
    rows, note = plan(
        [_probe(8, 1.0), _probe(16, 0.6), _probe(32, 0.55)], evidence, samples_per_group=8, eval_groups=1, max_lag=2
    )  # an evaluation every step
    assert "B^0.34" in note and "probe" in note
    assert [r.samples_to_target for r in rows] == pytest.approx([640, (640 * 1024) ** 0.5, 1024])
    assert [r.steps_to_target for r in rows] == [10, 7, 4]  # S / (8B), rounded up to an evaluation
    assert [r.time_to_target_s for r in rows] == pytest.approx([10.0, 4.2, 2.2])  # first step + the rest
    best = print_plan(rows, note)
    out = capsys.readouterr().out
    assert best == 32 and "recommendation: B = 32" in out
    assert "B'=16 vs B=8: time per sample falls" in out and "the larger batch pays" in out


def test_steps_round_up_to_the_evaluation_that_sees_the_target_and_the_evaluations_before_it_count():
    evidence = [RunEvidence(16, 8, 10, 30)]  # crossed between steps 20 and 30: 25 steps of 128 samples
    assert evidence[0].samples_to_target == 25 * 16 * 8
    # an evaluation every 160 groups: every 10 steps at B=16, every 5 at B=32; each adds 2 s
    rows, note = plan(
        [_probe(16, 1.0, eval_s=2.0), _probe(32, 1.5, eval_s=2.0)],
        evidence,
        samples_per_group=8,
        eval_groups=160,
        max_lag=2,
    )
    assert note.startswith("ASSUMPTION")  # one batch size: S does not depend on B
    assert [r.steps_to_target for r in rows] == [30, 15]  # 25 -> 30; 12.5 -> 15
    # the first step, the rest, and the two evaluations (of the two before the one that sees the target)
    # whose stall came max_lag + 2 steps later, before it
    assert [r.time_to_target_s for r in rows] == pytest.approx([30.0 + 4.0, 22.5 + 4.0])


def test_an_evaluation_is_felt_max_lag_plus_two_steps_after_it():
    from tidal.ops.plan_batch import felt_evals

    assert felt_evals(5, 15, max_lag=2) == 2  # at 5 and 10, felt at 9 and 14; the one at 15 sees the target
    assert felt_evals(2, 8, max_lag=2) == 2  # at 2 and 4, felt at 6 and 8; the one at 6 only after step 8
    assert felt_evals(5, 14, max_lag=8) == 0  # both still covered by the rollouts admitted before them
    assert felt_evals(6, 24, max_lag=2, after=2) == 3  # a probe's: at 6, 12 and 18


def test_without_runs_that_reached_the_target_there_is_no_recommendation(capsys):
    rows, note = plan([_probe(8, 1.0)], [RunEvidence(8, 8, 10, None)], samples_per_group=8, eval_groups=80, max_lag=2)
    assert print_plan(rows, note) is None
    assert "no recommendation" in capsys.readouterr().out


def test_a_batch_is_run_with_sqrt_lr_the_same_warmup_samples_and_evaluation_cadence():
    from tidal.config import load_config

    learner = load_config(["tiny"], []).learner  # 16 groups, lr 2.5e-4, 20 warmup steps
    assert at_batch(learner, 64, eval_groups=400) == [
        "learner.groups_per_step=64",
        "learner.optim.lr=0.0005",
        "learner.optim.warmup_steps=5",
        "eval.every=6",
    ]
    assert eval_every(4, 400) == 100 and eval_every(1000, 400) == 1


def test_sweep_grid_splits_axes_from_fixed_overrides():
    fixed, axes = split_grid(["staleness.max_lag=0,2,8", "learner.max_steps=40", "learner.groups_per_step=4,8"])
    assert fixed == ["learner.max_steps=40"]
    assert axes == [("staleness.max_lag", ["0", "2", "8"]), ("learner.groups_per_step", ["4", "8"])]
    with pytest.raises(ValueError, match="at least one"):
        split_grid(["learner.max_steps=40"])


def test_each_grid_point_is_its_own_run_folder_and_config(tmp_path):
    from tidal.ops.sweep import grid_points

    points = grid_points(["tiny"], ["staleness.max_lag=0,2", "learner.max_steps=3"], tmp_path)
    assert [p.label for p in points] == ["staleness.max_lag=0", "staleness.max_lag=2"]
    assert [p.run_dir for p in points] == [tmp_path / "staleness.max_lag-0", tmp_path / "staleness.max_lag-2"]
    assert points[1].overrides == (
        "learner.max_steps=3",
        "staleness.max_lag=2",
        f"run_dir={tmp_path}/staleness.max_lag-2",
        "name=staleness.max_lag-2",
    )


def test_a_run_of_the_grid_that_fails_stops_the_sweep_naming_its_logs(tmp_path, monkeypatch):
    import tidal.ops.launcher
    from tidal.ops.sweep import SweepRunFailed, grid_points, run_grid

    launched = []
    monkeypatch.setattr(tidal.ops.launcher, "launch", lambda cfg: launched.append(cfg.staleness.max_lag) or 1)
    points = grid_points(["tiny"], ["staleness.max_lag=0,2"], tmp_path)
    with pytest.raises(SweepRunFailed, match=f"the run staleness.max_lag=0 failed; its logs: {tmp_path}/"):
        run_grid(["tiny"], points, tmp_path, "sqlite:///unused.db", "sweep", "parent")
    assert launched == [0]


def test_the_reach_table_names_the_run_predicted_to_reach_the_target_soonest():
    import numpy as np

    from tidal import scaling
    from tidal.ops.scaling_report import Window, reach_table

    seconds = np.linspace(0, 100, 21)
    curves = {
        "k=0": scaling.sigmoid_curve(seconds, A=0.8, B=2.0, C_mid=40.0, R0=0.3),
        "k=2": scaling.sigmoid_curve(seconds, A=0.8, B=2.0, C_mid=20.0, R0=0.3),
    }
    points = {name: (seconds, rates) for name, rates in curves.items()}
    text = reach_table(points, points, Window(), 0.55, "compute/wall_s")
    pick = text.splitlines()[-1]  # the line to act on, last
    assert pick.startswith("pick: k=2, predicted to reach 0.55 soonest (20.0 [")  # the midpoint: half-way from R0 to A
    assert "s of wall time to an eval pass rate of 0.55" in pick
    assert "clearly ahead of the runner-up, k=0 (40.0 [" in pick
    assert "warning: one seed per value" in text and "use --seeds 3" in text
    assert "measured wall s" in text.splitlines()[0] and " 20.0" in text.splitlines()[2]
    assert "no run is predicted to reach 0.9" in reach_table(points, points, Window(), 0.9, "compute/wall_s")


def test_a_sweeps_seeds_are_fitted_as_one_curve_and_measured_by_their_median():
    import numpy as np

    from tidal import scaling
    from tidal.ops.scaling_report import Window, pooled, reach_table

    seconds = np.linspace(0, 100, 21)
    runs = {
        f"k=2,seed={s}": (seconds, scaling.sigmoid_curve(seconds, A=0.8, B=2.0, C_mid=c, R0=0.3))
        for s, c in enumerate((15.0, 25.0, 40.0))
    }
    assert list(pooled(runs)) == ["k=2"] and pooled(runs)["k=2"][0].size == 63
    text = reach_table(runs, runs, Window(), 0.55, "compute/wall_s")
    assert text.splitlines()[1].split()[0] == "k=2" and text.splitlines()[1].endswith(" 25.0")  # 15, 25, 40
    assert "one seed" not in text and text.splitlines()[-1].endswith("; the only run fitted")


def test_overlapping_intervals_make_the_verdict_inconclusive_and_say_what_to_do():
    from tidal.ops.scaling_report import verdict

    reach = {"k=0": (40.0, 30.0, 55.0), "k=2": (35.0, 28.0, 45.0), "k=8": (60.0, 50.0, 70.0)}
    lines = verdict(reach, 0.6, num_seeds=1)
    assert lines[0].startswith("warning: one seed per value") and "use --seeds 3" in lines[0]
    assert lines[1].startswith("inconclusive: the intervals overlap (k=2 35.0 [28.0,45.0] s, k=0 40.0 [30.0,55.0] s)")
    assert lines[1].endswith("add seeds (--seeds 3) or steps (learner.max_steps) and sweep again")
    assert lines[-1].startswith("pick: k=2, predicted to reach 0.6 soonest (35.0 [28.0,45.0] s of wall time")
    assert lines[-1].endswith("tentative: the runner-up, k=0, may be as fast")
    seeded = verdict(reach, 0.6, num_seeds=2)  # seeds already: no warning, and more of them
    assert len(seeded) == 2 and "add seeds (--seeds 4)" in seeded[0]
    assert verdict({**reach, "k=0": (40.0, 46.0, 55.0)}, 0.6, num_seeds=3) == [
        "pick: k=2, predicted to reach 0.6 soonest (35.0 [28.0,45.0] s of wall time to an eval pass rate of 0.6, its "
        "90% interval in brackets); clearly ahead of the runner-up, k=0 (40.0 [46.0,55.0] s)"
    ]
    never = {"k=0": (float("inf"),) * 3}
    assert verdict(never, 0.9, 1) == ["no run is predicted to reach 0.9: fit on longer runs or lower the target"]


def test_the_wall_time_figure_draws_the_target_and_says_seeds_pooled_only_for_seeds(tmp_path, monkeypatch):
    import numpy as np

    from tidal import scaling
    from tidal.ops.scaling_report import Window, reach_table

    drawn = []
    monkeypatch.setattr(scaling, "plot_fits", lambda *args, **kwargs: drawn.append(kwargs))
    seconds = np.linspace(0, 100, 21)
    curve = (seconds, scaling.sigmoid_curve(seconds, A=0.8, B=2.0, C_mid=20.0, R0=0.3))
    reach_table({"k=2": curve}, {"k=2": curve}, Window(), 0.55, "compute/wall_s", tmp_path / "w.png")
    seeded = {f"k=2,seed={s}": curve for s in range(2)}
    reach_table(seeded, seeded, Window(), 0.55, "compute/wall_s", tmp_path / "w.png")
    assert [d["target"] for d in drawn] == [0.55, 0.55]
    assert drawn[0]["title"] == "pass rate vs wall time"
    assert drawn[1]["title"] == "pass rate vs wall time, 2 seeds pooled"


def test_a_lag_by_lr_grid_finds_each_lags_largest_stable_lr_and_reads_the_law(tmp_path):
    import numpy as np

    from tidal.ops.sweep import LAG, LR, largest_stable_lr, stability, stability_report, stability_verdict

    points, axes = {}, {}
    for lag in (0, 2, 8):
        for lr in (1e-3, 3e-3, 1e-2):
            label = f"{LAG}={lag},{LR}={lr}"
            apart = lr * (lag + 1) > 0.02  # the 1/(k + 1) law, by construction
            points[label] = (np.arange(5.0), np.array([0.3, 0.6, 0.8, 0.5 if apart else 0.85, 0.4 if apart else 0.86]))
            axes[label] = {LAG: str(lag), LR: str(lr)}
    rows = stability(points, axes)
    assert [r.stable for r in rows if r.lag == 2] == [True, True, False]
    assert largest_stable_lr(rows) == {0: 1e-2, 2: 3e-3, 8: 1e-3}
    text = stability_report(points, axes, tmp_path / "stability.png")
    assert "falls like 1/(max_lag + 1)" in text and (tmp_path / "stability.png").is_file()
    assert "does not fall" in stability_verdict({0: 3e-3, 2: 3e-3, 8: 3e-3}, [1e-3, 3e-3, 1e-2])
    assert "try larger ones" in stability_verdict({0: 1e-2, 2: 1e-2}, [1e-3, 1e-2])
    assert "not like 1/(max_lag + 1)" in stability_verdict({0: 8e-3, 8: 4e-3}, [1e-3, 2e-3, 4e-3, 8e-3])
    # no stable lr at max_lag 8 where the law puts it below the grid (1e-3 / 9): consistent, and said
    text = stability_verdict({0: 1e-3, 2: 5e-4, 8: None}, [2.5e-4, 5e-4, 1e-3, 2e-3])
    assert text.startswith("the largest stable lr falls like 1/(max_lag + 1)") and "max_lag 8: no stable lr" in text
    assert "not like" in stability_verdict({0: 8e-4, 2: None}, [5e-5, 1e-4, 2e-4, 4e-4, 8e-4])  # law: 2.7e-4


def test_a_sweep_with_seeds_runs_each_point_once_per_seed(tmp_path):
    from tidal.ops.sweep import grid_points

    points = grid_points(["tiny"], ["staleness.max_lag=0,2", "learner.max_steps=3"], tmp_path, seeds=2)
    assert [p.label for p in points] == [
        "staleness.max_lag=0,seed=0",
        "staleness.max_lag=0,seed=1",
        "staleness.max_lag=2,seed=0",
        "staleness.max_lag=2,seed=1",
    ]
    assert {"learner.seed=1", "actor.seed=1"} <= set(points[3].overrides)
    assert points[3].run_dir == tmp_path / "staleness.max_lag-2_seed-1"
