"""The learner's training loop.

        coordinator thread: dataset ─► admission control ─► transport.submit_prompts ─► actors
                                                                                          │
        rollouts ◄────────────────────────────────────────────────────────────────────────┘
          │ collect_step_batch: eval groups → Evaluator; staleness check; zero-variance filter
          ▼
        trainer.step: advantages → micro-batches → fused logprobs → loss → AdamW      (version v → v+1)
          ▼
        publish_weights (file + announcement) → coordinator.on_step → eval? → checkpoint (+ commit) → log

Every step is one pass of `run`; each named step is a method below. A resumed learner starts
from a checkpoint's version; the step's metrics are logged after its checkpoint is saved, so a
crash between the two is healed on resume by logging the copy stored in the checkpoint.
"""
from __future__ import annotations

import logging
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tidal.broker.base import LearnerTransport
from tidal.broker.schema import RolloutGroup
from tidal.broker.weights import WeightChannel
from tidal.config import EvalConfig, LearnerConfig, OnViolation, StalenessConfig
from tidal.health import HealthFile
from tidal.learner.coordinator import Coordinator, CurriculumExhausted
from tidal.learner.trainer import Trainer

log = logging.getLogger(__name__)

ROLLOUT_TIMEOUT_S = 600.0  # no rollout for this long means the actors are gone
EVAL_GROUP_ID = re.compile(r"-eval\d+-\d+$")  # how Coordinator.dispatch_eval names eval groups
BROKER_POLL_S = 1.0  # how often the loop asks the broker about joins and dead letters


@dataclass
class Evaluator:
    """Collects eval groups per version into a mean@n pass rate."""

    expected: dict[int, set[str]] = field(default_factory=dict)
    rewards: dict[int, list[float]] = field(default_factory=dict)
    results: dict[int, float] = field(default_factory=dict)

    def expect(self, version: int, group_ids: list[str]) -> None:
        self.expected[version] = set(group_ids)
        self.rewards[version] = []

    def add(self, group: RolloutGroup) -> tuple[int, float] | None:
        """Returns (version, pass rate) when this group completes an evaluation."""
        version = int(group.group_id.rsplit("-eval", 1)[1].split("-")[0])
        pending = self.expected.get(version)
        if pending is None or group.group_id not in pending:
            return None  # a duplicate or a leftover of an earlier run
        pending.discard(group.group_id)
        self.rewards[version].extend(s.reward for s in group.samples)
        return None if pending else self._complete(version)

    def _complete(self, version: int) -> tuple[int, float]:
        self.results[version] = float(np.mean(self.rewards[version]))
        return version, self.results[version]

    def drop(self, group_id: str) -> tuple[int, float] | None:
        """An eval group the broker gave up on: the evaluation completes without it."""
        for version, pending in self.expected.items():
            if group_id in pending:
                pending.discard(group_id)
                log.warning("eval group %s was dead-lettered; the eval at version %d is computed without it",
                            group_id, version)
                if not pending and self.rewards[version]:
                    return self._complete(version)
        return None

    def waiting(self) -> bool:
        return any(self.expected.values())


def staleness_masks(lags: list[np.ndarray], max_lag: int, on_violation: OnViolation,
                    generated: list[np.ndarray] | None = None) -> tuple[list[np.ndarray] | None, int]:
    """Token masks (True = trained; one bool array per sample) under the bound `max_lag` on each
    token's lag (int [completion_len] per sample), and the count of generated tokens over it.
    `generated` (bool, same shapes; default all) excludes tokens the actor injected, which are never
    trained. Masks are None when the group must not be trained: drop_group with any stale token, or
    mask_tokens leaving no generated token."""
    generated = generated if generated is not None else [np.ones(lag.shape, dtype=bool) for lag in lags]
    too_old = [(lag > max_lag) & g for lag, g in zip(lags, generated, strict=True)]
    num_stale = int(sum(m.sum() for m in too_old))
    if num_stale and on_violation is OnViolation.drop_group:
        return None, num_stale
    if on_violation is OnViolation.mask_tokens:
        masks = [~m for m in too_old]
        # a group without a trainable token would reach the trainer as pure padding
        trainable = any((m & g).any() for m, g in zip(masks, generated))
        return (masks if trainable or not num_stale else None), num_stale
    return [np.ones_like(m) for m in too_old], num_stale


@dataclass
class StepBatch:
    groups: list[RolloutGroup]
    token_masks: list[list[np.ndarray]]
    stats: Counter


class Learner:
    def __init__(self, cfg: LearnerConfig, staleness: StalenessConfig, eval_cfg: EvalConfig, trainer: Trainer,
                 coordinator: Coordinator, transport: LearnerTransport, channel: WeightChannel, tracker, checkpointer):
        self.cfg, self.staleness, self.eval_cfg = cfg, staleness, eval_cfg
        self.trainer, self.coordinator, self.transport = trainer, coordinator, transport
        self.channel, self.tracker, self.checkpointer = channel, tracker, checkpointer
        self.version = 0
        self.evaluator = Evaluator()
        self.totals: Counter = Counter()
        self.by_actor: Counter = Counter()  # rollout groups received per actor id
        self.eval_multi_version = 0  # eval samples whose tokens came from two or more weight versions
        self.start_time = time.monotonic()
        self.device_seconds = 0.0
        self.last_axis_time = self.start_time
        self.health = HealthFile(cfg.health_file)
        self.next_broker_poll = 0.0
        self.resumed: dict | None = None  # the checkpoint state this learner continues from
        self.stopped_early = ""  # why the run ended before learner.max_steps, if it did
        self.unlogged: list[tuple[int, dict]] = []  # (step, metrics) waiting for a checkpoint to cover them
        self.ranks = None  # learner.ranks.BatchBroadcast when the learner runs on several ranks

    def run(self) -> dict:
        self.publish_weights()
        if self.resumed is None:
            self.start_eval()
        else:
            self.heal_logs()
            for version in self.resumed["learner"].get("evals_pending", []):  # lost with the old process
                self.evaluator.expect(version, self.coordinator.dispatch_eval(version))
        self.coordinator.start()
        while self.version < self.cfg.max_steps:
            try:
                batch = self.collect_step_batch()
            except CurriculumExhausted as err:  # nothing left to learn from: end the run, do not fail it
                log.warning("%s; ending the run at step %d of %d", err, self.version, self.cfg.max_steps)
                self.stopped_early = str(err)
                if self.ranks is not None:
                    self.ranks.send([], [])  # an empty batch tells the other ranks the loop is over
                break
            if self.ranks is not None:
                self.ranks.send(batch.groups, batch.token_masks)  # the other learner ranks train their share
            metrics = self.trainer.step(batch.groups, batch.token_masks, self.version)
            self.version += 1
            metrics["timing/weight_push_s"] = self.publish_weights()
            self.coordinator.on_step(self.version, [g.group_id for g in batch.groups])
            if self.eval_cfg.every and self.version % self.eval_cfg.every == 0 and self.version < self.cfg.max_steps:
                self.start_eval()
            self.log(self.step_metrics(batch, metrics), step=self.version)
            if self.checkpointer.due(self.version):
                self.save_checkpoint()
            elif not self.checkpointer.periodic:
                self.transport.commit()  # no resume point to wait for
        self.coordinator.stop()
        self.start_eval()
        self.wait_for_evals()
        self.save_checkpoint()
        return self.summary()

    def log(self, metrics: dict[str, float], step: int) -> None:
        """With periodic checkpoints, metrics reach MLflow once a checkpoint covers their step, so a
        resumed learner, which trains the steps after its checkpoint again, logs no step twice."""
        self.unlogged.append((step, metrics))
        if not self.checkpointer.periodic:
            self.flush_logs()

    def flush_logs(self) -> None:
        for step, metrics in self.unlogged:
            self.tracker.log_metrics(metrics, step=step)
        self.unlogged = []

    # ---- named steps -----------------------------------------------------------------------------

    def collect_step_batch(self) -> StepBatch:
        """Take rollouts until groups_per_step trainable groups are in hand."""
        batch = StepBatch([], [], Counter())
        last_arrival = time.monotonic()
        while len(batch.groups) < self.cfg.groups_per_step:
            self.coordinator.check()
            self.poll_broker()
            group = self.transport.recv_rollout(timeout_s=0.5)
            if group is None:
                if time.monotonic() - last_arrival > ROLLOUT_TIMEOUT_S:
                    raise TimeoutError(f"no rollout arrived for {ROLLOUT_TIMEOUT_S:.0f} s "
                                       f"(live actors: {sorted(self.transport.actors())})")
                continue
            last_arrival = time.monotonic()
            self.by_actor[group.actor_id] += 1
            if group.is_eval:
                self.on_eval_group(group)
            elif not self.coordinator.admit(group.group_id):
                batch.stats["duplicates"] += 1  # redelivered or re-dispatched: trained once already
            else:
                self.admit(group, batch)
        return batch

    def poll_broker(self) -> None:
        """Liveness, actor joins and dead letters, about once a second."""
        self.health.touch()
        if time.monotonic() < self.next_broker_poll:
            return
        self.next_broker_poll = time.monotonic() + BROKER_POLL_S
        for join in self.transport.take_joins():
            self.coordinator.ledger.record("actor_joined", actor=join.actor_id, version=join.version,
                                           announced=join.announced, learner_version=self.version)
        for group_id in self.transport.take_dead_letters():
            if EVAL_GROUP_ID.search(group_id):
                self.report_eval(self.evaluator.drop(group_id))
            else:
                self.coordinator.on_dead_letter(group_id)

    def admit(self, group: RolloutGroup, batch: StepBatch) -> None:
        """Counts, the prompt's pass rate for the curriculum, staleness enforcement and zero-variance
        filtering for one training group."""
        stats = batch.stats
        stats["groups_received"] += 1
        stats["samples"] += len(group.samples)
        stats["gen_tokens"] += sum(s.num_tokens for s in group.samples)
        stats["prompt_tokens"] += len(group.samples) * (len(group.prompt_tokens.data) // 4)
        stats["truncated"] += sum(s.finish_reason == "length" for s in group.samples)
        rewards = [s.reward for s in group.samples]
        task_rewards = [s.task_reward for s in group.samples]  # pass rates ignore length shaping
        stats["reward_sum"] += sum(rewards)
        stats["passed"] += sum(r > 0 for r in task_rewards)
        stats["multi_version_samples"] += sum(s.spans_several_versions() for s in group.samples)
        # every received group is evidence of the prompt's pass rate, discarded ones included
        self.coordinator.on_rewards(group.prompt_id, task_rewards)
        generated = [~s.injected_mask() for s in group.samples]  # interruption text is never trained
        masks, num_stale = staleness_masks([self.version - s.versions() for s in group.samples],
                                           self.staleness.max_lag, self.staleness.on_violation, generated)
        stats["stale_tokens"] += num_stale
        if masks is None:
            stats["dropped_stale"] += 1
            self.coordinator.on_discarded(group.group_id, "stale")
            return
        if self.cfg.zero_variance_filter and max(rewards) == min(rewards):
            stats["zero_variance"] += 1
            self.coordinator.on_discarded(group.group_id, "zero_variance")
            return
        if self.staleness.on_violation is OnViolation.mask_tokens:
            stats["masked_stale_tokens"] += num_stale
        batch.groups.append(group)
        batch.token_masks.append([m & g for m, g in zip(masks, generated)])  # aggregation counts real tokens only

    def publish_weights(self) -> float:
        start = time.perf_counter()
        named = self.trainer.policy.state_dict()  # includes tied entries such as lm_head.weight
        self.transport.publish_weights(self.channel.publish(named, self.version))
        return time.perf_counter() - start

    def start_eval(self) -> None:
        if self.version not in self.evaluator.expected:
            self.evaluator.expect(self.version, self.coordinator.dispatch_eval(self.version))

    def on_eval_group(self, group: RolloutGroup) -> None:
        self.eval_multi_version += sum(s.spans_several_versions() for s in group.samples)
        self.report_eval(self.evaluator.add(group))

    def report_eval(self, done: tuple[int, float] | None) -> None:
        if done is not None:
            version, pass_rate = done
            log.info("eval at version %d: val pass rate %.3f", version, pass_rate)
            self.log({"eval/pass_rate": pass_rate} | self.compute_axis(), step=version)

    def wait_for_evals(self) -> None:
        last_arrival = time.monotonic()
        while self.evaluator.waiting():
            self.poll_broker()
            group = self.transport.recv_rollout(timeout_s=0.5)
            if group is not None:
                last_arrival = time.monotonic()
                if group.is_eval:
                    self.on_eval_group(group)
                else:
                    self.transport.leave_pending(group)  # not trained: a longer resumed run still can
            elif time.monotonic() - last_arrival > ROLLOUT_TIMEOUT_S:
                raise TimeoutError("final evaluation did not complete: no rollout arrived for "
                                   f"{ROLLOUT_TIMEOUT_S:.0f} s")

    def compute_axis(self) -> dict[str, float]:
        """Where this point sits on every compute axis a scaling fit may use (DESIGN §8).

        FLOPs: 2 N per generated or prompt token on the actors, 6 N per token the learner
        computes (forward and backward). Device-hours: wall time x devices in use (the live
        actors and the learner's ranks), integrated since the start.
        """
        now = time.monotonic()
        learner_devices = self.ranks.world if self.ranks is not None else 1
        self.device_seconds += (now - self.last_axis_time) * (len(self.transport.actors()) + learner_devices)
        self.last_axis_time = now
        n = self.trainer.num_params
        flops = 2 * n * (self.totals["gen_tokens"] + self.totals["prompt_tokens"]) + 6 * n * self.totals["computed_tokens"]
        return {"compute/samples": float(self.totals["samples"]), "compute/gen_tokens": float(self.totals["gen_tokens"]),
                "compute/flops": float(flops), "compute/device_hours": self.device_seconds / 3600,
                "compute/wall_s": now - self.start_time}

    def step_metrics(self, batch: StepBatch, metrics: dict[str, float]) -> dict[str, float]:
        s = batch.stats
        self.totals.update(s)
        self.totals["steps"] += 1
        self.totals["computed_tokens"] += int(metrics["learner/computed_tokens"])
        elapsed = time.monotonic() - self.start_time
        metrics |= {
            "rollout/reward": s["reward_sum"] / max(s["samples"], 1),
            "rollout/pass_rate": s["passed"] / max(s["samples"], 1),
            "rollout/truncation_rate": s["truncated"] / max(s["samples"], 1),
            "rollout/completion_len_mean": s["gen_tokens"] / max(s["samples"], 1),
            "rollout/prompt_len_mean": s["prompt_tokens"] / max(s["samples"], 1),
            "rollout/zero_variance_frac": s["zero_variance"] / max(s["groups_received"], 1),
            "rollout/gen_tokens_per_s": self.totals["gen_tokens"] / elapsed,
            "rollout/multi_version_samples": float(s["multi_version_samples"]),
            "eval/multi_version_samples_total": float(self.eval_multi_version),
            "offpolicy/dropped_stale_groups": float(s["dropped_stale"]),
            "offpolicy/stale_tokens": float(s["stale_tokens"]),
            "offpolicy/masked_stale_tokens": float(s["masked_stale_tokens"]),
            "curriculum/retired_prompts": float(self.coordinator.num_retired_prompts),
            "broker/duplicate_groups": float(self.coordinator.counts["duplicates"]),
            "broker/dead_lettered_groups": float(self.coordinator.counts["dead_lettered"]),
            "learner/version": float(self.version),
        } | self.transport.metrics() | self.compute_axis()
        return metrics

    # ---- checkpoints and resume --------------------------------------------------------------

    def save_checkpoint(self) -> None:
        """Save, then acknowledge to the broker and log to MLflow everything the checkpoint covers."""
        self.checkpointer.save(self.version, {"coordinator": self.coordinator.state_dict(),
                                              "learner": self.state_dict(), "unlogged": self.unlogged})
        self.transport.commit()
        self.flush_logs()

    def state_dict(self) -> dict:
        return {"totals": dict(self.totals), "by_actor": dict(self.by_actor), "evals": self.evaluator.results,
                "evals_pending": [v for v, pending in self.evaluator.expected.items() if pending],
                "eval_multi_version": self.eval_multi_version, "device_seconds": self.device_seconds,
                "wall_s": time.monotonic() - self.start_time}

    def restore(self, state: dict) -> None:
        """Continue from a checkpoint's tidal state (model and optimizer are restored by the caller)."""
        self.resumed = state
        self.version = state["version"]
        mine = state["learner"]
        self.totals, self.by_actor = Counter(mine["totals"]), Counter(mine["by_actor"])
        self.evaluator.results = {int(k): v for k, v in mine["evals"].items()}
        self.eval_multi_version, self.device_seconds = mine["eval_multi_version"], mine["device_seconds"]
        self.start_time = time.monotonic() - mine["wall_s"]  # compute axes continue where they were
        self.last_axis_time = time.monotonic()

    def heal_logs(self) -> None:
        """Metrics the checkpoint covered may not have reached MLflow before the crash: log the
        stored copies of those MLflow does not have yet."""
        last = {key: self.tracker.last_step(key) for key in ("learner/version", "eval/pass_rate")}
        for step, metrics in self.resumed.get("unlogged", []):
            key = "learner/version" if "learner/version" in metrics else "eval/pass_rate"
            if last[key] is None or step > last[key]:
                self.tracker.log_metrics(metrics, step=step)

    def summary(self) -> dict:
        evals = self.evaluator.results
        return {"val_pass_rate_initial": evals.get(0), "val_pass_rate_final": evals.get(self.version),
                "val_pass_rate_by_version": {str(k): v for k, v in sorted(evals.items())},
                "steps": self.version, "samples": self.totals["samples"], "gen_tokens": self.totals["gen_tokens"],
                "wall_s": time.monotonic() - self.start_time, "mlflow_run_id": self.tracker.run_id,
                "mlflow_uri": self.tracker.uri, "rejected_frames": self.transport.metrics()["broker/rejected_frames"],
                "stopped_early": self.stopped_early,
                "groups_by_actor": dict(self.by_actor), "groups": dict(self.coordinator.counts),
                "outstanding_groups": sorted(self.coordinator.outstanding)}
