"""The bench scripts' arithmetic on made-up histories: time to a target, ratios to max_lag 0."""

import importlib.util
import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from runs import time_to_target  # noqa: E402
from tidal.scaling import by_step  # noqa: E402


def _bench_async():
    spec = importlib.util.spec_from_file_location("bench_async", ROOT / "bench" / "async.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _history(rates: list[float], seconds_per_eval: float) -> dict:
    steps = range(0, 10 * len(rates), 10)
    return {
        "eval/pass_rate": dict(zip(steps, rates)),
        "compute/wall_s": {s: 5.0 + seconds_per_eval * s / 10 for s in steps},  # 5 s of start-up
        "compute/samples": {s: 128.0 * s for s in steps},
    }


def test_time_to_target_counts_from_the_step_0_evaluation():
    out = time_to_target(_history([0.3, 0.5, 0.72, 0.7], seconds_per_eval=4.0), target=0.7)
    assert (out["time_to_target_s"], out["samples_to_target"], out["step_at_target"]) == (8.0, 2560.0, 20)
    assert (out["final_pass_rate"], out["steps"], out["wall_s"]) == (0.7, 30, 12.0)
    assert time_to_target(_history([0.3, 0.5], 4.0), target=0.9)["time_to_target_s"] is None


def test_summary_ratios_to_max_lag_0_and_to_trl_with_intervals():
    bench = _bench_async()
    runs = []
    # without the filter, max_lag 4 takes half the time per evaluation of max_lag 0; TRL three times as long;
    # with it, max_lag 4 takes as long per evaluation as max_lag 0 without (it samples twice as much)
    for lag, keep_filter, seconds in ((0, False, 4.0), (4, False, 2.0), (4, True, 4.0), (None, False, 6.0)):
        for seed in range(3):
            run = {
                "task": "long",
                "system": "tidal" if lag is not None else "trl",
                "max_lag": lag,
                "filter": keep_filter,
                "seed": seed,
                "history": _history([0.3, 0.6, 0.8 + 0.01 * seed], seconds + 0.1 * seed),
            }
            run |= time_to_target(run["history"], 0.75)
            run |= {
                "time_per_step_s": run["wall_s"] / run["steps"],
                "whole_s": 30.0 + run["wall_s"],
                "samples_generated": 3840.0 * (2 if keep_filter else 1),
                "samples_trained": 3840.0,
            }
            runs.append(run | {"time_to_0.5_s": time_to_target(run["history"], 0.5)["time_to_target_s"]})
    lines = {line["variant"]: line for line in bench.summarize(runs, 0.75, [0.5], np.random.default_rng(0))}
    assert list(lines) == ["trl", "k0-nofilter", "k4", "k4-nofilter"]
    fast = lines["k4-nofilter"]
    assert fast["speedup_vs_trl"] == pytest.approx(12.2 / 4.2, abs=1e-3)
    assert lines["trl"]["system"] == "trl" and lines["trl"]["speedup_vs_k0"] == pytest.approx(8.2 / 12.2, abs=1e-3)
    assert "speedup_vs_trl" not in lines["trl"] and "time_per_step_s_over_trl" not in lines["trl"]
    assert lines["k0-nofilter"]["speedup_vs_k0"] == 1.0
    assert fast["speedup_vs_k0"] == pytest.approx(8.2 / 4.2, abs=1e-3)
    low, high = fast["speedup_vs_k0_90ci"]
    assert low <= fast["speedup_vs_k0"] <= high
    assert fast["final_minus_k0"] == 0.0 and fast["reached"] == 3
    # the filter's variant is compared with max_lag 0 of the same recipe: there is none here
    assert "speedup_vs_k0" not in lines["k4"] and "final_minus_k0" not in lines["k4"]
    assert lines["k4"]["median_samples_generated"] == 2 * lines["k4"]["median_samples_trained"] == 7680
    # like for like against TRL: time per step (20 steps) and the whole command
    assert fast["time_per_step_s_over_trl"] == pytest.approx((4.2 / 20) / (12.2 / 20), abs=1e-3)
    assert fast["whole_s_over_trl"] == pytest.approx(34.2 / 42.2, abs=1e-3)
    # the fixed rate 0.5 is first reached at the second evaluation
    assert fast["median_time_to_0.5_s"] == pytest.approx(2.1)
    assert fast["speedup_vs_k0_at_0.5"] == pytest.approx(4.1 / 2.1, abs=1e-3)
    assert fast["speedup_vs_trl_at_0.5"] == pytest.approx(6.1 / 2.1, abs=1e-3)


def test_variant_names_read_back_and_a_wrong_one_is_named():
    bench = _bench_async()
    for run in ({"system": "tidal", "max_lag": 2, "filter": True}, {"system": "tidal", "max_lag": 0, "filter": False}):
        assert bench.parse_variant(bench.variant(run)) == (run["max_lag"], run["filter"])
    with pytest.raises(SystemExit, match="'k2-filter' is not k<max_lag> or k<max_lag>-nofilter"):
        bench.parse_variant("k2-filter")


def test_a_compute_axis_keeps_the_step_end_not_the_evaluation_that_completed_later():
    logged = [
        SimpleNamespace(step=10, value=40.0),
        SimpleNamespace(step=10, value=43.0),
        SimpleNamespace(step=20, value=45.0),
    ]  # step 10's end, then its evaluation's completion
    assert by_step("compute/wall_s", logged) == {10: 40.0, 20: 45.0}
    assert by_step("eval/pass_rate", [SimpleNamespace(step=10, value=0.5), SimpleNamespace(step=10, value=0.6)]) == {
        10: 0.6
    }


def test_a_bench_started_again_reads_the_runs_it_kept_instead_of_running_them(tmp_path, monkeypatch):
    bench = _bench_async()
    kept = {
        "history": {
            "eval/pass_rate": {"0": 0.3, "10": 0.8},
            "compute/wall_s": {"0": 1.0, "10": 3.0},
            "compute/samples": {"0": 0, "10": 1280},
        },
        "whole_s": 20.0,
    }
    for name in ("tiny-k2-nofilter-s0", "tiny-trl-s0"):
        (tmp_path / f"{name}.json").write_text(json.dumps(kept))
    monkeypatch.setattr(bench, "timed_tidal_run", lambda *a: pytest.fail("a kept tidal run ran again"))
    monkeypatch.setattr(bench, "trl_run", lambda *a: pytest.fail("a kept TRL run ran again"))
    runs = bench.run_grid("tiny", [(2, False)], seeds=1, every=10, extra=[], folder=tmp_path, trl=True)
    assert [(r["system"], r["max_lag"], r["filter"]) for r in runs] == [("tidal", 2, False), ("trl", None, False)]
    assert runs[0]["history"]["eval/pass_rate"] == {0: 0.3, 10: 0.8}  # steps read back as numbers
