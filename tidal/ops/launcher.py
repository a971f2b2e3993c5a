"""`tidal run CONFIG [key=value ...] [--resume]`: one learner and N actor processes on this machine.

Resolves the config (model path, run directory; a local redis-server when
`broker.redis.embedded`) and writes it to the run directory, starts `tidal learner`, waits for
the endpoints it bound (`endpoints.json`: ports chosen by the kernel, so nothing can take them
in between), then starts `tidal actor` processes with the same file plus those ports, and
follows the learner's metrics with a progress bar (and, with --print-samples, a few rollouts of
each rollout table the learner writes). Every ZeroMQ port of a run authenticates its
peers, loopback included: CURVE is on, with the keys folder named or keys made for the run in
<run_dir>/keys (`with_run_keys`). A dead actor is restarted with backoff
(up to `actor.max_restarts` times); the learner failing stops everything, naming it; so does
Ctrl-C. On Kubernetes each role is its own pod and this launcher is not used.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from tidal.broker.zmq_keys import ForeignKeys, generate, run_keys
from tidal.config import BrokerType, RunConfig, resolve, write_config
from tidal.files import run_marks, used_run_dir
from tidal.mlflow_store import log_final_logs, mlflow_ui_lines
from tidal.ops.memory import check_gpus
from tidal.ops.placement import Placement, PlacementError, Slot, place, visible_gpus
from tidal.ops.preflight import preflight
from tidal.ops.reachable import check_reachable, free_port
from tidal.run_files import NOTICES_FILE, ROLLOUTS_FILE, rollout_text


@dataclass
class Child:
    name: str
    role: str  # learner | actor | redis
    proc: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)  # to start it again
    slot: Slot = field(default_factory=Slot)  # its cores and GPUs
    restarts: int = 0
    restart_at: float | None = None  # when a dead actor is due to start again


class LaunchError(RuntimeError):
    pass


def prepare(cfg: RunConfig, redis_url: str | None = None) -> RunConfig:
    """Resolve what the processes must agree on (building the tiny model if it is missing) and write
    it to the run directory's config.yaml, which every child reads."""
    from tidal.learner.tools.warmstart import build_tiny
    from tidal.models import resolve_model_path

    progress = partial(print, "[prepare]", flush=True)
    cfg = resolve(
        cfg,
        model_path=resolve_model_path(cfg.model, cfg.task, partial(build_tiny, progress=progress)),
        redis_url=redis_url,
    )
    write_config(cfg, Path(cfg.run_dir))
    return cfg


def with_run_keys(cfg: RunConfig) -> RunConfig:
    """CURVE on for the run (zmq broker): keys for every actor in the folder named, else this run's own
    in run_dir/keys (secret keys 0600 in a 0700 folder). The children read both from config.yaml."""
    z = cfg.broker.zmq
    if cfg.broker.type is not BrokerType.zmq:
        return cfg
    actor_ids = [f"actor-{i}" for i in range(cfg.actor.replicas)]
    try:
        keys_dir = generate(z.keys_dir, actor_ids) if z.keys_dir else run_keys(cfg.run_dir, actor_ids)
    except ForeignKeys as err:
        raise LaunchError(str(err)) from None
    return replace(cfg, broker=replace(cfg.broker, zmq=replace(z, curve="on", keys_dir=str(Path(keys_dir).resolve()))))


def start_children(cfg: RunConfig, placement: Placement, children: list[Child], resume: str | None = None) -> None:
    """The learner and the actors at once: an actor's start (vLLM's import, its engine) is most of
    a run's start-up and needs nothing from the learner, whose ZeroMQ ports are chosen here and
    handed to both (ZeroMQ connects once the learner binds). Actors sharing the learner's GPUs
    (actor.colocate) start once the learner has taken its memory. Appends to `children` as it goes,
    so the caller can stop whatever started if a later start fails."""
    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "endpoints.json").unlink(missing_ok=True)
    config = str(run_dir / "config.yaml")
    learner_args = ["learner", config, *(["--resume", resume] if resume else [])]
    if cfg.learner.num_ranks > 1 and cfg.learner.nodes == 1:  # `tidal learner` starts its ranks with torchrun
        learner_args.append(f"learner.master_port={free_port()}")  # two runs on one machine must not meet
    ports = {}
    if cfg.broker.type is BrokerType.zmq:
        ports = {
            name: getattr(cfg.broker.zmq, f"{name}_port") or free_port() for name in ("control", "rollout", "weights")
        }
        learner_args += actor_endpoint_overrides(ports)
    children.append(_spawn("learner", "learner", learner_args, run_dir, placement.learner))
    if cfg.actor.colocate:  # engines measure the GPU's free memory as they start: the learner's must be taken
        wait_for_learner(children[-1], run_dir)
    for i, slot in enumerate(placement.actors):
        overrides = [f"actor.index={i}", *actor_endpoint_overrides(ports)]
        if cfg.tracking.metrics_port:  # one machine: each process its own metrics port, the learner's first
            overrides.append(f"tracking.metrics_port={cfg.tracking.metrics_port + 1 + i}")
        if slot.gpus is None and not cfg.actor.cpu_cores:
            overrides.append(f"actor.cpu_cores={slot.cores}")  # vLLM's CPU engine binds its threads there
        children.append(_spawn(f"actor-{i}", "actor", ["actor", config, *overrides], run_dir, Slot(gpus=slot.gpus)))


def wait_for_learner(learner: Child, run_dir: Path, poll_s: float = 0.5) -> None:
    """Until the learner has built its model and optimizer and bound its ports (it writes
    endpoints.json then); a learner that exits first stops the run, naming it."""
    while not (run_dir / "endpoints.json").exists():
        if learner.proc.poll() is not None:
            raise LaunchError(
                f"the learner exited with code {learner.proc.returncode} before it was ready; last "
                f"lines of {learner.log_path}:\n{tail(learner.log_path)}"
            )
        time.sleep(poll_s)


def actor_endpoint_overrides(ports: dict[str, int]) -> list[str]:
    """What the learner and the actors need beyond the run's config.yaml: the learner's ports (zmq only)."""
    return [f"broker.zmq.{name}_port={port}" for name, port in ports.items()]


def _spawn(name: str, role: str, args: list[str], run_dir: Path, slot: Slot, restarts: int = 0) -> Child:
    log_path = run_dir / "logs" / f"{name}.log"
    cmd = [sys.executable, "-m", "tidal", *args]
    if slot.cores is not None and _has_taskset():
        cmd = ["taskset", "-c", slot.cores, *cmd]
    log_file = open(log_path, "a" if restarts else "w")
    if restarts:
        log_file.write(f"\n===== restart {restarts} =====\n")
        log_file.flush()
    proc = subprocess.Popen(
        cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, env=os.environ | slot.env()
    )
    return Child(name, role, proc, log_path, args, slot, restarts)


def start_redis(cfg: RunConfig, run_dir: Path) -> tuple[Child, str]:
    """A local redis-server for this run: AOF on with fsync per write, data in run_dir/redis,
    so `--resume` finds the streams where the crashed run left them, and a password of its own,
    generated, in a 0600 config file (in a 0700 folder) and in the environment of this launcher's children (never in
    config.yaml or on a command line). Returns it and its URL."""
    server = shutil.which("redis-server")
    if server is None:
        raise LaunchError(
            "broker.redis.embedded is true but redis-server is not installed (apt-get install redis-server)"
        )
    port = cfg.broker.redis.embedded_port or free_port()
    data = run_dir / "redis"
    data.mkdir(exist_ok=True)
    # its files (the AOF holds every announcement, weight tokens included) are written under redis-server's
    # umask, readable by every local user: the folder is what keeps them the run's own
    os.chmod(data, 0o700)
    log_path = run_dir / "logs" / "redis.log"
    (run_dir / "logs").mkdir(exist_ok=True)
    password = secrets.token_urlsafe(32)
    conf = data / "redis.conf"
    conf.touch(mode=0o600)
    conf.write_text(f"requirepass {password}\n")
    os.environ[cfg.broker.redis.password_env] = password  # the children inherit it
    cmd = [
        server,
        str(conf),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(data),
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--save",
        "",
        "--logfile",
        str(log_path),
    ]
    child = Child("redis-server", "redis", subprocess.Popen(cmd, start_new_session=True), log_path, cmd)
    deadline = time.monotonic() + 30
    while not _port_open(port):
        if child.proc.poll() is not None or time.monotonic() > deadline:
            raise LaunchError(f"redis-server did not start on port {port}; see {log_path}:\n{tail(log_path)}")
        time.sleep(0.1)
    return child, f"redis://127.0.0.1:{port}/0"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


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


MAX_BACKOFF_S = 30.0
# tqdm's own ETA and rate count from the bar's creation, start-up included (the actors' engines start
# before the first step): the bar shows neither, only the ETA `StepEta` measures from training steps
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{postfix}"


def supervise(children: list[Child], run_dir: Path, cfg: RunConfig, print_samples: int = 0) -> None:
    """Until the learner exits 0. A dead actor is restarted with backoff; the learner (or
    redis-server) dying, or an actor out of restarts, raises LaunchError naming it. With
    print_samples, that many rollouts of each rollout table go to the console as they come."""
    from tqdm import tqdm

    metrics_path = run_dir / "metrics.jsonl"
    bar = tqdm(total=cfg.learner.max_steps, desc="steps", unit="step", dynamic_ncols=True, bar_format=BAR_FORMAT)
    eta, offset, learner = StepEta(), 0, next(c for c in children if c.role == "learner")
    samples = RolloutFollower(run_dir, print_samples, bar.write) if print_samples > 0 else None
    notices = NoticeFollower(run_dir, bar.write)
    warmed = False
    try:
        while True:
            offset = _advance(bar, eta, metrics_path, offset)
            notices.advance()
            if samples is not None:
                samples.advance()
            if bar.n and not warmed:  # training is under way: the start-up's imports are done
                threading.Thread(target=_import_mlflow, name="warm-mlflow", daemon=True).start()
                warmed = True
            for i, c in enumerate(children):
                code = c.proc.poll()
                if code is None:
                    continue
                if c is learner and code == 0:
                    _advance(bar, eta, metrics_path, offset)
                    notices.advance()
                    if samples is not None:
                        samples.advance()  # a table written just before the learner exited
                    return
                if c.role != "actor":
                    notices.advance()
                    raise LaunchError(
                        f"{c.name} exited with code {code}; last lines of {c.log_path}:\n{tail(c.log_path)}"
                    )
                if code != 0:  # exit 0: told to shut down by a finishing learner
                    children[i] = _restart_actor(c, code, cfg.actor, run_dir, bar)
            time.sleep(0.2)
    finally:
        bar.close()


def _import_mlflow() -> None:
    """MLflow's client, imported while the launcher only watches: the run's last step (`log_final_logs`
    once every process has exited) then does not wait the 1.5 s that import takes."""
    import mlflow.tracking  # noqa: F401


def _restart_actor(c: Child, code: int, cfg, run_dir: Path, bar) -> Child:
    """Schedule, then perform, the restart of a dead actor; returns the child to watch."""
    now = time.monotonic()
    if c.restart_at is None:
        _signal_group(c, signal.SIGKILL)  # its engine-core process may still hold memory
        sweep_orphan_shm()
        if c.restarts >= cfg.max_restarts:
            raise LaunchError(
                f"{c.name} exited with code {code} and was restarted {c.restarts} times "
                f"(actor.max_restarts); last lines of {c.log_path}:\n{tail(c.log_path)}"
            )
        delay = min(cfg.restart_backoff_s * 2**c.restarts, MAX_BACKOFF_S)
        bar.write(
            f"[run] {c.name} exited with code {code}; restarting in {delay:.1f} s "
            f"(restart {c.restarts + 1} of {cfg.max_restarts})"
        )
        c.restart_at = now + delay
        return c
    if now < c.restart_at:
        return c
    return _spawn(c.name, c.role, c.args, run_dir, c.slot, restarts=c.restarts + 1)


def sweep_orphan_shm() -> None:
    """Remove vLLM shared-memory segments (/dev/shm/psm_*) that no live process maps, and weights
    staged by actors that are gone: a killed engine or actor never ran its cleanup, and each
    segment or file holds on to its memory until removed."""
    from tidal.broker.weights import orphaned_staging  # torch with it: only when a run starts

    for path in orphaned_staging():
        path.unlink(missing_ok=True)
    shm = Path("/dev/shm")
    segments = {p.name for p in shm.glob("psm_*")}
    if not segments:
        return
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        segments = {name for name in segments if f"/dev/shm/{name}" not in text}
    for name in segments:
        try:
            (shm / name).unlink(missing_ok=True)
        except OSError:  # another user's segment (its maps were unreadable): not ours to remove
            pass


MIN_MEASURED_STEPS = 3  # steps timed after the first before the bar shows an ETA


class StepEta:
    """Time left, from the learner's own clock (`compute/wall_s`) over the steps seen since the first:
    the start-up before it (engines, the first evaluation) is not a step's time. None until
    MIN_MEASURED_STEPS steps are measured."""

    def __init__(self):
        self.first: tuple[int, float] | None = None  # (step, learner wall s) of the first step seen
        self.last: tuple[int, float] | None = None

    def observe(self, step: int, wall_s: float) -> None:
        self.first = self.first or (step, wall_s)
        self.last = (step, wall_s)

    def remaining_s(self, max_steps: int) -> float | None:
        if self.first is None or self.last[0] - self.first[0] < MIN_MEASURED_STEPS:
            return None
        s_per_step = (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])
        return max(max_steps - self.last[0], 0) * s_per_step


def eta_text(remaining_s: float | None) -> str:
    """'eta 0:01:23', or 'eta measuring' before enough steps are timed."""
    if remaining_s is None:
        return "eta measuring"
    minutes, seconds = divmod(round(remaining_s), 60)
    return f"eta {minutes // 60}:{minutes % 60:02d}:{seconds:02d}"


def _advance(bar, eta: StepEta, metrics_path: Path, offset: int) -> int:
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
                show_step(bar, eta, m)
    return offset


class NoticeFollower:
    """The learner's notices (run_dir/notices.log: a setting that makes it refuse rollouts, a ratio that
    drifts) on the console as they are written, each once; a resumed run's earlier ones are not shown again."""

    def __init__(self, run_dir: Path, write: Callable[[str], None]):
        self.path, self.write = run_dir / NOTICES_FILE, write
        self.offset = self.path.stat().st_size if self.path.exists() else 0  # a resumed run's were shown

    def advance(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith(b"\n"):  # the learner is still writing it
                    break
                self.offset += len(line)
                self.write(f"[learner] {line.decode(errors='replace').rstrip()}")


class RolloutFollower:
    """The learner's rollout tables (run_dir/rollouts.jsonl, one line per table) as they are written:
    the first `rows` rollouts of each, truncated, through `write` (the bar's, so the bar stays whole).
    A resumed run's file starts with the tables already shown: those are skipped."""

    def __init__(self, run_dir: Path, rows: int, write: Callable[[str], None]):
        self.path, self.rows, self.write = run_dir / ROLLOUTS_FILE, rows, write
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def advance(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith("\n"):  # the learner is still writing it
                    break
                self.offset += len(line.encode())
                for row in json.loads(line)["rows"][: self.rows]:
                    self.write(rollout_text(row))


def show_step(bar, eta: StepEta, m: dict) -> None:
    """One training step's record on the bar: the step, its reward and throughput (over the recent
    steps, from the second on), the measured ETA."""
    eta.observe(int(m["step"]), m["compute/wall_s"])
    gen = m.get("rollout/gen_tokens_per_s")
    bar.set_postfix_str(
        f"reward={m['rollout/reward']:.2f}, gen_tok_s={'n/a' if gen is None else f'{gen:.0f}'}, "
        f"learn_tok_s={m['learner/tokens_per_s']:.0f}, {eta_text(eta.remaining_s(bar.total))}",
        refresh=False,
    )  # drawn once, by the update
    bar.update(int(m["step"]) - bar.n)


def print_summary(run_dir: Path, wall_s: float) -> None:
    """The run's outcome; its one wall time is the whole `tidal run`, start-up and shutdown included."""
    s = json.loads((run_dir / "summary.json").read_text())
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"val pass rate: {fmt(s['val_pass_rate_initial'])} -> {fmt(s['val_pass_rate_final'])}")
    print(f"steps: {s['steps']}  samples: {s['samples']}  generated tokens: {s['gen_tokens']}")
    print(f"wall time: {wall_s:.1f} s (tidal run from start to end, start-up included)")
    if s.get("stopped_early"):
        print(f"stopped early: {s['stopped_early']}")
    print_failures(s.get("episode_failures") or {}, s.get("samples") or 0)
    print(f"mlflow run id: {s['mlflow_run_id']}  tracking uri: {s['mlflow_uri']}")
    for line in mlflow_ui_lines(s["mlflow_uri"], run_dir):
        print(line)
    print(f"run directory: {run_dir}")


def print_failures(failures: dict, samples: int) -> None:
    """Training episodes whose reward or environment raised (each scored 0), with the most frequent
    reasons as the actor recorded them: the function and the user's file and line."""
    if not failures.get("count"):
        return
    print(
        f"failed episodes: {failures['count']} of {samples} training samples were scored 0 because their "
        "reward or environment raised; most frequent:"
    )
    for reason, times in failures["reasons"]:
        print(f"  {times} x " + reason.replace("\n", "\n    "))


def check_run_dir(run_dir: Path, resume: str | None, overwrite: bool) -> bool:
    """Whether a run may start in `run_dir`: one it holds already is continued (--resume), deleted first
    (--overwrite), or refused in one line, so that two runs never mix their metrics, checkpoints and model."""
    marks = run_marks(run_dir)
    if resume and overwrite:
        print("tidal run: --resume continues the run in run_dir and --overwrite deletes it: give one", file=sys.stderr)
        return False
    if not marks or resume:
        return True
    if not overwrite:
        print(f"tidal run: {used_run_dir(run_dir, marks)}", file=sys.stderr)
        return False
    if "config.yaml" not in marks:  # tidal writes it first: a folder without it may hold the user's own files
        print(
            f"tidal run: --overwrite deletes only a folder tidal made (with its config.yaml): {run_dir} has "
            f"none; choose another run_dir",
            file=sys.stderr,
        )
        return False
    return True  # deleted by `overwrite_run_dir` once every check has passed


def overwrite_run_dir(run_dir: Path) -> None:
    """--overwrite, after the checks: a run that cannot start leaves the old one in place."""
    if run_marks(run_dir):
        print(f"[run] --overwrite: deleting the run in {run_dir}", flush=True)
        shutil.rmtree(run_dir)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def launch(cfg: RunConfig, resume: str | None = None, print_samples: int = 0, overwrite: bool = False) -> int:
    """The whole run on this machine; `print_samples` rollouts of each rollout table (every
    tracking.rollout_table_every steps) are shown on the console; `overwrite` deletes the run a given
    run_dir holds first. Returns the exit code."""
    # Ctrl-C and SIGTERM both stop every child cleanly, even where SIGINT was inherited as ignored
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    start = time.monotonic()
    if resume and not cfg.run_dir:
        print("tidal run: --resume needs run_dir=<the run's folder>", file=sys.stderr)
        return 2
    if cfg.run_dir and not check_run_dir(Path(cfg.run_dir), resume, overwrite):
        return 2
    if cfg.broker.type is BrokerType.zmq and cfg.broker.zmq.curve == "off":
        print(
            "tidal run: broker.zmq.curve=off: a run authenticates every actor, with keys it makes itself "
            "(off is for a role started on its own)",
            file=sys.stderr,
        )
        return 2
    if print_samples and not (cfg.tracking.rollout_table_every and cfg.tracking.rollout_table_rows):
        print(
            "tidal run: --print-samples shows rollouts of the rollout tables, and tracking.rollout_table_every=0 "
            "or tracking.rollout_table_rows=0 turns them off: no rollouts will be shown",
            file=sys.stderr,
        )
    preflight(cfg)  # a bad dataset, model or tokenizer stops here, before anything is created
    check_reachable(cfg)  # so does a fixed port in use, or a tracking server that does not answer
    if overwrite and cfg.run_dir:
        overwrite_run_dir(Path(cfg.run_dir))
    try:
        placement = place(cfg.learner, cfg.actor, visible_gpus(), sorted(os.sched_getaffinity(0)))
        check_gpus(cfg, visible_gpus())  # each GPU's and host's memory: a layout that cannot fit stops here
    except PlacementError as err:
        print(f"tidal run: {err}", file=sys.stderr)
        return 2
    children: list[Child] = []
    try:
        cfg = resolve(cfg)  # the run directory first: an embedded redis-server keeps its data there
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        redis_url = None
        if cfg.broker.type is BrokerType.redis and cfg.broker.redis.embedded:
            redis, redis_url = start_redis(cfg, run_dir)
            children.append(redis)
        cfg = prepare(with_run_keys(cfg), redis_url)
        print(f"[run] {run_dir}: learner + {cfg.actor.replicas} actor(s)", flush=True)
        start_children(cfg, placement, children, resume)
        supervise(children, run_dir, cfg, print_samples)
    except LaunchError as err:
        print(f"tidal run failed: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tidal run: interrupted, stopping all processes", file=sys.stderr)
        return 130
    finally:
        stop_children(children)
        sweep_orphan_shm()  # what an actor killed for good (out of restarts) left behind
        if children:
            log_final_logs(Path(cfg.run_dir))
    print_summary(run_dir, time.monotonic() - start)
    return 0
