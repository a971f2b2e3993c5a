"""Logs a cluster can read: the learner's progress lines (every N steps, rates over recent steps, a
line while it waits for its actors), the launcher's ETA from measured steps and its one wall time,
and vLLM's per-update INFO lines quieted in the actor."""

import importlib.util
import io
import json
import logging
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from tqdm import tqdm

from tidal.actor.engine import PER_UPDATE_LOGGERS, quiet_logging_config, user_configures_logging
from tidal.learner.rank0.tracking import ProgressLog, progress_line, waiting_line
from tidal.ops.launcher import BAR_FORMAT, MIN_MEASURED_STEPS, StepEta, eta_text, print_summary, show_step

STEP = {
    "rollout/reward": 0.4123,
    "rollout/pass_rate": 0.375,
    "learner/loss": -0.01234,
    "offpolicy/lag_mean": 0.4,
    "offpolicy/lag_max": 1.0,
}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def progress_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tidal.learner.progress"]


# ---- the learner's progress lines ----------------------------------------------------------------


def test_a_progress_line_names_each_field_and_says_na_for_what_is_missing():
    line = progress_line({**STEP, "rollout/gen_tokens_per_s": 1830.4}, 12, 100, 2.314)
    assert line == (
        "step 12/100 | reward 0.412 | pass 0.375 | loss -0.01234 | lag 0.40/1 | gen 1830 tok/s | 2.31 s/step"
    )
    bare = progress_line({"rollout/reward": 0.5}, 1, 10, None)
    assert bare == "step 1/10 | reward 0.500 | pass n/a | loss n/a | lag n/a/n/a | gen n/a tok/s | n/a s/step"


def test_a_line_every_n_steps_with_rates_over_the_recent_steps_not_since_the_start(caplog, monkeypatch):
    """The first ten steps take 10 s and generate 100 tokens each, the next twenty 1 s and 500 tokens: the
    last line says 500 tok/s and 1 s/step where since-the-start averages would say 92 and 4."""
    import tidal.learner.rank0.accounting as accounting

    caplog.set_level(logging.INFO, logger="tidal.learner.progress")
    clock = Clock()
    monkeypatch.setattr(accounting.time, "monotonic", clock)
    totals, progress = accounting.Accounting(num_params=1, learner_devices=1), ProgressLog(5, 30, clock=clock)
    for step in range(1, 31):
        slow = step <= 10
        clock.now += 10.0 if slow else 1.0
        metrics = totals.add_step(Counter(samples=1, gen_tokens=100 if slow else 500), computed_tokens=0)
        assert ("rollout/gen_tokens_per_s" in metrics) == (step > 1)  # a rate needs two measured steps
        progress.on_step({**STEP, **metrics}, step)
    lines = progress_records(caplog)
    assert [line.split(" | ")[0] for line in lines] == [f"step {s}/30" for s in (5, 10, 15, 20, 25, 30)]
    assert lines[0].endswith("gen 10 tok/s | 10.00 s/step")
    assert lines[-1].endswith("gen 500 tok/s | 1.00 s/step")


def test_no_progress_lines_when_the_interval_is_zero(caplog):
    caplog.set_level(logging.INFO, logger="tidal.learner.progress")
    progress = ProgressLog(every_steps=0, max_steps=4)
    for step in range(1, 5):
        progress.on_step(STEP, step)
    assert progress_records(caplog) == []


def test_the_learner_says_which_actors_it_waits_for_until_the_first_rollout(caplog):
    caplog.set_level(logging.INFO, logger="tidal.learner.progress")
    clock = Clock()
    progress = ProgressLog(every_steps=1, max_steps=4, num_actors=2, clock=clock)
    hello: list[str] = []
    said_hello = lambda: list(hello)  # noqa: E731 - what the transport's actors() returns so far
    for now, joined, received in [
        (0.5, None, False),
        (10, "actor-1", False),
        (25, None, False),
        (30, None, False),
        (47, "actor-0", False),
        (48, None, True),
        (90, None, False),
    ]:
        clock.now = now
        hello += [joined] if joined else []
        progress.on_receive(received, said_hello)
    assert progress_records(caplog) == [
        "waiting for 2 actor(s): none has said hello yet, no rollout yet after 0 s",
        "waiting for 2 actor(s): 1 said hello (actor-1), no rollout yet after 25 s",
        "waiting for 2 actor(s): 2 said hello (actor-0, actor-1), no rollout yet after 47 s",
    ]
    assert waiting_line([], 0, 3.2) == "waiting for actors: none has said hello yet, no rollout yet after 3 s"


# ---- the launcher's bar and summary --------------------------------------------------------------


def test_the_eta_comes_only_from_measured_steps_never_from_the_start_up():
    eta = StepEta()
    assert eta.remaining_s(100) is None
    for step in range(1, MIN_MEASURED_STEPS + 1):  # 120 s of start-up before step 1, then 0.5 s a step
        eta.observe(step, 120.0 + 0.5 * (step - 1))
        assert eta.remaining_s(100) is None
    eta.observe(MIN_MEASURED_STEPS + 1, 120.0 + 0.5 * MIN_MEASURED_STEPS)
    assert eta.remaining_s(100) == pytest.approx(0.5 * (100 - MIN_MEASURED_STEPS - 1))
    assert eta_text(None) == "eta measuring" and eta_text(3725.4) == "eta 1:02:05"


def test_the_bar_shows_the_measured_eta_and_no_eta_or_rate_of_its_own():
    bar, eta = tqdm(total=10, desc="steps", file=io.StringIO(), bar_format=BAR_FORMAT), StepEta()
    for step in range(1, 6):
        rate = {} if step == 1 else {"rollout/gen_tokens_per_s": 150.0}  # the learner's, from its second step
        show_step(
            bar,
            eta,
            {
                "step": step,
                "rollout/reward": 0.5,
                **rate,
                "learner/tokens_per_s": 900.0,
                "compute/wall_s": 60.0 + 2 * step,
            },
        )
        if step == 1:
            assert "eta measuring" in str(bar) and "gen_tok_s=n/a" in str(bar)
    shown = str(bar)
    assert "5/10" in shown and "eta 0:00:10" in shown and "gen_tok_s=150" in shown
    assert "<" not in shown and "step/s" not in shown  # tqdm's own, counted from before the actors started


def test_the_summary_prints_one_wall_time_and_names_it(tmp_path, capsys):
    summary = {
        "val_pass_rate_initial": 0.36,
        "val_pass_rate_final": 0.95,
        "steps": 150,
        "samples": 19200,
        "gen_tokens": 90000,
        "wall_s": 55.2,
        "mlflow_run_id": "abc",
        "mlflow_uri": "sqlite:///x.db",
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    print_summary(tmp_path, 91.04)
    out = capsys.readouterr().out
    assert out.count("wall time") == 1 and "55.2" not in out
    assert "wall time: 91.0 s (tidal run from start to end, start-up included)" in out


# ---- vLLM's per-update lines in the actor -----------------------------------------------------------

DEFAULT = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"vllm": {"class": "logging.NullHandler", "level": "INFO"}},
    "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}},
}


def test_the_per_update_loggers_go_to_warning_and_every_other_vllm_logger_stays_as_vllm_sets_it():
    config = quiet_logging_config(DEFAULT)
    assert (
        config["loggers"]["vllm"] == DEFAULT["loggers"]["vllm"]
        and "vllm.v1.core.sched.scheduler" in config["loggers"]
        and len(DEFAULT["loggers"]) == 1
    )  # vLLM's own config is copied, not changed
    # applied as vLLM applies it (dictConfig), in a process of its own: dictConfig closes every handler
    names = [*PER_UPDATE_LOGGERS, "vllm.v1.engine.async_llm"]
    probe = (
        "import json, logging, logging.config, sys; logging.config.dictConfig(json.load(sys.stdin)); "
        f"print(json.dumps([[logging.getLogger(n).isEnabledFor(lv) for lv in (20, 30)] for n in {names!r}]))"
    )
    shown = subprocess.run(
        [sys.executable, "-c", probe], input=json.dumps(config), capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(shown) == [[False, True], [False, True], [True, True]]  # (INFO, WARNING) of each


def test_a_users_own_vllm_logging_is_left_as_set():
    assert not user_configures_logging({"logging_config": None, "log_config_file": None}, {})
    assert user_configures_logging({}, {"VLLM_CONFIGURE_LOGGING": "0"})
    assert user_configures_logging({}, {"VLLM_LOGGING_CONFIG_PATH": "/etc/vllm-logging.json"})
    assert user_configures_logging({"log_config_file": "mine.json"}, {})


@pytest.mark.parametrize(
    "logger, message",
    [
        ("vllm.v1.core.sched.scheduler", 'logger.info("setting pause state'),
        ("vllm.v1.core.block_pool", 'logger.info("Successfully reset prefix'),
    ],
)
def test_the_quieted_loggers_are_the_ones_that_print_each_updates_lines(logger, message):
    """Read from the installed vLLM's source (importing it takes seconds): a renamed module shows here."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM is not installed")
    source = Path(spec.submodule_search_locations[0], *logger.split(".")[1:]).with_suffix(".py").read_text()
    assert logger in PER_UPDATE_LOGGERS and "logger = init_logger(__name__)" in source and message in source
