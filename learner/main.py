"""`tidal learner CONFIG [key=value ...]`: build this rank (build.py) and run it; rank 0 serves the
actors, the others follow it step by step."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch.distributed as dist

from tidal.broker.zmq_keys import ForeignKeys, own_keys
from tidal.config import BrokerType, LearnerConfig, RunConfig, resolve
from tidal.files import run_marks, used_run_dir
from tidal.learner.build import MissingCheckpoint, build, build_follower, find_checkpoint
from tidal.learner.every_rank.checkpoint import NoValidCheckpoint
from tidal.learner.rank0 import notices
from tidal.learner.rank0.admission import EpisodesFailing
from tidal.learner.rank0.loop import Learner
from tidal.learner.rank0.refusals import RolloutsRefused
from tidal.learner.tools.warmstart import build_tiny
from tidal.models import resolve_model_path

log = logging.getLogger("tidal.learner")


def main(cfg: RunConfig, resume: str | None = None) -> int:
    if cfg.learner.num_ranks > 1 and "RANK" not in os.environ:
        return start_ranks(cfg.learner)
    rank = int(os.environ.get("RANK", "0"))
    marks = [m for m in run_marks(Path(cfg.run_dir)) if m != "config.yaml"] if cfg.run_dir else []
    if rank == 0 and marks and not resume:  # (`tidal run` writes the config first; the other ranks start with 0)
        print(f"tidal learner: {used_run_dir(Path(cfg.run_dir).resolve(), marks, overwrite=False)}", file=sys.stderr)
        return 2
    # rank 0 builds the tiny model if it is missing; under torchrun the others find it (the launcher built it)
    builder = partial(build_tiny, progress=log.info) if rank == 0 else None
    cfg = resolve(cfg, model_path=resolve_model_path(cfg.model, cfg.task, builder))
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:  # a run that must not start (no checkpoint where one is required, or none that verifies): exit 2
        if rank > 0:  # under torchrun: only rank 0 talks to actors and MLflow, and picks the checkpoint
            return leave_group(build_follower(cfg).run())
        notices.attach(run_dir)
        cfg = with_own_keys(cfg)
        learner = build(cfg, find_checkpoint(run_dir, resume), fresh_if_damaged=resume == "fresh")
    except (MissingCheckpoint, NoValidCheckpoint, ForeignKeys) as err:
        print(f"tidal learner: {err}", file=sys.stderr)
        return 2
    return leave_group(serve(learner, run_dir))


def with_own_keys(cfg: RunConfig) -> RunConfig:
    """Started on its own on loopback with no keys named, the learner authenticates its actors all the
    same, with the run's own keys in run_dir/keys (as `tidal run` does), and says where they are."""
    if cfg.broker.type is not BrokerType.zmq:
        return cfg
    z = own_keys(cfg.broker.zmq, cfg.run_dir, "learner", [f"actor-{i}" for i in range(cfg.actor.replicas)])
    if z is cfg.broker.zmq:
        return cfg
    print(
        f"tidal learner: no keys named; CURVE on with this run's own keys in {z.keys_dir} (an actor started on "
        f"its own on this machine: run_dir={cfg.run_dir}; more actors: tidal keys {z.keys_dir} --actors ID)",
        file=sys.stderr,
    )
    return replace(cfg, broker=replace(cfg.broker, zmq=z))


def leave_group(rc: int) -> int:
    """A finished rank leaves its training process group before the interpreter ends: gloo's threads
    outlive Python's teardown otherwise, and the process can abort (SIGABRT) after a run that succeeded.
    Only on success, as `serve` and `Follower.run` return: after a failure a peer may still be inside a
    collective."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return rc


def start_ranks(cfg: LearnerConfig) -> int:
    """`tidal learner` with learner.num_ranks > 1, not under torchrun yet: becomes torchrun, which starts
    this machine's ranks with the same arguments (on several machines, one such command on each). An
    exec, so signals meant for the learner (a pod's SIGTERM) reach torchrun, which passes them on."""
    per_node = cfg.num_ranks // cfg.nodes
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={cfg.nodes}",
        f"--node-rank={cfg.node_rank}",
        f"--nproc-per-node={per_node}",
        f"--master-addr={cfg.master_addr or '127.0.0.1'}",
        f"--master-port={cfg.master_port}",
        "-m",
        "tidal",
        *sys.argv[1:],
    ]
    log.info("starting %d of %d learner ranks on node %d: %s", per_node, cfg.num_ranks, cfg.node_rank, " ".join(cmd))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)
    return 1  # not reached


def serve(learner: Learner, run_dir: Path) -> int:
    """Run rank 0's loop; the MLflow run ends FINISHED, KILLED or FAILED accordingly."""
    transport, tracker = learner.transport, learner.parts.tracker
    write_endpoints(run_dir, transport.ports)
    try:
        summary = learner.run()  # which told the actors to stop once the final evaluation was in
        time.sleep(transport.shutdown_flush_s)  # the actors hear the shutdown before the transport closes
    except (KeyboardInterrupt, SystemExit):
        tracker.finish({"error": "learner stopped by a signal"}, status="KILLED")
        raise
    except (EpisodesFailing, RolloutsRefused) as err:  # the user's reward, environment or setting: no frames of ours
        tracker.finish({"error": str(err)}, status="FAILED")
        log.error("%s", err)
        raise SystemExit(1) from None
    except BaseException:
        tracker.finish({"error": "learner failed; see its log"}, status="FAILED")
        raise
    finally:
        transport.close()
        learner.book.ledger.close()
        learner.parts.publisher.close()
        if learner.metrics is not None:
            learner.metrics.close()
    tracker.finish(summary)
    log.info("val pass rate: %s -> %s", summary["val_pass_rate_initial"], summary["val_pass_rate_final"])
    return 0


def write_endpoints(run_dir: Path, ports: dict[str, int]) -> None:
    """Tell the launcher (and any actor started by hand) where the learner listens; atomic."""
    tmp = run_dir / "endpoints.json.tmp"
    tmp.write_text(json.dumps(ports))
    tmp.replace(run_dir / "endpoints.json")


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through main's handlers, so the MLflow run is closed
