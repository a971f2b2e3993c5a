"""What a run shows besides scalars: completion tables at evaluations, figures at checkpoints,
drawn from bounded samples; logged into a real MLflow store (sqlite in a temporary folder)."""

import json
import threading
import time

import numpy as np
import pytest

from conftest import ALPHABET, CASES, STEP_VERSION, learner_config, sample, step_batch
from tidal.broker.schema import RolloutGroup, int32s
from tidal.config import TrackingConfig
from tidal.learner.every_rank.trainer import TokenSample
from tidal.learner.rank0.diagnostics import Diagnostics
from tidal.ops.reachable import free_port

FIGURES = {"pass_rate.png", "token_lag.png", "logprob_mismatch.png", "rewards_lengths.png"}


@pytest.fixture
def tracker(tmp_path):
    from tidal.learner.rank0.tracking import Tracker

    t = Tracker(TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db", system_metrics_interval_s=0), tmp_path, "t")
    yield t
    t.finish({})


def decode(ids) -> str:
    return "".join(ALPHABET[int(i) % len(ALPHABET)] for i in ids)


def eval_group(i: int, version: int, reward: float) -> RolloutGroup:
    return RolloutGroup.pack(
        [sample([(version, 2), (version + 1, 1)], reward), sample([(version, 3)], 0.0)],
        group_id=f"eval{version}-{i}",
        prompt_id=i,
        actor_id="actor-1",
        prompt_tokens=int32s([1, 10]),
        eval_version=version,
    )


def test_eval_table_shows_the_first_dispatched_groups_with_their_versions(tracker, tmp_path):
    import mlflow

    diagnostics = Diagnostics(tracker, decode, tmp_path, completions_per_eval=4, max_lag=2)
    diagnostics.expect_eval(10, [f"eval10-{i}" for i in range(5)], n=2)  # 4 rows = the first 2 groups
    for i in (4, 1, 0, 3):  # arrival order is not dispatch order
        diagnostics.on_eval_group(eval_group(i, 10, reward=1.0), arrived_at=12)
    diagnostics.eval_done(10)
    table = mlflow.load_table("eval/completions-step-000010.json", run_ids=[tracker.run_id])
    assert sorted(table["group_id"]) == ["eval10-0", "eval10-0", "eval10-1", "eval10-1"]
    assert set(table.columns) >= {"prompt", "completion", "reward", "versions", "lag", "actor", "finish_reason"}
    first = table[table["tokens"] == 3].iloc[0]
    assert (first["prompt"], first["versions"], first["lag"], first["actor"]) == ("1+", "10..11", 2, "actor-1")


def test_figures_are_drawn_from_the_stream_and_logged(tracker, tmp_path, accelerator):
    from mlflow.tracking import MlflowClient

    from conftest import TINY
    from tidal.learner.every_rank.trainer import Trainer
    from tidal.tiny import build_tiny_model

    cfg = learner_config(*CASES["cispo_prompt_mean"])
    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    trainer = Trainer(cfg, model, accelerator, temperature=1.0)
    groups, masks = step_batch(cfg.groups_per_step)
    trainer.step(groups, masks, STEP_VERSION)
    tokens = trainer.last_tokens
    assert int(tokens.lag_counts.sum()) == sum(int(m.sum()) for g in masks for m in g)  # every trained token
    assert tokens.behavior.size == tokens.learner.size > 0
    diagnostics = Diagnostics(tracker, decode, tmp_path, completions_per_eval=0, max_lag=2)
    diagnostics.on_step(groups, tokens)
    for step, rate in ((0, 0.1), (5, 0.3), (10, 0.5), (15, 0.6), (20, 0.65)):
        tracker.log_metrics({"eval/pass_rate": rate, "compute/flops": 1e9 * step}, step=step)
    paths = diagnostics.draw(20)
    assert {p.name for p in paths} == FIGURES
    logged = MlflowClient(tracker.uri).list_artifacts(tracker.run_id, "figures/step-000020")
    assert {a.path.rsplit("/", 1)[1] for a in logged} == FIGURES


def test_a_figure_with_nothing_to_show_is_left_out(tracker, tmp_path):
    diagnostics = Diagnostics(tracker, decode, tmp_path, completions_per_eval=8, max_lag=0)
    assert diagnostics.draw(1) == []
    diagnostics.on_step([], TokenSample(np.array([5, 1]), np.zeros(0), np.zeros(0)))
    assert [p.name for p in diagnostics.draw(2)] == ["token_lag.png"]


def test_tracking_honours_the_environment_when_the_config_is_empty(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from tidal.learner.rank0.tracking import Tracker

    uri = f"sqlite:///{tmp_path}/team.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-experiment")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    t = Tracker(TrackingConfig(system_metrics_interval_s=0), run_dir, "from-env")
    t.log_metrics({"x": 1.0}, step=1)
    t.finish({})
    run = MlflowClient(uri).get_run(t.run_id)
    assert MlflowClient(uri).get_experiment(run.info.experiment_id).name == "team-experiment"
    assert not (run_dir / "mlflow.db").exists()
    assert json.loads((run_dir / "summary.json").read_text())["mlflow_uri"] == uri
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    local = Tracker(TrackingConfig(system_metrics_interval_s=0), run_dir, "local")
    local.finish({})
    assert local.uri == f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def logged_run(cfg) -> int:
    """A run's MLflow side without engines (what tidal.ops.launcher.launch leaves in the store): the
    real Tracker logs the config and a ScaleRL-shaped eval curve that rises more slowly with lag per
    FLOP, but whose steps take less time (1 / (1 + lag / 4) s after 10 s of start-up); one whose lr
    times (lag + 1) passes 0.02 comes apart at its last evaluations."""
    from pathlib import Path

    from tidal.learner.rank0.tracking import Tracker

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    tracker = Tracker(cfg.tracking, run_dir, cfg.name)
    tracker.log_config(cfg)
    lag = cfg.staleness.max_lag
    apart = cfg.learner.optim.lr * (lag + 1) > 0.02
    for step in range(0, 80, 5):
        flops = 1e9 * step
        rate = 0.1 + 0.6 / (1 + (3e10 * (1 + lag / 8) / max(flops, 1.0)) ** 1.5)
        rate = 0.2 if apart and step >= 65 else rate
        tracker.log_metrics(
            {"eval/pass_rate": rate, "compute/flops": flops, "compute/wall_s": 10 + step / (1 + lag / 4)}, step=step
        )
    tracker.finish({})
    return 0


def test_a_sweep_is_one_parent_run_with_a_child_per_point_and_the_fit(tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    import tidal.ops.launcher
    from tidal.ops.cli import main

    monkeypatch.setattr(tidal.ops.launcher, "launch", logged_run)
    out = tmp_path / "sweep"
    assert (
        main(
            [
                "sweep",
                "tiny",
                "staleness.max_lag=0,4",
                "tracking.system_metrics_interval_s=0",
                "--out",
                str(out),
                "--target",
                "0.5",
            ]
        )
        == 0
    )
    # per FLOP lag 0 climbs sooner, per second lag 4: its steps are faster (47.6 s against 35.7 s to 0.5)
    printed = capsys.readouterr().out
    assert "pick: staleness.max_lag=4, predicted to reach 0.5 soonest (35.7 [" in printed
    client = MlflowClient(f"sqlite:///{(out / 'mlflow.db').resolve()}")
    runs = json.loads((out / "runs.json").read_text())
    children = [client.get_run(r) for r in runs.values()]
    parent_id = children[0].data.tags["mlflow.parentRunId"]
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent_id}
    assert {c.data.tags["tidal.fit_run_id"] for c in children} == {parent_id}
    parent = client.get_run(parent_id)
    assert parent.data.params["grid.staleness.max_lag"] == "0,4" and parent.info.status == "FINISHED"
    assert {c.info.run_name for c in children} == {"staleness.max_lag-0", "staleness.max_lag-4"}  # grid points
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # model training, not GenAI
    logged = {a.path for a in client.list_artifacts(parent_id)}
    assert {"fit.png", "fit-wall.png", "fit_table.txt", "runs.json"} <= logged
    assert {"fit/staleness.max_lag_0/A", "fit/staleness.max_lag_4/B"} <= set(parent.data.metrics)

    # `tidal fit --runs` on the same runs: a new run beside them, linked both ways
    assert (
        main(
            ["fit", "--tracking-uri", client.tracking_uri, "--runs", *runs.values(), "--out", str(tmp_path / "fit.png")]
        )
        == 0
    )
    assert "shared A" in capsys.readouterr().out
    fit_id = client.get_run(next(iter(runs.values()))).data.tags["tidal.fit_run_id"]
    fit = client.get_run(fit_id)
    assert fit_id != parent_id and fit.info.experiment_id == children[0].info.experiment_id
    assert fit.data.tags["tidal.fitted_runs"] == ",".join(runs.values())
    assert {fit.data.params[f"run.{r}"] for r in runs.values()} == set(runs.values())
    assert fit.data.params["compute_metric"] == "compute/flops"


def test_a_lag_by_lr_sweep_reports_each_lags_largest_stable_lr(tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    import tidal.ops.launcher
    from tidal.ops.cli import main

    monkeypatch.setattr(tidal.ops.launcher, "launch", logged_run)
    out = tmp_path / "sweep"
    assert (
        main(
            [
                "sweep",
                "tiny",
                "staleness.max_lag=0,4",
                "learner.optim.lr=1e-3,1e-2",
                "tracking.system_metrics_interval_s=0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "the largest stable lr falls like 1/(max_lag + 1)" in printed  # 1e-2 at lag 0, 1e-3 at lag 4
    client = MlflowClient(f"sqlite:///{(out / 'mlflow.db').resolve()}")
    parent = client.get_run(
        client.get_run(json.loads((out / "runs.json").read_text()).popitem()[1]).data.tags["mlflow.parentRunId"]
    )
    assert {"stability.png", "stability.txt"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}


def test_step_metrics_reach_mlflow_in_order_from_the_background_and_a_failed_write_is_raised(tracker, tmp_path):
    from mlflow.exceptions import MlflowException

    for step in range(1, 31):
        tracker.log_metrics({"learner/version": float(step), "learner/loss": 0.5, "skipped": float("nan")}, step=step)
    assert tracker.last_step() == 30  # reads wait for the writes before them
    history = tracker._client.get_metric_history(tracker.run_id, "learner/version")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(1, 31)]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 31))
    tracker.log_metrics({"not a valid name!": 1.0}, step=31)  # MLflow refuses the name, in the writer's thread
    with pytest.raises(MlflowException, match="not a valid name"):
        tracker.settle()


def test_steps_logged_during_a_slow_write_go_out_together_in_order(tracker):
    """A write that takes a while (a busy store) does not queue one write per step behind it: the
    steps logged meanwhile share the next write, and every value arrives."""
    calls, write = [], tracker._client.log_batch

    def slow(run_id, metrics, synchronous):
        calls.append(sorted({m.step for m in metrics}))
        time.sleep(0.05)
        write(run_id, metrics=metrics, synchronous=synchronous)

    tracker._client.log_batch = slow
    for step in range(1, 21):
        tracker.log_metrics({"learner/version": float(step)}, step=step)
    tracker.settle()
    assert len(calls) < 20 and sum(calls, []) == list(range(1, 21))
    history = tracker._client.get_metric_history(tracker.run_id, "learner/version")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(1, 21)]


def test_a_refused_chunk_costs_only_its_own_steps_and_its_error_is_raised_once(tracker, monkeypatch):
    """A write that carries several chunks (steps logged during a slow write) goes on past one the
    store refuses: the steps of the other chunks arrive, and settle raises the refusal once."""
    from mlflow.exceptions import MlflowException

    import tidal.learner.rank0.tracking as tracking

    monkeypatch.setattr(tracking, "MAX_BATCH_METRICS", 1)  # one metric per chunk
    release, write = threading.Event(), tracker._client.log_batch

    def held(run_id, metrics, synchronous):
        release.wait(5)  # the first write waits, so the steps after it share the second
        write(run_id, metrics=metrics, synchronous=synchronous)

    tracker._client.log_batch = held
    tracker.log_metrics({"learner/version": 1.0}, step=1)
    tracker.log_metrics({"learner/version": 2.0}, step=2)
    tracker.log_metrics({"bad name!": 3.0}, step=3)
    tracker.log_metrics({"learner/version": 4.0}, step=4)
    release.set()
    with pytest.raises(MlflowException, match="bad name"):
        tracker.settle()
    tracker.settle()  # raised once: the writes after it go on
    history = tracker._client.get_metric_history(tracker.run_id, "learner/version")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0), (4, 4.0)]


def test_credentials_in_the_config_reach_mlflow_redacted(tracker, tmp_path):
    """tracking.uri and broker.redis.url with a password and a token: neither is in the params nor
    in the config.yaml artifact (both showed them before)."""
    from dataclasses import replace

    from mlflow.tracking import MlflowClient

    from tidal.config import RedisConfig, RunConfig

    cfg = RunConfig()
    cfg = replace(
        cfg,
        tracking=replace(cfg.tracking, uri="https://bob:hunter22@mlflow.example/?token=t0k3n"),
        broker=replace(cfg.broker, redis=RedisConfig(url="redis://learner:hunter22@redis:6379/0")),
    )
    tracker.log_config(cfg)
    client = MlflowClient(tracker.uri)
    params = client.get_run(tracker.run_id).data.params
    assert params["tracking.uri"] == "https://bob:***@mlflow.example/?token=***"
    path = client.download_artifacts(tracker.run_id, "config.yaml", str(tmp_path / "dl"))
    shown = open(path).read() + repr(params)
    assert "hunter22" not in shown and "t0k3n" not in shown
    assert "https://bob:***@mlflow.example/?token=***" in shown


def test_the_launchers_last_word_finds_the_store_from_the_runs_config_not_the_redacted_summary(tmp_path):
    """summary.json shows the URI redacted; the run's logs still reach MLflow through the URI the
    run's own config.yaml resolves to."""
    from dataclasses import replace

    from mlflow.tracking import MlflowClient

    from tidal.config import RunConfig, to_yaml
    from tidal.learner.rank0.tracking import Tracker
    from tidal.mlflow_store import log_final_logs

    uri = f"sqlite:///{tmp_path}/store.db"
    cfg = RunConfig()
    cfg = replace(cfg, tracking=replace(cfg.tracking, uri=uri, system_metrics_interval_s=0))
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    t = Tracker(cfg.tracking, run_dir, "r")
    t.finish({})
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "mlflow_uri": "https://***@elsewhere/"}))
    (run_dir / "logs" / "actor-0.log").write_text("written after the learner finished\n")
    log_final_logs(run_dir)
    assert "actor-0.log" in {f.path.split("/")[-1] for f in MlflowClient(uri).list_artifacts(t.run_id, "logs")}


def probed_run(cfg) -> int:
    """A plan-batch probe's MLflow side without engines: a step takes 0.1 s + 0.01 s a group, and each
    evaluation holds up the step after it by 1 s."""
    from pathlib import Path

    from tidal.learner.rank0.tracking import Tracker

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    tracker = Tracker(cfg.tracking, run_dir, cfg.name)
    tracker.log_config(cfg)
    b, wall = cfg.learner.groups_per_step, 5.0
    for step in range(cfg.learner.max_steps + 1):
        if step:
            wall += 0.1 + 0.01 * b + (1.0 if step > 1 and (step - 1) % cfg.eval.every == 0 else 0.0)
        tracker.log_metrics(
            {"compute/wall_s": wall, "compute/samples": step * b * cfg.sampling.n, "timing/train_step_s": 0.005 * b},
            step=step,
        )
    tracker.finish({})
    return 0


def test_plan_batch_probes_each_batch_and_times_the_target_from_an_earlier_run(tmp_path, monkeypatch, capsys):
    import tidal.ops.launcher
    from tidal.config import load_config
    from tidal.learner.rank0.tracking import Tracker
    from tidal.ops.cli import main

    # an earlier run at 16 groups, evaluated every 5 steps, first at 0.7 at step 20: about 17.5 steps
    cfg = load_config(
        ["tiny"],
        [
            "learner.groups_per_step=16",
            "eval.every=5",
            "tracking.system_metrics_interval_s=0",
            f"run_dir={tmp_path / 'earlier'}",
        ],
    )
    (tmp_path / "earlier").mkdir()
    tracker = Tracker(cfg.tracking, tmp_path / "earlier", "earlier")
    tracker.log_config(cfg)
    for step, rate in ((0, 0.36), (5, 0.5), (10, 0.6), (15, 0.65), (20, 0.72), (25, 0.75)):
        tracker.log_metrics({"eval/pass_rate": rate}, step=step)
    tracker.finish({})
    monkeypatch.setattr(tidal.ops.launcher, "launch", probed_run)
    assert (
        main(
            [
                "plan-batch",
                "tiny",
                "tracking.system_metrics_interval_s=0",
                "--batch-sizes",
                "8,16",
                "--eval-every-groups",
                "80",
                "--target",
                "0.7",
                "--tracking-uri",
                tracker.uri,
                "--runs",
                tracker.run_id,
                "--probe-dir",
                str(tmp_path / "probes"),
                "--out",
                str(tmp_path / "plan.png"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # S = 17.5 x 16 x 8 = 2,240 samples: 35 steps at B=8 (an evaluation every 10: seen at 40), 17.5 at 16
    # (every 5: seen at 20); 0.18 s and 0.26 s a step, 1 s for each of the 3 evaluations before
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["8"], ["16"])}
    assert rows["8"][3:] == ["0.180", "1.00", "2240", "40", "10.2"]
    assert rows["16"][3:] == ["0.260", "1.00", "2240", "20", "8.2"]
    assert "ASSUMPTION" in out and "recommendation: B = 16" in out and (tmp_path / "plan.png").is_file()


def test_a_new_run_is_named_after_its_task_and_its_config(tmp_path):
    """A `count` run on the tiny preset was named "tiny", like every run built on the preset."""
    from mlflow.tracking import MlflowClient

    from tidal.config import load_config
    from tidal.learner.rank0.tracking import Tracker

    cfg = load_config(
        ["tiny"],
        ["task.name=count", "tracking.system_metrics_interval_s=0", f"tracking.uri=sqlite:///{tmp_path}/store.db"],
    )
    tracker = Tracker(cfg.tracking, tmp_path, cfg.name)
    tracker.log_config(cfg)
    tracker.finish({})
    assert MlflowClient(tracker.uri).get_run(tracker.run_id).info.run_name == "count-tiny"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on a free loopback port, a sqlite store and artifacts behind it, as a team
    runs one; its address. It takes 10-45 s to start on 2 cores (the store's migrations)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import requests

    folder = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()  # outside the ephemeral range: a child binds it later
    log = open(folder / "server.log", "w")
    server = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{folder}/server.db",
            "--artifacts-destination",
            str(folder / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    uri, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 240
    while not _answers(requests, f"{uri}/health"):
        assert server.poll() is None and time.monotonic() < deadline, (folder / "server.log").read_text()[-2000:]
        time.sleep(0.5)
    yield uri
    os.killpg(server.pid, signal.SIGTERM)  # the server and the uvicorn it started
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    log.close()


def _answers(requests, url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def test_a_run_on_a_tracking_server_is_checked_named_and_linked_as_model_training(mlflow_server, tmp_path):
    """Before start the server is asked for /health (a server that is down is one line, tests/unit/
    test_reachable.py); the run is named after its task and config, its experiment tagged as model
    training, and the summary links its page in model-training mode, which the server serves."""
    import requests
    from mlflow.tracking import MlflowClient

    from tidal.config import load_config
    from tidal.learner.rank0.tracking import Tracker
    from tidal.mlflow_store import mlflow_ui_lines
    from tidal.ops.reachable import check_reachable

    cfg = load_config(
        ["tiny"],
        [
            "task.name=count",
            "tracking.system_metrics_interval_s=0",
            f"tracking.uri={mlflow_server}",
            "tracking.experiment=team",
        ],
    )
    assert check_reachable(cfg) == [f"MLflow server {mlflow_server}: answers (200 from /health)"]
    tracker = Tracker(cfg.tracking, tmp_path, cfg.name)
    tracker.log_config(cfg)
    tracker.log_metrics({"eval/pass_rate": 0.5}, step=1)
    tracker.finish({})
    client = MlflowClient(mlflow_server)
    run = client.get_run(tracker.run_id)
    assert run.info.run_name == "count-tiny"
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    lines = mlflow_ui_lines(mlflow_server, tmp_path)
    page = (
        f"{mlflow_server}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning"
    )
    assert lines == [f"mlflow ui: {mlflow_server} (the tracking server)", f"the run, as model training: {page}"]
    answer = requests.get(page, timeout=10)  # the part after # is the UI's own: the server serves the UI there
    assert answer.status_code == 200 and "<html" in answer.text.lower()
