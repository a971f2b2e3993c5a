"""The figures read well: log axes whose labels never overlap, a token-lag histogram in plain counts
with every bar labelled, fits solid over the compute they saw and dashed beyond, titles that name the
run and the steps drawn. Drawn with Agg and inspected as matplotlib objects, not as pixels."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import matplotlib
import numpy as np
import pytest

from conftest import ROOT
from tidal import scaling
from tidal.learner.every_rank.trainer import TokenSample
from tidal.learner.rank0 import diagnostics as diagnostics_module
from tidal.learner.rank0.diagnostics import Diagnostics
from tidal.ops.plan_batch import PlanRow, plot_plan
from tidal.ops.scaling_report import _labels

matplotlib.use("Agg")
RUN = "arith-lr3e-6-20261205-120000"  # a run folder's name, as runs/<name>-<time> makes it


@pytest.fixture
def drawn(monkeypatch):
    """The figures a call draws, by file stem, kept open (and closed afterwards) instead of saved."""
    import matplotlib.pyplot as plt

    figures, close = {}, plt.close

    def keep(fig, path: Path) -> Path:
        fig.tight_layout()
        figures[Path(path).stem] = fig
        return Path(path)

    monkeypatch.setattr(diagnostics_module, "_save", keep)
    monkeypatch.setattr(plt, "close", lambda fig: None)  # plot_fits and plot_plan close what they saved
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **kw: figures.__setitem__(Path(path).stem, fig))
    yield figures
    for fig in figures.values():
        close(fig)


def diagnostics(tmp_path, steps=(), compute=(), rate=()) -> Diagnostics:
    """A run's Diagnostics whose MLflow holds the eval curve (steps, compute, rate)."""
    tracker = SimpleNamespace(
        eval_curve=lambda metric: (list(steps), list(compute), list(rate)), log_artifacts=lambda folder, name: None
    )
    return Diagnostics(tracker, str, tmp_path / RUN, completions_per_eval=0, max_lag=2)


def eval_curve(first: float, decades: float, num: int = 12):
    """A step-0 eval and `num` more whose compute spans `decades` from `first`: steps, compute, pass rate."""
    compute = np.concatenate([[0.0], np.geomspace(first, first * 10**decades, num)])
    rate = scaling.sigmoid_curve(compute, 0.7, 1.5, first * 10 ** (decades / 2), 0.1)
    return list(range(0, 10 * (num + 1), 10)), compute, rate


def shown_labels(ax) -> list:
    """The x tick labels drawn, minor ones too: those of ticks outside the view have a text but are not drawn."""
    ax.figure.canvas.draw()
    inside = ax.get_window_extent()

    def centre(label) -> float:
        box = label.get_window_extent()
        return (box.x0 + box.x1) / 2

    labels = [t for t in ax.get_xticklabels(which="both") if t.get_visible() and t.get_text()]
    return [t for t in labels if inside.x0 - 1 <= centre(t) <= inside.x1 + 1]


def assert_readable(ax) -> None:
    labels = shown_labels(ax)
    boxes = [t.get_window_extent() for t in labels]
    crowded = [
        (a.get_text(), b.get_text())
        for i, (a, box_a) in enumerate(zip(labels, boxes))
        for b, box_b in zip(labels[i + 1 :], boxes[i + 1 :])
        if box_a.overlaps(box_b)
    ]
    assert crowded == [], f"overlapping tick labels {crowded} of {[t.get_text() for t in labels]}"
    assert len(labels) >= 2, [t.get_text() for t in labels]  # a log axis names at least two values


def lines(ax, style: str) -> list:
    return [line for line in ax.get_lines() if line.get_linestyle() == style and len(line.get_xdata())]


# ---- log axes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("decades", [0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 8.0])
def test_the_pass_rate_compute_axis_labels_never_overlap(tmp_path, drawn, decades):
    # the axis runs 4x past the last eval (the extrapolated curve): over 0.5 and 0.7 decades of evals,
    # a short run's first checkpoints, matplotlib's own labels ("3x10^15 4x10^15") ran together
    diagnostics(tmp_path, *eval_curve(3e15, decades)).draw(120)
    by_compute = drawn["pass_rate"].axes[1]
    assert by_compute.get_xscale() == "log"
    assert_readable(by_compute)


@pytest.mark.parametrize("first, decades", [(1.0, 1.0), (1.0, 8.0), (3e15, 1.3), (1e12, 8.0)])
def test_tidal_fit_compute_axis_labels_never_overlap(tmp_path, drawn, first, decades):
    _, compute, rate = eval_curve(first, decades)
    scaling.plot_fits({"a": (compute, rate)}, {}, tmp_path / "fit.png")
    [ax] = drawn["fit"].axes
    assert_readable(ax)
    assert all("^" not in t.get_text() and "+" not in t.get_text() for t in shown_labels(ax))  # 1e12, not 10^12


def test_plan_batch_names_the_batch_sizes_on_its_log_axis(tmp_path, drawn):
    sizes = [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    rows = [PlanRow(b, 10.0 * b, 1e-3 * b, 0.1, 1.0, 80.0 * b, 1e3, 10, 100.0 / b) for b in sizes]
    plot_plan(rows, tmp_path / "plan.png")
    for ax in drawn["plan"].axes:
        assert_readable(ax)
        texts = [t.get_text() for t in shown_labels(ax)]
        assert set(texts) <= {str(b) for b in sizes} and len(texts) <= 6, texts  # batch sizes, not 10^2


# ---- the token-lag histogram ------------------------------------------------------------------


def test_token_lag_counts_are_linear_and_every_bar_says_its_count(tmp_path, drawn):
    d = diagnostics(tmp_path)
    d.on_step([], TokenSample(np.array([150_000, 1, 30]), np.zeros(0), np.zeros(0)))
    d.draw(5)
    ax = drawn["token_lag"].axes[0]
    assert ax.get_yscale() == "linear"
    assert [t.get_text() for t in ax.texts] == ["150k", "1", "30"]  # the bar of 1 token is still seen


def test_token_lag_ticks_are_whole_lags(tmp_path, drawn):
    d = diagnostics(tmp_path)
    d.on_step([], TokenSample(np.array([900, 40]), np.zeros(0), np.zeros(0)))  # two bars: matplotlib ticked 0.5s
    d.draw(5)
    ax = drawn["token_lag"].axes[0]
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


# ---- extrapolation ----------------------------------------------------------------------------


def test_a_tidal_fit_curve_is_solid_where_it_was_fitted_and_dashed_beyond(tmp_path, drawn):
    _, compute, rate = eval_curve(1e12, 4.0)
    fit = scaling.SigmoidFit(A=0.7, B=1.5, C_mid=1e14, R0=0.1, sse=0.0, n_points=8, compute_max=1e15)
    scaling.plot_fits({"arith-lr3e-6": (compute, rate)}, {"arith-lr3e-6": fit}, tmp_path / "fit.png")
    [ax] = drawn["fit"].axes
    [solid] = [line for line in lines(ax, "-") if line.get_label().startswith("arith-lr3e-6 fit")]
    dashed = lines(ax, "--")
    assert max(solid.get_xdata()) == pytest.approx(1e15)
    assert min(line.get_xdata().min() for line in dashed) == pytest.approx(1e15)
    assert max(line.get_xdata().max() for line in dashed) > 1e16
    assert any("extrapolated" in t.get_text() for t in ax.get_legend().get_texts())


def test_the_run_s_sigmoid_is_dashed_past_the_compute_measured(tmp_path, drawn):
    steps, compute, rate = eval_curve(3e15, 2.0)
    diagnostics(tmp_path, steps, compute, rate).draw(120)
    by_compute = drawn["pass_rate"].axes[1]
    solid = [line for line in lines(by_compute, "-") if line.get_label().startswith("sigmoid")]
    dashed = lines(by_compute, "--")
    assert len(solid) == 1 and max(solid[0].get_xdata()) == pytest.approx(compute.max())
    assert min(line.get_xdata().min() for line in dashed) == pytest.approx(compute.max())
    assert any("extrapolated" in t.get_text() for t in by_compute.get_legend().get_texts())


# ---- titles and legends -----------------------------------------------------------------------


def test_titles_name_the_run_and_the_steps_each_figure_covers(tmp_path, drawn):
    d = diagnostics(tmp_path, *eval_curve(3e15, 2.0))
    d.on_step([], TokenSample(np.array([50, 5]), np.array([-1.0, -2.0]), np.array([-1.1, -2.0])))
    d.rewards.extend([0.0, 1.0])
    d.lengths.extend([10, 20])
    d.draw(120, first_step=61)  # a learner resumed from the checkpoint at step 60
    assert set(drawn) == {"pass_rate", "token_lag", "logprob_mismatch", "rewards_lengths"}
    assert drawn["pass_rate"].get_suptitle() == f"{RUN}: steps 0-120"  # the evaluations, from MLflow
    for name in ("token_lag", "logprob_mismatch", "rewards_lengths"):  # what this process trained on
        assert drawn[name].get_suptitle() == f"{RUN}: steps 61-120"


def test_tidal_fit_labels_runs_by_name_unless_the_caller_named_them():
    ids = {"9f1c2e7d4b": "9f1c2e7d4b", "03ab77c1de": "03ab77c1de"}  # `tidal fit --runs ID ID`
    assert _labels(ids, {"arith-lr3e-6": 0, "arith-lr1e-6": 0}) == ["arith-lr3e-6", "arith-lr1e-6"]
    swept = {"staleness.max_lag=0": "9f1c2e7d4b", "staleness.max_lag=4": "03ab77c1de"}
    assert _labels(swept, {"tidal": 0, "tidal (03ab77c1)": 0}) == list(swept)  # a sweep's own labels stay
    clash = {"tidal": "9f1c2e7d4b", "03ab77c1de": "03ab77c1de"}  # a run named like the other's label
    assert _labels(clash, {"a": 0, "tidal": 0}) == ["tidal (9f1c2e7d)", "tidal (03ab77c1)"]


def test_the_async_bench_title_gives_the_steps_and_its_legend_the_seeds(tmp_path, drawn):
    sys.path.insert(0, str(ROOT / "bench"))  # bench/async.py imports its neighbour runs.py
    spec = importlib.util.spec_from_file_location("bench_async", ROOT / "bench" / "async.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    history = {"eval/pass_rate": {0: 0.2, 10: 0.5, 20: 0.7}, "compute/wall_s": {0: 5.0, 10: 9.0, 20: 13.0}}
    runs = [
        {"task": "tiny", "system": "tidal", "max_lag": lag, "filter": lag == 0, "seed": seed, "history": history}
        for lag in (0, 4)
        for seed in (0, 1)
    ]
    bench.plot(runs, 0.6, tmp_path / "async-tiny.png")
    [ax] = drawn["async-tiny"].axes
    assert "steps 0-20" in ax.get_title() and ax.get_title().startswith("tiny")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "max_lag 0 (2 seeds)",
        "max_lag 4, no zero-variance filter (2 seeds)",
        "target 0.60",
    ]


def test_every_figure_is_saved_at_its_own_dpi_through_one_helper(tmp_path):
    """scaling.figure/save_figure: a PNG of figsize x dpi pixels at the path given, the figure freed."""
    import matplotlib.pyplot as plt

    fig, ax = scaling.figure(figsize=(2, 1))
    ax.plot([0, 1], [0, 1])
    path = scaling.save_figure(fig, tmp_path / "small.png", dpi=50)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # the IHDR chunk
    assert (width, height) == (100, 50)
    assert not plt.fignum_exists(fig.number)
    fig, axes = scaling.figure(3, figsize=(6, 2), squeeze=False)
    assert axes.shape == (1, 3) and matplotlib.get_backend().lower() == "agg"
    plt.close(fig)


# ---- early in a run, and rewards with a bonus -----------------------------------------------------


@pytest.mark.parametrize(
    "compute", [(1.2e15, 2.4e15, 3.6e15), (4e15, 8e15, 1.2e16), (2e15, 2.1e15, 2.2e15), (9.9e14, 1.42e15)]
)
def test_a_pass_rate_panel_before_any_fit_says_why_in_full_and_labels_span_its_points(tmp_path, drawn, compute):
    steps = list(range(len(compute) + 1))
    diagnostics(tmp_path, steps, (0.0, *compute), np.linspace(0.1, 0.4, len(steps))).draw(len(compute))
    fig = drawn["pass_rate"]
    by_compute = fig.axes[1]
    title = by_compute.title.get_text()
    assert title.startswith("no sigmoid fit yet") and title.endswith("the sigmoid needs at least 4")  # not cut
    assert max(len(line) for line in title.splitlines()) <= 60  # wrapped to the panel
    fig.canvas.draw()
    inside = fig.bbox
    box = by_compute.title.get_window_extent()
    assert inside.x0 <= box.x0 and box.x1 <= inside.x1, (box, inside)
    lo, hi = by_compute.get_xlim()
    assert lo < min(compute) and max(compute) < hi
    assert_readable(by_compute)
    ticks = [t.get_position()[0] for t in shown_labels(by_compute)]
    assert min(ticks) <= min(compute) and max(ticks) >= max(compute), ticks  # a label at or past each end


def test_distinct_rewards_get_a_bar_each_so_a_bonus_stays_visible(tmp_path, drawn):
    d = diagnostics(tmp_path)
    d.rewards.extend([0.0] * 5 + [0.2] * 3 + [1.0] * 2 + [1.2] * 6)  # pass/fail plus a 0.2 format bonus
    d.lengths.extend([10] * 16)
    d.draw(5)
    ax = drawn["rewards_lengths"].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "0.2", "1", "1.2"]
    assert [p.get_height() for p in ax.patches] == [5, 3, 2, 6]
    many = diagnostics(tmp_path)
    many.rewards.extend(np.linspace(0, 1, 200))  # a continuous reward: binned
    many.lengths.extend([10] * 200)
    many.draw(6)
    assert len(drawn["rewards_lengths"].axes[0].patches) == 30


def test_the_fit_figure_draws_a_target_as_a_line(tmp_path, drawn):
    _, compute, rate = eval_curve(1.0, 2.0)
    scaling.plot_fits({"a": (compute, rate)}, {}, tmp_path / "wall.png", target=0.55)
    [ax] = drawn["wall"].axes
    [line] = [line for line in ax.get_lines() if line.get_label() == "target pass rate 0.55"]
    assert set(line.get_ydata()) == {0.55}
