"""End to end with real parts: `tidal run` starts a learner and vLLM actor processes, they talk
over ZeroMQ, weights are swapped in flight, MLflow records the run.

Two runs, each a few minutes at most on 2 cores: an asynchronous one with 2 actors (in-flight
updates, bounded lag, logprob parity, junk frames on the rollout socket) and a synchronous one
(max_lag = 0) that must still learn, stopped by killing its only actor.
"""
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from conftest import child_pids, wait_until_group_is_gone

ROOT = Path(__file__).parents[2]


def run_tidal(run_dir: Path, overrides: list[str], timeout_s: float = 420, during=None):
    cmd = [sys.executable, "-m", "tidal", "run", str(ROOT / "configs/tiny.yaml"), f"run_dir={run_dir}", *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if during is not None:
        threading.Thread(target=during, args=(run_dir,), daemon=True).start()
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, f"tidal run failed:\n{out[-4000:]}"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return out, [m for m in steps if "learner/loss" in m], summary


def send_junk(run_dir: Path) -> None:
    """Once training is under way, put a malformed and an oversized frame on the rollout socket."""
    metrics, endpoints = run_dir / "metrics.jsonl", run_dir / "endpoints.json"
    deadline = time.monotonic() + 300
    while not (endpoints.exists() and metrics.exists() and "learner/loss" in metrics.read_text()):
        if time.monotonic() > deadline:
            return  # the run itself failed to start; its assertion says why
        time.sleep(0.5)
    ports = json.loads(endpoints.read_text())
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{ports['rollout']}")
    push.send(b"\x93not a tidal message")
    push.send(b"\x00" * (2 * 1024 * 1024))  # above broker.max_message_bytes below
    time.sleep(1)
    ctx.destroy(linger=1000)


ASYNC_STEPS = 20


def test_async_run_with_two_actors(tmp_path):
    max_lag = 2
    out, steps, summary = run_tidal(
        tmp_path / "async",
        # evaluating every other step keeps the engines busy when weights arrive, so updates land
        # while requests are in flight (the tiny task's completions are only a few tokens long)
        ["actor.replicas=2", f"staleness.max_lag={max_lag}", f"learner.max_steps={ASYNC_STEPS}", "eval.every=2",
         "broker.max_message_bytes=1048576"],
        during=send_junk)
    # an in-flight update happened: some completion was produced by two or more weight versions
    in_flight = sum(m["rollout/multi_version_samples"] for m in steps) + steps[-1]["eval/multi_version_samples_total"]
    print(f"samples spanning two or more weight versions: {in_flight}")
    assert in_flight >= 1
    # no consumed token is older than the staleness bound
    assert max(m["offpolicy/lag_max"] for m in steps) <= max_lag
    # learner and actor agree on logprobs for tokens produced at the learner's current version
    fresh = [m["offpolicy/fresh_logprob_max_abs_diff"] for m in steps if "offpolicy/fresh_logprob_max_abs_diff" in m]
    assert fresh, "no sample was produced entirely at the learner's current version"
    print(f"max |logp_learner - logp_vllm| over fresh tokens: {max(fresh):.2e}")
    assert max(fresh) < 1e-3
    # the junk frames were rejected, counted, and the run went on to the end
    assert summary["rejected_frames"] == 1  # the malformed one; the oversized one never passed ZMQ_MAXMSGSIZE
    assert summary["steps"] == ASYNC_STEPS
    assert "val pass rate:" in out and summary["mlflow_run_id"] in out
    assert_mlflow_shows_the_run(summary)
    # the harmless per-layer reload warning is filtered in the workers, and weights did reload
    actor_logs = "".join(p.read_text() for p in (tmp_path / "async/logs").glob("actor-*.log"))
    assert "Failed to load weights" not in actor_logs
    assert "Exception ignored" not in actor_logs  # the engine is shut down and collected before exit


def assert_mlflow_shows_the_run(summary):
    """The run's MLflow record, opened as a user would: params, tags, system metrics, the dataset,
    the curves, a completion table per evaluation, figures, ledger, metrics and logs."""
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=summary["mlflow_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens on runs
    assert run.data.params["staleness.max_lag"] == "2"
    tags = run.data.tags
    assert (tags["tidal.task"], tags["tidal.broker"], tags["tidal.max_lag"]) == ("arithmetic", "zmq", "2")
    assert tags["tidal.model"] and all(tags[f"{p}.version"][0].isdigit() for p in ("tidal", "vllm", "torch"))
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(run.data.metrics)
    contexts = {t.value for d in run.inputs.dataset_inputs for t in d.tags if t.key == "mlflow.data.context"}
    assert contexts == {"training", "eval"}
    history = client.get_metric_history(run_id, "rollout/reward")
    assert [m.step for m in history] == list(range(1, ASYNC_STEPS + 1))
    evals = client.get_metric_history(run_id, "eval/pass_rate")
    assert {m.step for m in evals} == set(range(0, ASYNC_STEPS + 1, 2))

    def listed(path=None):
        return {a.path for a in client.list_artifacts(run_id, path)}

    assert {"config.yaml", "summary.json", "ledger.jsonl", "metrics.jsonl", "logs", "eval", "figures"} <= listed()
    assert {"logs/learner.log", "logs/actor-0.log", "logs/actor-1.log"} <= listed("logs")
    assert listed("eval") == {f"eval/completions-step-{v:06d}.json" for v in range(0, ASYNC_STEPS + 1, 2)}
    last = f"figures/step-{ASYNC_STEPS:06d}"
    assert listed(last) == {f"{last}/{name}.png" for name in
                                             ("pass_rate", "token_lag", "logprob_mismatch", "rewards_lengths")}
    mlflow.set_tracking_uri(summary["mlflow_uri"])  # load_table searches through the fluent API's store
    table = client.load_table(run.info.experiment_id, f"eval/completions-step-{ASYNC_STEPS:06d}.json",
                              run_ids=[run_id])
    assert len(table) >= 8 and table["completion"].str.len().max() > 0
    assert set(table["reward"]) <= {0.0, 1.0} and (table["lag"] >= 0).all()


def evals(run_dir: Path) -> dict[int, float]:
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {m["step"]: m["eval/pass_rate"] for m in rows if "eval/pass_rate" in m}


def test_a_synchronous_run_learns_then_an_actor_out_of_restarts_stops_it(tmp_path):
    """One synchronous run (max_lag = 0) with restarts off: it must learn with no lag and no
    in-flight update, then a SIGKILL of its only actor stops every process, the dead one named.
    (Restarts themselves are in test_fault_tolerance.py.)"""
    import os
    import signal

    run_dir = tmp_path / "sync"
    cmd = [sys.executable, "-m", "tidal", "run", str(ROOT / "configs/tiny.yaml"), f"run_dir={run_dir}",
           "staleness.max_lag=0", "learner.max_steps=1000", "eval.every=16", "actor.max_restarts=0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 360
    while len(found := evals(run_dir)) < 2 or max(found.values()) <= found[0] + 0.05:
        assert len(found) < 4, f"no learning by step 48: val pass rate by step {found}"
        assert time.monotonic() < deadline and proc.poll() is None, f"the run never got going: {found}"
        time.sleep(0.5)
    print(f"val pass rate by step: {found}")
    launched_pids = child_pids(proc.pid)
    actor_pid = int(next(line.split("pid': '")[1].split("'")[0] for line in
                         (run_dir / "logs/learner.log").read_text().splitlines() if "actor actor-0 joined" in line))
    os.kill(actor_pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "actor-0 exited with code -9 and was restarted 0 times" in out
    # nothing of the run is left: not the learner, nor the dead actor's vLLM engine process
    # (each child leads its own process group, named by its pid)
    for pid in [actor_pid, *launched_pids]:
        assert wait_until_group_is_gone(pid), f"processes of group {pid} still alive after 15 s"
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "learner/loss" in m]
    assert max(m["offpolicy/lag_max"] for m in steps) == 0
    assert sum(m["rollout/multi_version_samples"] for m in steps) == 0
