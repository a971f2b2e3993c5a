"""`tidal learner CONFIG [key=value ...]`: the coordinator and the training loop."""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import uuid
from functools import partial
from pathlib import Path

from tidal.config import LearnerConfig, RunConfig

log = logging.getLogger("tidal.learner")


def setup_trainer(cfg: RunConfig, checkpoint: Path | None = None, fresh_if_damaged: bool = False):
    """What every learner rank builds alike: the accelerator, the trainer around the policy, the
    checkpointer (saving is collective). Returns (accelerator, trainer, checkpointer, checkpoint):
    the checkpoint to continue from is rank 0's `checkpoint` on every rank, or the newest older one
    that verifies; none verifying raises NoValidCheckpoint unless rank 0 is told `fresh_if_damaged`."""
    import torch

    from tidal.config import compute_dtype
    from tidal.learner.checkpoint import Checkpointer
    from tidal.learner.resume import check_resume_state
    from tidal.learner.trainer import Trainer, load_policy

    lc = cfg.learner
    torch.set_num_threads(lc.torch_threads)
    torch.manual_seed(lc.seed)
    accelerator = build_accelerator(lc)
    # sharded, every rank builds the policy empty and reads only its own shards of the weights
    policy = load_policy(cfg.model.path, lc.param_dtype, lc.attention, compute_dtype(lc), empty=lc.fsdp.enabled)
    trainer = Trainer(lc, policy, accelerator, cfg.sampling.temperature, cfg.model.head, cfg.model.dtype,
                      model_path=cfg.model.path if lc.fsdp.enabled else None)
    checkpointer = Checkpointer(cfg.checkpoint, Path(cfg.run_dir) / "checkpoints", accelerator, trainer)
    return accelerator, trainer, checkpointer, checkpointer.agree(checkpoint, fresh_if_damaged, check_resume_state)


def build_accelerator(cfg: LearnerConfig):
    """Accelerate, with the learner ranks' process group waiting learner.dist_timeout_s in a collective
    (rank 0 may spend that long on rollouts, the final evaluation or a checkpoint), and, where a
    sharded learner offloads to host memory on GPUs, a CPU backend beside NCCL for its CPU tensors."""
    import datetime

    import torch
    from accelerate import Accelerator, InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    group = {"timeout": datetime.timedelta(seconds=cfg.dist_timeout_s)}
    if cuda and cfg.fsdp.enabled and cfg.fsdp.cpu_offload:
        group["backend"] = "cuda:nccl,cpu:gloo"
    return Accelerator(cpu=not cuda, mixed_precision=cfg.mixed_precision,
                       kwargs_handlers=[InitProcessGroupKwargs(**group)])


def build(cfg: RunConfig, checkpoint: Path | None = None, transport=None, fresh_if_damaged: bool = False):
    """Every part of rank 0's learner; with `checkpoint`, restored to continue from it (or the newest
    older one that verifies: `setup_trainer`). `transport` replaces the one `broker.type` names (the
    in-process one, with actors in this process)."""
    from transformers import AutoTokenizer

    from tidal.broker.factory import learner_transport
    from tidal.broker.weights import build_publisher
    from tidal.learner.admission import Admission
    from tidal.learner.checkpoint import read_state
    from tidal.learner.coordinator import Coordinator
    from tidal.learner.diagnostics import Diagnostics
    from tidal.learner.export import FinalExport
    from tidal.learner.groups import GroupBook
    from tidal.learner.ledger import Ledger
    from tidal.learner.loop import Learner, LearnerParts
    from tidal.learner.ranks import BatchBroadcast, WeightPush
    from tidal.learner.tracking import Tracker
    from tidal.learner.validation import Validator
    from tidal.tasks import PromptEncoder, get_task

    run_dir = Path(cfg.run_dir)
    write_config(cfg, run_dir)
    accelerator, trainer, checkpointer, checkpoint = setup_trainer(cfg, checkpoint, fresh_if_damaged)
    state = read_state(checkpoint) if checkpoint else None
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    split = get_task(cfg.task.name).load_prompts(cfg.task)
    transport = transport or learner_transport(cfg.broker, cfg.name, fresh=state is None)
    plan = dispatch_plan(cfg, tokenizer)
    plan.sampling.check()  # the interruption text's token count is known only now: does it fit max_tokens?
    ledger_offset = state["coordinator"]["ledger_offset"] if state else 0  # the ledger describes the live lineage
    book = GroupBook(Ledger(run_dir / "ledger.jsonl", truncate_to=ledger_offset))
    encode = PromptEncoder.for_task(tokenizer, cfg.task, cfg.env.kwargs)
    coordinator = Coordinator(plan, split.train, split.val, encode, transport, book, cfg.curriculum,
                              cfg.task.pass_threshold)
    tracker = Tracker(cfg.tracking, run_dir, cfg.name, resume_run_id=state["mlflow_run_id"] if state else None)
    parts = LearnerParts(
        trainer=trainer, coordinator=coordinator, book=book, transport=transport, tracker=tracker,
        admission=Admission(cfg.staleness, cfg.learner.zero_variance_filter, book, coordinator.on_rewards,
                            cfg.task.pass_threshold, cfg.task.pass_on),
        publisher=build_publisher(cfg.weights, uuid.uuid4().hex[:12], cfg.name, cfg.run_dir, cfg.model.dtype),
        checkpointer=checkpointer, ranks=BatchBroadcast(accelerator), push=WeightPush.of(cfg),
        validator=Validator(trainer.policy.config.vocab_size, cfg.sampling.max_tokens, cfg.task.reward_range),
        export=FinalExport(cfg.model.path, run_dir / "model", cfg.model.dtype,
                           tracker if cfg.tracking.log_model else None),
        diagnostics=Diagnostics(tracker, lambda ids: tokenizer.decode(ids.tolist()), run_dir,
                                cfg.tracking.eval_completions, cfg.staleness.max_lag,
                                pass_threshold=cfg.task.pass_threshold, pass_on=cfg.task.pass_on,
                                rollout_table_every=cfg.tracking.rollout_table_every,
                                rollout_table_rows=cfg.tracking.rollout_table_rows),
        num_actors=cfg.actor.replicas)
    learner = Learner(cfg.learner, cfg.eval, parts)
    if state is None:
        tracker.log_config(cfg, split)
    else:
        restore(learner, checkpointer.load(checkpoint), cfg)
    return learner


def dispatch_plan(cfg: RunConfig, tokenizer):
    """How the coordinator turns prompts into groups; length control travels in each group's
    SamplingParams, and eval groups get no overlong penalty (nor interruptions unless asked)."""
    from tidal.broker.schema import InterruptParams, SamplingParams
    from tidal.learner.coordinator import DispatchPlan
    from tidal.tasks import encode_prompt

    stop_ids = (tokenizer.eos_token_id,)
    it = cfg.sampling.interrupt
    interrupt = InterruptParams(tuple(encode_prompt(tokenizer, it.text)), it.text, it.min_tokens, it.max_tokens,
                                it.answer_tokens) if it.enabled else None
    overlong = cfg.sampling.overlong.buffer_tokens if cfg.sampling.overlong.enabled else 0
    return DispatchPlan(
        run_id=f"{cfg.name}-{Path(cfg.run_dir).name}", task=cfg.task.name, n=cfg.sampling.n,
        sampling=SamplingParams(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.max_tokens, stop_ids,
                                interrupt, overlong),
        eval_n=cfg.eval.n, eval_sampling=SamplingParams(cfg.eval.temperature, 1.0, cfg.sampling.max_tokens, stop_ids,
                                                        interrupt if it.eval else None),
        groups_per_step=cfg.learner.groups_per_step, max_lag=cfg.staleness.max_lag, seed=cfg.learner.seed)


def restore(learner, state: dict, cfg: RunConfig) -> None:
    learner.restore(state)
    learner.parts.tracker.log_resumed_config(cfg, state["version"])
    # On ZeroMQ what was in flight died with the old processes. On Redis it is usually still
    # queued, but groups released just before the crash may never have reached it: send them all
    # again, and the learner keeps whichever copy comes first. What the dead process released after
    # the checkpoint is withdrawn: it asks for versions this learner has yet to reach again.
    count = learner.coordinator.resubmit_outstanding()
    log.info("re-dispatched %d prompt groups that were outstanding at the checkpoint", count)
    log.info("resumed at version %d from the checkpoint (MLflow run %s)", state["version"], state["mlflow_run_id"])


def write_config(cfg: RunConfig, run_dir: Path) -> None:
    """The resolved config in the run directory (what `tidal run` writes too), for resumes and `tidal export`."""
    from tidal.config import to_yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(to_yaml(cfg))
    tmp.replace(run_dir / "config.yaml")  # atomic: actors may be reading it


def write_endpoints(run_dir: Path, ports: dict[str, int]) -> None:
    """Tell the launcher (and any actor started by hand) where the learner listens; atomic."""
    tmp = run_dir / "endpoints.json.tmp"
    tmp.write_text(json.dumps(ports))
    tmp.replace(run_dir / "endpoints.json")


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through main's handlers, so the MLflow run is closed


class MissingCheckpoint(FileNotFoundError):
    """`--resume` (required) where the run has no checkpoint."""


def find_checkpoint(run_dir: Path, resume: str | None) -> Path | None:
    """The newest finished checkpoint to continue from (its hashes are checked once, by every rank for
    its own part, when the ranks agree on it): None for a fresh start. `resume`: None starts fresh;
    "required" needs a checkpoint; "auto" starts fresh only where there is none at all (a pod on a
    new volume); "fresh" also starts over checkpoints that are all damaged, setting them aside. Raises
    MissingCheckpoint (none, where one is required) or NoValidCheckpoint (all damaged, naming each)."""
    from tidal.learner.checkpoint import NoValidCheckpoint, folders, set_aside, survey

    if resume is None:
        return None
    directory = run_dir / "checkpoints"
    found, damage = survey(directory)
    if found:
        return found[0]
    if damage and resume != "fresh":
        raise NoValidCheckpoint(directory, damage)
    if resume == "required":
        raise MissingCheckpoint(f"--resume: no finished checkpoint in {directory} "
                                "(set run_dir to the run to continue, or use --resume auto)")
    if damage:
        moved = set_aside(directory, [p.name for p in folders(directory)])
        log.warning("--resume fresh: every checkpoint in %s is damaged; set aside as %s, starting at step 0 with "
                    "empty broker streams and ledger", directory, ", ".join(p.name for p in moved))
    else:
        log.info("--resume %s: no checkpoint in %s, starting fresh", resume, directory)
    return None


def main(cfg: RunConfig, resume: str | None = None) -> int:
    from tidal.config import resolve
    from tidal.learner.warmstart import build_tiny
    from tidal.models import resolve_model_path

    if cfg.learner.num_ranks > 1 and "RANK" not in os.environ:
        return start_ranks(cfg.learner)
    rank = int(os.environ.get("RANK", "0"))
    # rank 0 builds the tiny model if it is missing; under torchrun the others find it (the launcher built it)
    builder = partial(build_tiny, progress=log.info) if rank == 0 else None
    cfg = resolve(cfg, model_path=resolve_model_path(cfg.model, cfg.task, builder))
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from tidal.learner.checkpoint import NoValidCheckpoint

    try:  # a run that must not start (no checkpoint where one is required, or none that verifies): exit 2
        if rank > 0:  # under torchrun: only rank 0 talks to actors and MLflow, and picks the checkpoint
            from tidal.learner.ranks import follow

            return leave_group(follow(cfg))
        learner = build(cfg, find_checkpoint(run_dir, resume), fresh_if_damaged=resume == "fresh")
    except (MissingCheckpoint, NoValidCheckpoint) as err:
        print(f"tidal learner: {err}", file=sys.stderr)
        return 2
    return leave_group(serve(learner, run_dir))


def leave_group(rc: int) -> int:
    """A finished rank leaves its training process group before the interpreter ends: gloo's threads
    outlive Python's teardown otherwise, and the process can abort (SIGABRT) after a run that succeeded.
    Only on success, as `serve` and `follow` return: after a failure a peer may still be inside a
    collective."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return rc


def start_ranks(cfg: LearnerConfig) -> int:
    """`tidal learner` with learner.num_ranks > 1, not under torchrun yet: becomes torchrun, which starts
    this machine's ranks with the same arguments (on several machines, one such command on each). An
    exec, so signals meant for the learner (a pod's SIGTERM) reach torchrun, which passes them on."""
    per_node = cfg.num_ranks // cfg.nodes
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={cfg.nodes}", f"--node-rank={cfg.node_rank}",
           f"--nproc-per-node={per_node}", f"--master-addr={cfg.master_addr or '127.0.0.1'}",
           f"--master-port={cfg.master_port}", "-m", "tidal", *sys.argv[1:]]
    log.info("starting %d of %d learner ranks on node %d: %s", per_node, cfg.num_ranks, cfg.node_rank, " ".join(cmd))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)
    return 1  # not reached


def serve(learner, run_dir: Path) -> int:
    """Run rank 0's loop; the MLflow run ends FINISHED, KILLED or FAILED accordingly."""
    transport, tracker = learner.transport, learner.parts.tracker
    write_endpoints(run_dir, transport.ports)
    try:
        summary = learner.run()  # which told the actors to stop once the final evaluation was in
        time.sleep(0.2)  # let the PUB socket flush the shutdown before closing
    except (KeyboardInterrupt, SystemExit):
        tracker.finish({"error": "learner stopped by a signal"}, status="KILLED")
        raise
    except BaseException:
        tracker.finish({"error": "learner failed; see its log"}, status="FAILED")
        raise
    finally:
        transport.close()
        learner.book.ledger.close()
        learner.parts.publisher.close()
    tracker.finish(summary)
    log.info("val pass rate: %s -> %s", summary["val_pass_rate_initial"], summary["val_pass_rate_final"])
    return 0
