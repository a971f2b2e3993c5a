"""The bench scripts' arithmetic on made-up histories: time to a target, ratios to max_lag 0."""
import importlib.util
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from runs import by_step, time_to_target  # noqa: E402


def _bench_async():
    spec = importlib.util.spec_from_file_location("bench_async", ROOT / "bench" / "async.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _history(rates: list[float], seconds_per_eval: float) -> dict:
    steps = range(0, 10 * len(rates), 10)
    return {"eval/pass_rate": dict(zip(steps, rates)),
            "compute/wall_s": {s: 5.0 + seconds_per_eval * s / 10 for s in steps},  # 5 s of start-up
            "compute/samples": {s: 128.0 * s for s in steps}}


def test_time_to_target_counts_from_the_step_0_evaluation():
    out = time_to_target(_history([0.3, 0.5, 0.72, 0.7], seconds_per_eval=4.0), target=0.7)
    assert (out["time_to_target_s"], out["samples_to_target"], out["step_at_target"]) == (8.0, 2560.0, 20)
    assert (out["final_pass_rate"], out["steps"], out["wall_s"]) == (0.7, 30, 12.0)
    assert time_to_target(_history([0.3, 0.5], 4.0), target=0.9)["time_to_target_s"] is None


def test_summary_ratios_to_max_lag_0_and_to_trl_with_intervals():
    bench = _bench_async()
    runs = []
    # max_lag 4 takes half the time per evaluation of max_lag 0; TRL (max_lag None) three times as long
    for lag, seconds in ((0, 4.0), (4, 2.0), (None, 6.0)):
        for seed in range(3):
            run = {"task": "long", "system": "tidal" if lag is not None else "trl", "max_lag": lag, "seed": seed,
                   "history": _history([0.3, 0.6, 0.8 + 0.01 * seed], seconds + 0.1 * seed)}
            run |= time_to_target(run["history"], 0.75)
            runs.append(run | {"time_to_0.5_s": time_to_target(run["history"], 0.5)["time_to_target_s"]})
    lines = {line["max_lag"]: line for line in bench.summarize(runs, 0.75, [0.5], np.random.default_rng(0))}
    assert lines[4]["speedup_vs_trl"] == pytest.approx(12.2 / 4.2, abs=1e-3)
    assert lines[None]["system"] == "trl" and lines[None]["speedup_vs_k0"] == pytest.approx(8.2 / 12.2, abs=1e-3)
    assert lines[0]["speedup_vs_k0"] == 1.0
    assert lines[4]["speedup_vs_k0"] == pytest.approx(8.2 / 4.2, abs=1e-3)
    low, high = lines[4]["speedup_vs_k0_90ci"]
    assert low <= lines[4]["speedup_vs_k0"] <= high
    assert lines[4]["final_minus_k0"] == 0.0 and lines[4]["reached"] == 3
    # the fixed rate 0.5 is first reached at the second evaluation
    assert lines[4]["median_time_to_0.5_s"] == pytest.approx(2.1)
    assert lines[4]["speedup_vs_k0_at_0.5"] == pytest.approx(4.1 / 2.1, abs=1e-3)
    assert lines[4]["speedup_vs_trl_at_0.5"] == pytest.approx(6.1 / 2.1, abs=1e-3)


def test_a_compute_axis_keeps_the_step_end_not_the_evaluation_that_completed_later():
    logged = [SimpleNamespace(step=10, value=40.0), SimpleNamespace(step=10, value=43.0),
              SimpleNamespace(step=20, value=45.0)]  # step 10's end, then its evaluation's completion
    assert by_step("compute/wall_s", logged) == {10: 40.0, 20: 45.0}
    assert by_step("eval/pass_rate", [SimpleNamespace(step=10, value=0.5), SimpleNamespace(step=10, value=0.6)]) \
        == {10: 0.6}
