"""The learner's training loop: rank 0's role around the step runner.

        coordinator thread: dataset ─► admission control ─► transport.submit_prompts ─► actors
                                                                                          │
        rollouts (Inbox) ◄────────────────────────────────────────────────────────────────┘
          │ collect: eval groups → Evaluations; claim (GroupBook); admission: staleness, zero variance
          ▼
        StepRunner (steps.py, the same on every rank): exchange → trainer.step (advantages → micro-batches
          │ → fused logprobs → loss → AdamW; v → v+1) → weight push → checkpoint when due
          ▼
        on_trained: diagnostics · announce: the new version to the actors (held while an evaluation is under way) ·
        on_step: coordinator.on_step → eval? → log (+ progress line, rollout table?) · on_saved: commit, figures

`Learner.run` hands itself to the step runner, which calls the named steps below between its
collectives; none of them is collective. A resumed learner starts from a checkpoint's version, and
its metrics reach MLflow exactly once (`MetricsLog`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tidal.broker.base import LearnerTransport
from tidal.broker.schema import RolloutGroup, WeightUpdate
from tidal.broker.weights import WeightPublisher
from tidal.config import EvalConfig, LearnerConfig
from tidal.learner.every_rank.batch import group_advantages
from tidal.learner.every_rank.checkpoint import Checkpointer
from tidal.learner.every_rank.ranks import RankGroup, WeightPush
from tidal.learner.every_rank.trainer import Trainer
from tidal.learner.rank0.accounting import Accounting
from tidal.learner.rank0.admission import Admission, StepBatch
from tidal.learner.rank0.coordinator import Coordinator
from tidal.learner.rank0.curriculum import CurriculumExhausted
from tidal.learner.rank0.diagnostics import Diagnostics
from tidal.learner.rank0.drift import FreshRatioWatch
from tidal.learner.rank0.evaluation import Evaluator, HeldAnnouncements
from tidal.learner.rank0.flow import LearnerFlow
from tidal.learner.rank0.groups import DUPLICATE, NEW, GroupBook
from tidal.learner.rank0.inbox import Inbox
from tidal.learner.rank0.resume import MetricsLog, learner_state, restore_learner_state
from tidal.learner.rank0.tracking import ProgressLog, Tracker
from tidal.learner.rank0.validation import Validator
from tidal.learner.steps import StepRunner
from tidal.learner.tools.export import FinalExport

log = logging.getLogger(__name__)


@dataclass
class LearnerParts:
    """Rank 0's parts, as `build.build_learner` makes them (unit tests fill in fakes for the ones they skip)."""

    trainer: Trainer
    coordinator: Coordinator
    book: GroupBook
    admission: Admission
    transport: LearnerTransport
    publisher: WeightPublisher
    tracker: Tracker
    checkpointer: Checkpointer
    validator: Validator | None = None  # None: rollouts are not checked against what was released
    ranks: RankGroup | None = None  # the learner's ranks (one or several); None in unit tests of parts
    export: FinalExport | None = None  # what happens to the final policy
    diagnostics: Diagnostics | None = None  # completion tables and figures
    push: WeightPush | None = None  # what a weight push gathers (every rank the same)
    num_actors: int = 0  # actors the run starts, named while the learner waits for them (0: not known here)
    drift_causes: tuple[str, ...] = ()  # the run's settings that make actors and learner score apart (drift.py)


class Learner:
    """Rank 0's role: what happens between the step runner's collectives (steps.Role)."""

    def __init__(self, cfg: LearnerConfig, eval_cfg: EvalConfig, parts: LearnerParts):
        self.cfg, self.eval_cfg, self.parts = cfg, eval_cfg, parts
        self.trainer, self.coordinator, self.book = parts.trainer, parts.coordinator, parts.book
        self.transport, self.checkpointer = parts.transport, parts.checkpointer
        self.steps = StepRunner(
            parts.trainer, parts.checkpointer, parts.ranks, parts.push, parts.publisher, cfg.max_steps
        )
        self.accounting = Accounting(self.trainer.num_params, parts.ranks.world if parts.ranks else 1)
        self.metrics_log = MetricsLog(parts.tracker, self.checkpointer.periodic)
        self.fresh_ratio = FreshRatioWatch(list(parts.drift_causes))
        self.flow = LearnerFlow(self.steps.clock)
        self.metrics = None  # the Prometheus endpoint serving `flow`, where tracking.metrics_port asks (build.py)
        # progress lines as often as the tracker's config says; none without a tracker (unit tests of parts)
        every = parts.tracker.log_every_steps if parts.tracker is not None else 0
        self.progress = ProgressLog(every, cfg.max_steps, parts.num_actors)
        self.evaluator = Evaluator(
            self.coordinator,
            self.metrics_log,
            self.accounting,
            self.transport,
            parts.validator,
            parts.diagnostics,
            parts.admission.pass_threshold,
            parts.admission.pass_on,
        )
        self.evals = self.evaluator.evals
        self.held = HeldAnnouncements(self.evaluator, self.announce_now)
        self.inbox = Inbox(
            self.transport,
            self.book.ledger,
            self.accounting,
            cfg.rollout_timeout_s,
            cfg.health_file,
            on_dead_letter=self.on_dead_letter,
        )
        self.resumed: dict | None = None  # the checkpoint state this learner continues from
        self.stopped_early = ""  # why the run ended before learner.max_steps, if it did

    @property
    def version(self) -> int:
        """The policy version: optimizer steps taken (the step runner counts them)."""
        return self.steps.version

    @version.setter
    def version(self, version: int) -> None:
        self.steps.version = version

    def run(self) -> dict:
        self.steps.run(self)
        return self.summary()

    # ---- named steps, in the order the step runner calls them --------------------------------------

    def begin(self) -> None:
        """Evaluate the starting weights (or finish a resumed run's evaluations), release prompts."""
        if self.resumed is None:
            self.held.evaluate()
        else:
            self.metrics_log.heal(self.resumed.get("unlogged", []))
            for version in restore_learner_state(self.resumed["learner"], self.accounting, self.evals):
                if version == self.version:
                    self.held.evaluate()  # lost with the old process; its version is the one resumed
                else:  # its weights are gone: any other version's samples would be logged as its
                    log.warning(
                        "the evaluation at version %d was under way when the run stopped; it is not "
                        "made again (the resumed run serves version %d)",
                        version,
                        self.version,
                    )
        self.coordinator.start()

    def collect(self) -> StepBatch | None:
        """Take rollouts until groups_per_step trainable groups are in hand; None ends the run early."""
        batch = StepBatch()
        self.inbox.restart_clock()
        while len(batch.groups) < self.cfg.groups_per_step:
            try:
                self.coordinator.check()
            except CurriculumExhausted as err:  # nothing left to learn from: end the run, do not fail it
                self.stop_early(str(err))
                return None
            group = self.inbox.next(self.version)
            self.progress.on_receive(group is not None, self.transport.actors)
            if group is not None:
                self.flow.received(group)
            if group is not None and group.is_eval:
                self.on_eval_group(group)
            elif group is not None:
                self.on_training_group(group, batch)
        return batch

    def on_trained(self, batch: StepBatch) -> None:
        self.flow.trained(batch.groups)
        if self.parts.diagnostics is not None:
            self.parts.diagnostics.on_step(batch.groups, self.trainer.last_tokens)
            self.show_rollouts(batch)

    def announce_now(self, update: WeightUpdate) -> None:
        """Tell the actors of `update`, its version kept in the weight channel until another is told: the
        channel's newest `keep` may all be newer while an evaluation holds announcements back, and an actor
        that was away must still find the one it is told to load."""
        if self.parts.publisher is not None:
            self.parts.publisher.retain(update.version)
        self.transport.publish_weights(update)

    def announce(self, update: WeightUpdate | None) -> None:
        if update is None:
            self.transport.publish_weights(update)
        else:
            self.held.announce(update)  # unless an evaluation is under way

    def on_step(self, batch: StepBatch, metrics: dict[str, float]) -> None:
        """The step's groups are trained and its version published: release more, evaluate when due, log."""
        self.coordinator.on_step(self.version, [g.group_id for g in batch.groups])
        if self.eval_cfg.every and self.version % self.eval_cfg.every == 0 and self.version < self.cfg.max_steps:
            self.held.evaluate()
        metrics = self.step_metrics(batch, metrics)
        self.flow.step = metrics
        self.fresh_ratio.observe(metrics, self.version)
        self.metrics_log.log(metrics, step=self.version)
        self.progress.on_step(metrics, self.version)
        if not self.checkpointer.periodic:
            self.transport.commit()  # no resume point to wait for

    def checkpoint_state(self) -> dict:
        return {
            "mlflow_run_id": self.parts.tracker.run_id,
            "coordinator": self.coordinator.state_dict(),
            "learner": learner_state(self.accounting, self.evals),
            "unlogged": self.metrics_log.unlogged,
        }

    def on_saved(self) -> None:
        """Acknowledge to the broker and log to MLflow everything the checkpoint covers."""
        self.transport.commit()
        self.metrics_log.flush()
        if self.parts.diagnostics is not None:
            # the steps this process trained (a resumed one: from its checkpoint on), from what MLflow now holds
            self.parts.diagnostics.draw(self.version, first_step=self.resumed["version"] + 1 if self.resumed else 1)

    def end(self) -> None:
        """Stop releasing, evaluate the final weights, let the actors go (the runner then saves the final
        checkpoint and gathers the final policy)."""
        self.coordinator.stop()
        self.held.evaluate()  # on the final version, once an evaluation under way has ended
        self.inbox.restart_clock()
        while self.evaluator.waiting() or self.held.due:
            group = self.inbox.next(self.version, what="the final evaluation")
            if group is not None and group.is_eval:
                self.on_eval_group(group)
            elif group is not None:
                self.transport.leave_pending(group)  # not trained: a longer resumed run still can
        # only a finished run stops the actors (after a crash or an eviction they wait for the resumed
        # learner); now, so that their engines shut down while the final checkpoint and export are written
        self.transport.shutdown_actors("learner finished")

    def on_exported(self, state: dict[str, torch.Tensor]) -> None:
        if self.parts.export is not None:
            log.info("final policy exported to %s", self.parts.export(self.trainer.policy, state))

    # ---- helpers of the steps --------------------------------------------------------------------

    def on_training_group(self, group: RolloutGroup, batch: StepBatch) -> None:
        """A released group's first copy, if it means what was sent out, goes to admission."""
        verdict = self.book.claim(group.group_id)
        if verdict == DUPLICATE:
            batch.stats["duplicates"] += 1  # redelivered or re-dispatched: trained once already
        if verdict != NEW:
            return
        validator, release = self.parts.validator, self.book.outstanding.get(group.group_id)
        reason = validator and validator.check(group, release, self.version)
        if reason:
            batch.stats["discarded_tokens/refused"] += sum(s.num_tokens for s in group.samples)
            self.book.discard(group.group_id, f"invalid/{reason}")
            return
        self.parts.admission.add(group, batch, self.version)
        if batch.groups and batch.groups[-1] is group:  # admitted, not dropped
            self.flow.arrived(group, release.released_at if release is not None else 0.0)

    def show_rollouts(self, batch: StepBatch) -> None:
        """The rollout table, on the steps it is due. Its advantages are computed again here, over the
        whole step batch with the trainer's rule: the same numbers the trainer used (its batch-wide sums run
        over every rank's share, which together are this batch), at the cost of one pass over the rewards."""
        diagnostics = self.parts.diagnostics
        if diagnostics.rollouts_due(self.version + 1):
            advantages = group_advantages(batch.groups, self.cfg.advantage_norm)
            diagnostics.log_rollouts(batch.groups, advantages, self.version)

    def stop_early(self, why: str) -> None:
        log.warning("%s; ending the run at step %d of %d", why, self.version, self.cfg.max_steps)
        self.stopped_early = why  # the step runner tells the other ranks

    def on_eval_group(self, group: RolloutGroup) -> None:
        self.evaluator.on_group(group, self.version)
        self.held.release()  # the evaluation may be complete: the newest version goes out

    def on_dead_letter(self, group_id: str) -> None:
        """The broker gave up on a group: an evaluation completes without it, a training group frees its slot."""
        if self.evaluator.dead_letter(group_id):
            self.held.release()
        else:
            self.book.dead_letter(group_id)

    def step_metrics(self, batch: StepBatch, train: dict[str, float]) -> dict[str, float]:
        batch.stats["trained_tokens"] += int(train.get("learner/num_tokens", 0))
        rollout = self.accounting.add_step(batch.stats, int(train["learner/computed_tokens"]))
        watch = self.parts.validator.watch if self.parts.validator is not None else None
        return (
            train
            | rollout
            | {
                "eval/multi_version_samples_total": float(self.evals.multi_version_samples),
                "eval/off_version_samples_total": float(self.evals.off_version_samples),
                "eval/hold_s_total": self.held.held_s,
                "curriculum/retired_prompts": float(self.coordinator.num_retired_prompts),
                "broker/duplicate_groups": float(self.book.counts["duplicates"]),
                "broker/dead_lettered_groups": float(self.book.counts["dead_lettered"]),
                "learner/rejected_groups": float(
                    sum(v for k, v in self.book.counts.items() if k.startswith(("rejected/", "discarded/invalid/")))
                ),
                "learner/version": float(self.version),
            }
            | (watch.step_metrics() if watch is not None else {})
            | self.transport.metrics()
            | (self.parts.publisher.metrics() if self.parts.publisher is not None else {})
            | self.accounting.compute_axis(len(self.transport.actors()))
            | self.flow.step_metrics(self.accounting.totals, self.transport.actors(), self.version)
        )

    def restore(self, state: dict) -> None:
        """Continue from a checkpoint's tidal state (the step runner restored the model and optimizer)."""
        self.resumed = state
        self.version = state["version"]
        self.coordinator.load_state_dict(state["coordinator"])

    def summary(self) -> dict:
        results, tracker = self.evals.results, self.parts.tracker
        broker = self.transport.metrics()
        return {
            "val_pass_rate_initial": results.get(0),
            "val_pass_rate_final": results.get(self.version),
            "val_pass_rate_by_version": {str(k): v for k, v in sorted(results.items())},
            "steps": self.version,
            "samples": self.accounting.totals["samples"],
            "gen_tokens": self.accounting.totals["gen_tokens"],
            "wall_s": self.accounting.wall_s(),
            "mlflow_run_id": tracker.run_id,
            "mlflow_uri": tracker.shown_uri,
            "rejected_frames": broker["broker/rejected_frames"],
            "broker": broker,  # as at shutdown
            "eval_off_version_samples": self.evals.off_version_samples,
            "eval_hold_s": self.held.held_s,
            "stopped_early": self.stopped_early,
            "groups_by_actor": dict(self.accounting.by_actor),
            "episode_failures": self.parts.admission.failure_summary(),
            "groups": dict(self.book.counts),
            "outstanding_groups": sorted(self.book.outstanding),
        }
