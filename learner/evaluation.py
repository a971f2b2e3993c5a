"""Evaluations: held-out prompts sampled at a version, aggregated into a mean@n pass rate (the share of
samples whose task reward is at least `task.pass_threshold`) and the mean task reward, two metrics that
agree only when every reward is 0 or 1.

Eval groups travel the same path as training groups (actors generate and score them) and carry
the version they evaluate (`eval_version`); the learner never trains on them. An evaluation is
complete when every one of its groups arrived or was given up on by the broker.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from tidal.broker.schema import RolloutGroup
from tidal.learner.admission import pass_score
from tidal.learner.groups import Release

log = logging.getLogger(__name__)


@dataclass
class Evaluations:
    pass_threshold: float = 1.0  # task.pass_threshold: a pass score at least this is a pass
    pass_on: str = ""  # task.pass_on: the reward function whose value is the pass score (empty: the task reward)
    expected: dict[int, dict[str, Release]] = field(default_factory=dict)  # version -> groups still to come
    rewards: dict[int, list[float]] = field(default_factory=dict)  # version -> task rewards
    scores: dict[int, list[float]] = field(default_factory=dict)  # version -> pass scores
    results: dict[int, float] = field(default_factory=dict)  # version -> pass rate
    reward_means: dict[int, float] = field(default_factory=dict)  # version -> mean task reward
    dispatched: set[str] = field(default_factory=set)  # every eval group id this learner sent out
    multi_version_samples: int = 0  # eval samples whose tokens came from two or more weight versions

    def expect(self, version: int, groups: dict[str, Release]) -> None:
        self.expected[version] = dict(groups)
        self.rewards[version], self.scores[version] = [], []
        self.dispatched.update(groups)

    def release_of(self, group: RolloutGroup) -> Release | None:
        """What went out for this eval group, while its evaluation still waits for it."""
        return self.expected.get(group.eval_version, {}).get(group.group_id)

    def add(self, group: RolloutGroup) -> tuple[int, float] | None:
        """Returns (version, pass rate) when this group completes an evaluation."""
        self.multi_version_samples += sum(s.spans_several_versions() for s in group.samples)
        pending = self.expected.get(group.eval_version)
        if pending is None or group.group_id not in pending:
            return None  # a duplicate or a leftover of an earlier run
        del pending[group.group_id]
        self.rewards[group.eval_version].extend(s.task_reward for s in group.samples)
        self.scores[group.eval_version].extend(pass_score(s, self.pass_on) for s in group.samples)
        return None if pending else self._complete(group.eval_version)

    def drop(self, group_id: str) -> tuple[int, float] | None:
        """An eval group the broker gave up on: the evaluation completes without it."""
        for version, pending in self.expected.items():
            if group_id in pending:
                del pending[group_id]
                log.warning("eval group %s was dead-lettered; the eval at version %d is computed without it",
                            group_id, version)
                if not pending and self.rewards[version]:
                    return self._complete(version)
        return None

    def owns(self, group_id: str) -> bool:
        return group_id in self.dispatched

    def waiting(self) -> bool:
        return any(self.expected.values())

    def pending_versions(self) -> list[int]:
        return [v for v, pending in self.expected.items() if pending]

    def _complete(self, version: int) -> tuple[int, float]:
        scores = np.asarray(self.scores[version], dtype=np.float64)
        self.results[version] = float(np.mean(scores >= self.pass_threshold))
        self.reward_means[version] = float(np.mean(self.rewards[version]))
        return version, self.results[version]


class Evaluator:
    """The evaluation flow of a run: dispatch held-out prompts at a version, check and collect what
    comes back, log each completed pass rate and mean reward on the compute axes. A pass is what the
    coordinator's curriculum counts as one too (task.pass_threshold)."""

    def __init__(self, coordinator, metrics_log, accounting, transport, validator=None, diagnostics=None,
                 pass_threshold: float = 1.0, pass_on: str = ""):
        self.coordinator, self.metrics_log, self.accounting = coordinator, metrics_log, accounting
        self.transport, self.validator, self.diagnostics = transport, validator, diagnostics
        self.evals = Evaluations(pass_threshold=pass_threshold, pass_on=pass_on)

    def start(self, version: int) -> None:
        if version not in self.evals.expected:
            groups = self.coordinator.dispatch_eval(version)
            self.evals.expect(version, groups)
            if self.diagnostics is not None:
                self.diagnostics.expect_eval(version, list(groups), max((r.n for r in groups.values()), default=1))

    def on_group(self, group: RolloutGroup, version: int) -> None:
        """An eval group arrived; one that does not mean what was sent out is left out of its evaluation."""
        release = self.evals.release_of(group)
        if release is not None and self.validator is not None and self.validator.check(group, release, version):
            self.report(self.evals.drop(group.group_id))
            return
        if release is not None and self.diagnostics is not None:
            self.diagnostics.on_eval_group(group, version)
        self.report(self.evals.add(group))

    def dead_letter(self, group_id: str) -> bool:
        """The broker gave up on a group: True when it was an eval group (its evaluation completes without it)."""
        if not self.evals.owns(group_id):
            return False
        self.report(self.evals.drop(group_id))
        return True

    def waiting(self) -> bool:
        return self.evals.waiting()

    def report(self, done: tuple[int, float] | None) -> None:
        if done is not None:
            version, pass_rate = done
            reward_mean = self.evals.reward_means[version]
            log.info("eval at version %d: val pass rate %.3f (%s >= %g), mean reward %.3f", version, pass_rate,
                     self.evals.pass_on or "reward", self.evals.pass_threshold, reward_mean)
            axis = self.accounting.compute_axis(len(self.transport.actors()))
            self.metrics_log.log({"eval/pass_rate": pass_rate, "eval/reward_mean": reward_mean} | axis, step=version)
            if self.diagnostics is not None:
                self.diagnostics.eval_done(version)
