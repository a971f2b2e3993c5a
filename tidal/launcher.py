"""`tidal run CONFIG [key=value ...]`: one learner and N actor processes on this machine.

Resolves the config (model path, run directory) and writes it to the run directory, starts
`tidal learner`, waits for the endpoints it bound (`endpoints.json`: ports chosen by the
kernel, so nothing can take them in between), then starts `tidal actor` processes with the
same file plus those ports, follows the learner's
metrics with a progress bar, and stops everything on Ctrl-C or when any process fails,
naming it. On Kubernetes each role is its own pod and this launcher is not used.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tidal.config import RunConfig, to_yaml


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path


class LaunchError(RuntimeError):
    pass


def resolve(cfg: RunConfig) -> Path:
    """Fill in what the processes must agree on; returns the run directory (config.yaml written)."""
    from tidal.learner.warmstart import ensure_model

    run_dir = Path(cfg.run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run_dir = str(run_dir)
    cfg.model.path = ensure_model(cfg.model, cfg.task, progress=lambda msg: print(f"[prepare] {msg}", flush=True))
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return run_dir


def cpu_plan(num_actors: int) -> tuple[str, list[str]]:
    """Cores for the learner and for each actor's engine threads.

    The engine pins its OpenMP threads; left on auto, every actor claims every core. Give the
    learner core 0 and spread the actors over the others (sharing when there are too few).
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) == 1:
        return str(cores[0]), [str(cores[0])] * num_actors
    rest = cores[1:]
    return str(cores[0]), [str(rest[i % len(rest)]) for i in range(num_actors)]


def start_children(cfg: RunConfig, run_dir: Path, children: list[Child]) -> None:
    """The learner first; the actors once it has bound its endpoints. Appends to `children`
    as it goes, so the caller can stop whatever started if a later start fails."""
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "endpoints.json").unlink(missing_ok=True)
    config = str(run_dir / "config.yaml")
    learner_cores, actor_cores = cpu_plan(cfg.actor.replicas)
    children.append(_spawn("learner", ["learner", "--config", config], run_dir, learner_cores))
    ports = wait_for_endpoints(run_dir, children[0])
    for i in range(cfg.actor.replicas):
        overrides = [f"actor.id=actor-{i}", *(f"broker.zmq.{name}_port={port}" for name, port in ports.items())]
        if not cfg.actor.cpu_cores:
            overrides.append(f"actor.cpu_cores={actor_cores[i]}")
        children.append(_spawn(f"actor-{i}", ["actor", "--config", config, *overrides], run_dir, None))


def _spawn(name: str, args: list[str], run_dir: Path, cores: str | None) -> Child:
    log_path = run_dir / "logs" / f"{name}.log"
    cmd = [sys.executable, "-m", "tidal", *args]
    if cores is not None and _has_taskset():
        cmd = ["taskset", "-c", cores, *cmd]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    return Child(name, proc, log_path)


def wait_for_endpoints(run_dir: Path, learner: Child, timeout_s: float = 300.0) -> dict[str, int]:
    path = run_dir / "endpoints.json"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if learner.proc.poll() is not None:
            raise LaunchError(f"learner exited with code {learner.proc.returncode} before binding its endpoints; "
                              f"last lines of {learner.log_path}:\n{tail(learner.log_path)}")
        if time.monotonic() > deadline:
            raise LaunchError(f"learner did not bind its endpoints within {timeout_s:.0f} s; see {learner.log_path}")
        time.sleep(0.2)
    return json.loads(path.read_text())


def _has_taskset() -> bool:
    return any((Path(p) / "taskset").exists() for p in os.environ.get("PATH", "").split(os.pathsep))


def stop_children(children: list[Child], grace_s: float = 10.0) -> None:
    """SIGTERM every child's process group, then SIGKILL what is left after grace_s.

    Groups of children that already died are signalled too: an actor killed from outside
    leaves its vLLM engine-core process behind in its group.
    """
    for c in children:
        _signal_group(c, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
        _signal_group(c, signal.SIGKILL)


def _signal_group(child: Child, sig: int) -> None:
    try:
        os.killpg(child.proc.pid, sig)
    except ProcessLookupError:
        pass  # the whole group is gone already


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def supervise(children: list[Child], run_dir: Path, max_steps: int) -> None:
    """Until the learner exits 0; raises LaunchError naming the first process that fails."""
    from tqdm import tqdm

    metrics_path = run_dir / "metrics.jsonl"
    bar = tqdm(total=max_steps, desc="steps", unit="step", dynamic_ncols=True)
    offset, learner = 0, children[0]
    while True:
        offset = _advance(bar, metrics_path, offset)
        for c in children:
            code = c.proc.poll()
            if code is None:
                continue
            if c is learner and code == 0:
                _advance(bar, metrics_path, offset)
                bar.close()
                return
            if c is not learner and code == 0:
                continue  # an actor told to shut down by a finishing learner
            bar.close()
            raise LaunchError(f"{c.name} exited with code {code}; last lines of {c.log_path}:\n{tail(c.log_path)}")
        time.sleep(0.5)


def _advance(bar, metrics_path: Path, offset: int) -> int:
    if not metrics_path.exists():
        return offset
    with open(metrics_path) as f:
        f.seek(offset)
        for line in f:
            if not line.endswith("\n"):
                break
            offset += len(line)
            m = json.loads(line)
            if "eval/pass_rate" in m:
                bar.write(f"[eval] step {m['step']}: val pass rate {m['eval/pass_rate']:.3f}")
            elif "rollout/reward" in m:
                bar.update(int(m["step"]) - bar.n)
                bar.set_postfix(reward=f"{m['rollout/reward']:.2f}", gen_tok_s=f"{m['rollout/gen_tokens_per_s']:.0f}",
                                learn_tok_s=f"{m['learner/tokens_per_s']:.0f}")
    return offset


def print_summary(run_dir: Path, wall_s: float) -> None:
    s = json.loads((run_dir / "summary.json").read_text())
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"val pass rate: {fmt(s['val_pass_rate_initial'])} -> {fmt(s['val_pass_rate_final'])}")
    print(f"steps: {s['steps']}  samples: {s['samples']}  generated tokens: {s['gen_tokens']}  "
          f"wall time: {wall_s:.1f} s (learner {s['wall_s']:.1f} s)")
    print(f"mlflow run id: {s['mlflow_run_id']}  tracking uri: {s['mlflow_uri']}")
    print(f"run directory: {run_dir}")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def launch(cfg: RunConfig) -> int:
    # Ctrl-C and SIGTERM both stop every child cleanly, even where SIGINT was inherited as ignored
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    start = time.monotonic()
    run_dir = resolve(cfg)
    print(f"[run] {run_dir}: learner + {cfg.actor.replicas} actor(s)", flush=True)
    children: list[Child] = []
    try:
        start_children(cfg, run_dir, children)
        supervise(children, run_dir, cfg.learner.max_steps)
    except LaunchError as err:
        print(f"tidal run failed: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tidal run: interrupted, stopping all processes", file=sys.stderr)
        return 130
    finally:
        stop_children(children)
    print_summary(run_dir, time.monotonic() - start)
    return 0
