"""End to end with real parts: `tidal run` starts a learner and a vLLM actor process, they talk
over ZeroMQ, MLflow records the run.

A synchronous run (max_lag = 0) that must learn, stopped by killing its only actor. The
asynchronous run with two actors (in-flight updates, bounded lag, logprob parity, junk frames, a
killed actor restarted) is in tests/fault/test_fault_tolerance.py.
"""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from conftest import PrometheusServer, child_pids, wait_until_group_is_gone
from tidal.ops.reachable import free_port

ROOT = Path(__file__).parents[2]


def evals(run_dir: Path) -> dict[int, float]:
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {m["step"]: m["eval/pass_rate"] for m in rows if "eval/pass_rate" in m}


def metrics_ports() -> int:
    """A free port whose next one is free too: the learner's metrics port and its actor's."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def test_a_synchronous_run_learns_and_serves_prometheus_then_an_actor_out_of_restarts_stops_it(tmp_path):
    """One synchronous run (max_lag = 0) with restarts off: it must learn with no lag and no
    in-flight update, while a real Prometheus scrapes its learner and its actor and answers for
    their flow metrics; then a SIGKILL of its only actor stops every process, the dead one named.
    (Restarts themselves are in tests/fault/test_fault_tolerance.py.)"""
    import os
    import signal

    run_dir = tmp_path / "sync"
    metrics_port = metrics_ports()
    prometheus = PrometheusServer(
        tmp_path, {"tidal-learner": [f"127.0.0.1:{metrics_port}"], "tidal-actor": [f"127.0.0.1:{metrics_port + 1}"]}
    )
    cmd = [
        sys.executable,
        "-m",
        "tidal",
        "run",
        str(ROOT / "configs/tiny.yaml"),
        f"run_dir={run_dir}",
        "staleness.max_lag=0",
        "learner.max_steps=1000",
        "eval.every=16",
        "actor.max_restarts=0",
        "actor.vllm.cpu_linear=packed",
        f"tracking.metrics_port={metrics_port}",  # the launcher gives the actor the next port
    ]  # the default layout's layer-wise reload (the demo copies in place)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 360
    while len(found := evals(run_dir)) < 2 or max(found.values()) <= found[0] + 0.05:
        assert len(found) < 4, f"no learning by step 48: val pass rate by step {found}"
        assert time.monotonic() < deadline and proc.poll() is None, f"the run never got going: {found}"
        time.sleep(0.5)
    print(f"val pass rate by step: {found}")
    try:
        check_flow_in_prometheus(prometheus)
    finally:
        prometheus.stop()
    launched_pids = child_pids(proc.pid)
    actor_pid = int(
        next(
            line.split("pid': '")[1].split("'")[0]
            for line in (run_dir / "logs/learner.log").read_text().splitlines()
            if "actor actor-0 joined" in line
        )
    )
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


def test_the_agent_preset_learns_to_finish_its_chains(tmp_path):
    """`tidal run agent`, shortened: a real vLLM actor runs episodes of several turns with a tool call
    each, and the policy learns (0.58 -> 0.80 by step 10 when it was first run). The episodes are
    seen: their metrics, and their turns one by one in the evaluation tables in MLflow."""
    run_dir = tmp_path / "agent"
    cmd = [sys.executable, "-m", "tidal", "run", "agent", f"run_dir={run_dir}", "learner.max_steps=20"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = evals(run_dir)
    print(f"val pass rate by step: {found}")
    assert found[20] >= found[0] + 0.1, found
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "learner/loss" in m]
    assert all(m["episode/turns_mean"] > 1.5 and m["episode/tool_calls_mean"] >= 1 for m in steps)
    assert all(m["episode/env_failed_frac"] == 0 and m["rollout/injected_token_frac"] > 0.1 for m in steps)
    [table] = sorted(run_dir.glob("artifacts/*/artifacts/eval/completions-step-000020.json"))
    table = json.loads(table.read_text())
    conversation = table["data"][0][table["columns"].index("conversation")]
    assert conversation[0]["by"] == "model" and conversation[0]["text"].startswith("[look(x=")
    assert conversation[1]["by"] == "environment"


def test_rewards_outside_their_range_are_said_on_the_console_and_stop_the_run(tmp_path):
    """A wrong answer's partial credit (0.5) below task.reward_range ([0.6, 1]): the config check scores right
    answers and passes, and at run time every group holding a wrong answer is refused. The console says so
    with the setting to change, and the run stops (exit 1) once most of two steps' worth of groups were
    refused."""
    run_dir = tmp_path / "refused"
    cmd = [
        sys.executable,
        "-m",
        "tidal",
        "run",
        "tiny",
        f"run_dir={run_dir}",
        "task.kwargs.partial_credit=0.5",
        "task.reward_range=[0.6,1.0]",
        "learner.refusal_patience_steps=2",
        "learner.max_steps=50",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    console = done.stdout + done.stderr
    assert done.returncode == 1, console[-3000:]
    said = [line for line in console.splitlines() if line.startswith("[learner] the learner refused")]
    assert (
        said
        and "for 'reward' (a reward of 0.5 (task reward 0.5) outside task.reward_range = [0.6, 1]): widen "
        "task.reward_range"
        in said[0]
    ), console[-3000:]
    assert "stopping the run (learner.refusal_patience_steps)" in console
    assert evals(run_dir) == {}  # no pass rate over what was left (tests/unit/test_validation.py: never one)
    print("\n".join(said[:1] + [line for line in console.splitlines() if "stopping the run" in line]))


def check_flow_in_prometheus(prometheus: PrometheusServer) -> None:
    """The learner and the actor, scraped by a real Prometheus, answer for where time and tokens go."""
    up = prometheus.wait_for("up", lambda a: len(a) == 2 and all(v == 1 for v in a.values()))
    print(f"prometheus targets up: {up}")

    def one(promql: str, ok=lambda v: v >= 0) -> float:
        answer = prometheus.wait_for(promql, lambda a: len(a) == 1 and ok(next(iter(a.values()))))
        ((_, value),) = answer.items()
        print(f"{promql} = {value:.4g}")
        return value

    assert one('tidal_learner_version{run="tiny"}', lambda v: v >= 16) >= 16
    assert one('tidal_actor_weight_version{run="tiny",actor="actor-0"}', lambda v: v >= 1) >= 1
    # shares of time are rates of seconds: within [0, 1] (a little over, by the scrapes' own timing)
    assert 0 < one('rate(tidal_learner_rollout_wait_seconds_total{run="tiny"}[15s])', lambda v: v > 0) <= 1.05
    assert 0 < one('rate(tidal_learner_train_seconds_total{run="tiny"}[15s])', lambda v: v > 0) <= 1.05
    assert 0 <= one('rate(tidal_actor_work_wait_seconds_total{run="tiny"}[15s])') <= 1.05
    assert 0 <= one('rate(tidal_actor_weights_wait_seconds_total{run="tiny"}[15s])') <= 1.05
    # synchronous: every version lands before the next group is sampled; the learner is at most one ahead
    assert one('max_over_time(tidal_learner_actor_version_lag{run="tiny",actor="actor-0"}[15s])') <= 1
    assert one('tidal_actor_weight_pull_seconds_count{run="tiny"}', lambda v: v >= 16) >= 16
    # every version read whole from the file channel (weights.delta is off)
    assert one('tidal_actor_weight_received_bytes_total{run="tiny",kind="whole"}', lambda v: v > 0) > 0
    assert one('tidal_actor_weight_received_bytes_total{run="tiny",kind="delta"}') == 0
    assert one('histogram_quantile(0.5, rate(tidal_learner_sample_age_seconds_bucket{run="tiny"}[30s]))') >= 0
    generated = one('tidal_actor_generated_tokens_total{run="tiny"}', lambda v: v > 0)
    assert 0 < one('tidal_learner_generated_tokens_total{run="tiny"}', lambda v: v > 0) <= generated
    assert one('tidal_learner_trained_tokens_total{run="tiny"}', lambda v: v > 0) > 0
    discarded = prometheus.query('tidal_learner_discarded_tokens_total{run="tiny"}')
    assert {dict(labels)["cause"] for labels in discarded} == {"stale", "filtered", "refused"}
    assert one('tidal_broker_live_actors{run="tiny"}', lambda v: v == 1) == 1
    # the actor scaler of k8s/ (KEDA's prometheus trigger) asks this Prometheus for a number of actors: over
    # the seconds this run has had (a rate over 5 minutes of a younger series reads low), more than the one
    # live actor while the learner waits for it, and at most 4x
    scaler = yaml.safe_load((ROOT / "k8s/components/keda-prometheus/scaledobject.yaml").read_text())
    (trigger,) = scaler["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    assert "[5m]" in query
    wanted = one(query.replace("[5m]", "[15s]"), lambda v: 1 < v <= 4)
    assert 1 < wanted <= 4
