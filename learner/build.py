"""Building a learner rank: the trainer every rank builds alike, the checkpoint the ranks continue
from, and rank 0's parts around them, returned typed; `main` picks which rank to build and runs it.

    build_rank: setup_trainer (the ranks agree on a checkpoint) ─► the rank's role ─► StepRunner.restore
        rank 0 (build):         build_learner: transport, coordinator, tracker, weight channel, ... ─► Learner
        others (build_follower): Follower

The collectives of set-up run in `build_rank` alone, so they come in one order on every rank.
"""

from __future__ import annotations

import datetime
import logging
import os
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch

from tidal.broker.base import LearnerTransport
from tidal.broker.factory import learner_transport
from tidal.broker.schema import InterruptParams, SamplingParams
from tidal.broker.weights import build_publisher
from tidal.config import LearnerConfig, RunConfig, compute_dtype, write_config
from tidal.health import HealthFile
from tidal.learner.every_rank.checkpoint import Checkpointer, NoValidCheckpoint, folders, read_state, set_aside, survey
from tidal.learner.every_rank.ranks import RankGroup, WeightPush
from tidal.learner.every_rank.trainer import Sampler, Trainer, load_policy, policy_dtype
from tidal.learner.rank0.admission import Admission
from tidal.learner.rank0.coordinator import Coordinator, DispatchPlan
from tidal.learner.rank0.diagnostics import Diagnostics
from tidal.learner.rank0.drift import likely_causes
from tidal.learner.rank0.flow import serve_metrics
from tidal.learner.rank0.groups import GroupBook
from tidal.learner.rank0.ledger import Ledger
from tidal.learner.rank0.loop import Learner, LearnerParts
from tidal.learner.rank0.refusals import RefusalWatch
from tidal.learner.rank0.resume import check_resume_state
from tidal.learner.rank0.tracking import Tracker
from tidal.learner.rank0.validation import Validator
from tidal.learner.steps import Follower, Role, StepRunner
from tidal.learner.tools.export import FinalExport
from tidal.tasks import PromptEncoder, encode_prompt, get_task

if TYPE_CHECKING:  # imported where used: transformers and accelerate take seconds to import
    from accelerate import Accelerator
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("tidal.learner")

R = TypeVar("R", bound=Role)


class TrainerSetup(NamedTuple):
    """What every learner rank builds alike."""

    accelerator: Accelerator
    trainer: Trainer
    checkpointer: Checkpointer  # saving is collective: every rank has one
    checkpoint: Path | None  # the checkpoint every rank continues from (None: a fresh start)


def build_rank(
    cfg: RunConfig,
    build_role: Callable[[TrainerSetup], R],
    checkpoint: Path | None = None,
    fresh_if_damaged: bool = False,
) -> tuple[R, dict | None]:
    """A rank's role, restored: the trainer and the checkpoint the ranks agree on (rank 0's `checkpoint`,
    `setup_trainer`), then `build_role` (no collective), then the restore. Returns the role and the
    checkpoint's tidal state (None: a fresh start)."""
    setup = setup_trainer(cfg, checkpoint, fresh_if_damaged)
    role = build_role(setup)
    return role, role.steps.restore(setup.checkpoint)


def build(
    cfg: RunConfig,
    checkpoint: Path | None = None,
    transport: LearnerTransport | None = None,
    fresh_if_damaged: bool = False,
) -> Learner:
    """Every part of rank 0's learner; with `checkpoint`, restored to continue from it (or the newest
    older one that verifies: `setup_trainer`). `transport` replaces the one `broker.type` names (the
    in-process one, with actors in this process)."""
    learner, state = build_rank(cfg, partial(build_learner, cfg, transport=transport), checkpoint, fresh_if_damaged)
    if state is not None:
        resume(learner, state, cfg)
    learner.metrics = serve_metrics(learner, cfg.tracking, cfg.name)
    return learner


def build_follower(cfg: RunConfig) -> Follower:
    """A rank other than 0: the same trainer and checkpoints, batches from rank 0, nothing else. Rank 0
    chooses the checkpoint to continue from and sends it: this rank reads no file of the run."""

    def follower(setup: TrainerSetup) -> Follower:
        steps = StepRunner(
            setup.trainer,
            setup.checkpointer,
            RankGroup(setup.accelerator),
            WeightPush.of(cfg),
            None,
            cfg.learner.max_steps,
        )
        return Follower(steps, HealthFile(cfg.learner.health_file, every_s=0.0))

    return build_rank(cfg, follower)[0]


def setup_trainer(cfg: RunConfig, checkpoint: Path | None = None, fresh_if_damaged: bool = False) -> TrainerSetup:
    """What every learner rank builds alike: the accelerator, the trainer around the policy, the
    checkpointer, and the checkpoint to continue from: rank 0's `checkpoint` on every rank, or the
    newest older one that verifies; none verifying raises NoValidCheckpoint unless rank 0 is told
    `fresh_if_damaged`."""
    lc = cfg.learner
    torch.set_num_threads(learner_threads(lc))
    torch.manual_seed(lc.seed)
    accelerator = build_accelerator(lc)
    # sharded, every rank builds the policy empty and reads only its own shards of the weights
    policy = load_policy(cfg.model.path, policy_dtype(lc), lc.attention, compute_dtype(lc), empty=lc.fsdp.enabled)
    sampler = Sampler(cfg.sampling.temperature, cfg.sampling.top_k, cfg.sampling.top_p)
    trainer = Trainer(
        lc,
        policy,
        accelerator,
        sampler,
        cfg.model.head,
        cfg.model.dtype,
        model_path=cfg.model.path if lc.fsdp.enabled else None,
    )
    checkpointer = Checkpointer(cfg.checkpoint, Path(cfg.run_dir) / "checkpoints", accelerator, trainer)
    return TrainerSetup(
        accelerator, trainer, checkpointer, checkpointer.agree(checkpoint, fresh_if_damaged, check_resume_state)
    )


def learner_threads(lc: LearnerConfig, cores: int | None = None, local_ranks: int | None = None) -> int:
    """learner.torch_threads, or for 0: one thread, except where a sharded learner offloads to host
    memory and its optimizer step runs on the CPU: one thread there made an optimizer step at 32B take
    minutes. `cores` (this process's CPU affinity) are then shared among the node's ranks (torchrun's
    LOCAL_WORLD_SIZE)."""
    if lc.torch_threads:
        return lc.torch_threads
    if not (lc.fsdp.enabled and lc.fsdp.cpu_offload):
        return 1
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    local_ranks = local_ranks if local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // max(local_ranks, 1))


def build_accelerator(cfg: LearnerConfig) -> Accelerator:
    """Accelerate, with the learner ranks' process group waiting learner.dist_timeout_s in a collective
    (rank 0 may spend that long on rollouts, the final evaluation or a checkpoint), and, where a
    sharded learner offloads to host memory on GPUs, a CPU backend beside NCCL for its CPU tensors."""
    from accelerate import Accelerator, InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    group = {"timeout": datetime.timedelta(seconds=cfg.dist_timeout_s)}
    if cuda and cfg.fsdp.enabled and cfg.fsdp.cpu_offload:
        group["backend"] = "cuda:nccl,cpu:gloo"
    return Accelerator(
        cpu=not cuda, mixed_precision=cfg.mixed_precision, kwargs_handlers=[InitProcessGroupKwargs(**group)]
    )


def build_learner(cfg: RunConfig, setup: TrainerSetup, transport: LearnerTransport | None = None) -> Learner:
    """Rank 0's parts around the trainer (no collective): the transport, the coordinator and its
    dispatch plan, the tracker, the weight channel, the checks and the diagnostics."""
    from transformers import AutoTokenizer

    run_dir = Path(cfg.run_dir)
    write_config(cfg, run_dir)
    state = read_state(setup.checkpoint) if setup.checkpoint else None
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    split = get_task(cfg.task.name).load_prompts(cfg.task)
    transport = transport or learner_transport(cfg.broker, cfg.name, fresh=state is None)
    plan = dispatch_plan(cfg, tokenizer)
    plan.sampling.check()  # the interruption text's token count is known only now: does it fit max_tokens?
    ledger_offset = state["coordinator"]["ledger_offset"] if state else 0  # the ledger describes the live lineage
    book = GroupBook(Ledger(run_dir / "ledger.jsonl", truncate_to=ledger_offset))
    encode = PromptEncoder.for_task(tokenizer, cfg.task, cfg.env.kwargs)
    coordinator = Coordinator(
        plan, split.train, split.val, encode, transport, book, cfg.curriculum, cfg.task.pass_threshold
    )
    tracker = Tracker(cfg.tracking, run_dir, cfg.name, resume_run_id=state["mlflow_run_id"] if state else None)
    trainer = setup.trainer
    parts = LearnerParts(
        trainer=trainer,
        coordinator=coordinator,
        book=book,
        transport=transport,
        tracker=tracker,
        admission=Admission(
            cfg.staleness,
            cfg.learner.zero_variance_filter,
            book,
            coordinator.on_rewards,
            cfg.task.pass_threshold,
            cfg.task.pass_on,
        ),
        publisher=build_publisher(cfg.weights, uuid.uuid4().hex[:12], cfg.name, cfg.run_dir, cfg.model.dtype),
        checkpointer=setup.checkpointer,
        ranks=RankGroup(setup.accelerator),
        push=WeightPush.of(cfg),
        validator=Validator(
            trainer.policy.config.vocab_size,
            cfg.sampling.max_tokens,
            cfg.task.reward_range,
            watch=RefusalWatch(
                cfg.learner.groups_per_step, cfg.learner.refusal_patience_steps, transport.bar, transport.actors
            ),
        ),
        export=FinalExport(
            cfg.model.path,
            run_dir / "model",
            cfg.model.dtype,
            tracker if cfg.tracking.log_model else None,
            cfg.learner.lora,
        ),
        diagnostics=Diagnostics(
            tracker,
            lambda ids: tokenizer.decode(ids.tolist()),
            run_dir,
            cfg.tracking.eval_completions,
            cfg.staleness.max_lag,
            pass_threshold=cfg.task.pass_threshold,
            pass_on=cfg.task.pass_on,
            rollout_table_every=cfg.tracking.rollout_table_every,
            rollout_table_rows=cfg.tracking.rollout_table_rows,
        ),
        num_actors=cfg.actor.replicas,
        drift_causes=tuple(likely_causes(cfg)),
    )
    learner = Learner(cfg.learner, cfg.eval, parts)
    if state is None:
        tracker.log_config(cfg, split)
    return learner


def dispatch_plan(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> DispatchPlan:
    """How the coordinator turns prompts into groups; length control travels in each group's
    SamplingParams, and eval groups get no overlong penalty (nor interruptions unless asked)."""
    stop_ids = (tokenizer.eos_token_id,)
    it = cfg.sampling.interrupt
    interrupt = (
        InterruptParams(
            tuple(encode_prompt(tokenizer, it.text)), it.text, it.min_tokens, it.max_tokens, it.answer_tokens
        )
        if it.enabled
        else None
    )
    overlong = cfg.sampling.overlong.buffer_tokens if cfg.sampling.overlong.enabled else 0
    return DispatchPlan(
        run_id=f"{cfg.name}-{Path(cfg.run_dir).name}",
        task=cfg.task.name,
        n=cfg.sampling.n,
        sampling=SamplingParams(
            cfg.sampling.temperature,
            cfg.sampling.top_p,
            cfg.sampling.max_tokens,
            stop_ids,
            interrupt,
            overlong,
            cfg.sampling.top_k,
        ),
        eval_n=cfg.eval.n,
        eval_sampling=SamplingParams(
            cfg.eval.temperature, 1.0, cfg.sampling.max_tokens, stop_ids, interrupt if it.eval else None
        ),
        groups_per_step=cfg.learner.groups_per_step,
        max_lag=cfg.staleness.max_lag,
        seed=cfg.learner.seed,
    )


def resume(learner: Learner, state: dict, cfg: RunConfig) -> None:
    """Rank 0 continues from a restored checkpoint's tidal state."""
    learner.restore(state)
    learner.parts.tracker.log_resumed_config(cfg, state["version"])
    # On ZeroMQ what was in flight died with the old processes. On Redis it is usually still
    # queued, but groups released just before the crash may never have reached it: send them all
    # again, and the learner keeps whichever copy comes first. What the dead process released after
    # the checkpoint is withdrawn: it asks for versions this learner has yet to reach again.
    count = learner.coordinator.resubmit_outstanding()
    log.info("re-dispatched %d prompt groups that were outstanding at the checkpoint", count)
    log.info("resumed at version %d from the checkpoint (MLflow run %s)", state["version"], state["mlflow_run_id"])


class MissingCheckpoint(FileNotFoundError):
    """`--resume` (required) where the run has no checkpoint."""


def find_checkpoint(run_dir: Path, resume: str | None) -> Path | None:
    """The newest finished checkpoint to continue from (its hashes are checked once, by every rank for
    its own part, when the ranks agree on it): None for a fresh start. `resume`: None starts fresh;
    "required" needs a checkpoint; "auto" starts fresh only where there is none at all (a pod on a
    new volume); "fresh" also starts over checkpoints that are all damaged, setting them aside. Raises
    MissingCheckpoint (none, where one is required) or NoValidCheckpoint (all damaged, naming each)."""
    if resume is None:
        return None
    directory = run_dir / "checkpoints"
    found, damage = survey(directory)
    if found:
        return found[0]
    if damage and resume != "fresh":
        raise NoValidCheckpoint(directory, damage)
    if resume == "required":
        raise MissingCheckpoint(
            f"--resume: no finished checkpoint in {directory} "
            "(set run_dir to the run to continue, or use --resume auto)"
        )
    if damage:
        moved = set_aside(directory, [p.name for p in folders(directory)])
        log.warning(
            "--resume fresh: every checkpoint in %s is damaged; set aside as %s, starting at step 0 with "
            "empty broker streams and ledger",
            directory,
            ", ".join(p.name for p in moved),
        )
    else:
        log.info("--resume %s: no checkpoint in %s, starting fresh", resume, directory)
    return None
