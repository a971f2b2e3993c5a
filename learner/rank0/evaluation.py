"""Evaluations: held-out prompts sampled at a version, aggregated into a mean@n pass rate (the share of
samples whose task reward is at least `task.pass_threshold`) and the mean task reward, two metrics that
agree only when every reward is 0 or 1.

Eval groups travel the same path as training groups (actors generate and score them) and carry
the version they evaluate (`eval_version`); the learner never trains on them. An evaluation is
complete when every one of its groups arrived or was given up on by the broker. Every sample of an
evaluation at V is made by V alone: while one is under way the learner announces no newer version
(`HeldAnnouncements`), so no actor moves past V mid-evaluation. An evaluation some of whose groups
the learner refused (a reward outside task.reward_range, ...) is not logged: its pass rate would count
only the groups that were kept.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tidal.broker.schema import RolloutGroup, WeightUpdate
from tidal.learner.rank0.admission import pass_score
from tidal.learner.rank0.groups import Release

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
    off_version_samples: int = 0  # eval samples with a token made by a version other than the one evaluated
    refused: dict[int, Counter] = field(default_factory=dict)  # version -> its groups the learner refused, by reason
    sizes: dict[int, int] = field(default_factory=dict)  # version -> the groups its evaluation sent out

    def expect(self, version: int, groups: dict[str, Release]) -> None:
        self.expected[version] = dict(groups)
        self.sizes[version] = len(groups)
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
        self.off_version_samples += sum(
            any(v != group.eval_version for v, start, end in s.version_spans if end > start) for s in group.samples
        )
        del pending[group.group_id]
        self.rewards[group.eval_version].extend(s.task_reward for s in group.samples)
        self.scores[group.eval_version].extend(pass_score(s, self.pass_on) for s in group.samples)
        return None if pending else self._complete(group.eval_version)

    def drop(self, group_id: str, refused: str = "") -> tuple[int, float] | None:
        """An eval group the broker gave up on (or the learner `refused`, naming why): the evaluation
        completes without it."""
        for version, pending in self.expected.items():
            if group_id in pending:
                del pending[group_id]
                if refused:
                    self.refused.setdefault(version, Counter())[refused] += 1
                else:
                    log.warning(
                        "eval group %s was dead-lettered; the eval at version %d is computed without it",
                        group_id,
                        version,
                    )
                if not pending and (self.rewards[version] or self.refused.get(version)):
                    return self._complete(version)
        return None

    def owns(self, group_id: str) -> bool:
        return group_id in self.dispatched

    def waiting(self) -> bool:
        return any(self.expected.values())

    def pending_versions(self) -> list[int]:
        return [v for v, pending in self.expected.items() if pending]

    def _complete(self, version: int) -> tuple[int, float]:
        if self.refused.get(version):
            return version, math.nan  # not a pass rate of the held-out set: Evaluator.report says why
        scores = np.asarray(self.scores[version], dtype=np.float64)
        self.results[version] = float(np.mean(scores >= self.pass_threshold))
        self.reward_means[version] = float(np.mean(self.rewards[version]))
        return version, self.results[version]


class Evaluator:
    """The evaluation flow of a run: dispatch held-out prompts at a version, check and collect what
    comes back, log each completed pass rate and mean reward on the compute axes. A pass is what the
    coordinator's curriculum counts as one too (task.pass_threshold)."""

    def __init__(
        self,
        coordinator,
        metrics_log,
        accounting,
        transport,
        validator=None,
        diagnostics=None,
        pass_threshold: float = 1.0,
        pass_on: str = "",
    ):
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
        reason = release is not None and self.validator is not None and self.validator.check(group, release, version)
        if reason:
            self.report(self.evals.drop(group.group_id, refused=reason))
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
        if done is not None and math.isnan(done[1]):
            self.refused_report(done[0])
        elif done is not None:
            version, pass_rate = done
            reward_mean = self.evals.reward_means[version]
            log.info(
                "eval at version %d: val pass rate %.3f (%s >= %g), mean reward %.3f",
                version,
                pass_rate,
                self.evals.pass_on or "reward",
                self.evals.pass_threshold,
                reward_mean,
            )
            axis = self.accounting.compute_axis(len(self.transport.actors()))
            self.metrics_log.log({"eval/pass_rate": pass_rate, "eval/reward_mean": reward_mean} | axis, step=version)
            if self.diagnostics is not None:
                self.diagnostics.eval_done(version)

    def refused_report(self, version: int) -> None:
        """An evaluation the learner refused groups of: said, counted, never logged as a pass rate."""
        refused = self.evals.refused[version]
        total = self.evals.sizes.get(version, 0)
        reasons = ", ".join(f"{n} for {why}" for why, n in refused.most_common())
        log.warning(
            "the evaluation at version %d is not logged: the learner refused %d of its %d groups (%s), and a "
            "pass rate over the rest would be biased; see the warning that names the setting",
            version,
            sum(refused.values()),
            total,
            reasons,
        )
        self.metrics_log.log({"eval/refused_groups": float(sum(refused.values()))}, step=version)
        if self.diagnostics is not None:
            self.diagnostics.eval_done(version)


class HeldAnnouncements:
    """Rank 0's weight announcements, held while an evaluation is under way: the actors stay on the
    evaluated version until its last group is in, then get the newest at once. The learner trains on
    meanwhile, as far as staleness.max_lag lets it on what the actors still make; that wait is the price
    of an evaluation made by its own version alone (`held_s`). An evaluation that comes due while
    another is under way starts on the version announced when that one ends."""

    def __init__(self, evaluator: Evaluator, publish, clock=time.monotonic):
        self.evaluator, self.publish, self.clock = evaluator, publish, clock
        # a benchmark knob, never a user setting: "0" announces at once, as before evaluations held (bench/eval_hold.py)
        self.holds = os.environ.get("TIDAL_BENCH_EVAL_HOLD", "1") != "0"
        self.newest: WeightUpdate | None = None  # the newest version pushed to the weight channel
        self.announced: int | None = None  # the version the actors were last told of
        self.due = False  # an evaluation waits for the hold to end
        self.held_since: float | None = None
        self.held_s = 0.0  # seconds a newer version waited for an evaluation, in all

    def announce(self, update: WeightUpdate) -> None:
        self.newest = update
        if self.holds and self.held_since is None and update.version != self.announced and self.evaluator.waiting():
            self.held_since = self.clock()
        self.release()

    def evaluate(self) -> None:
        """An evaluation is due: on the announced version now, or on the next one announced."""
        self.due = True
        self.release()

    def release(self) -> None:
        """Announce the newest version unless an evaluation is under way; start a due one on what is announced."""
        if self.holds and self.evaluator.waiting():
            return
        if self.newest is not None and self.newest.version != self.announced:
            self.publish(self.newest)
            self.announced = self.newest.version
        if self.held_since is not None:
            self.held_s += self.clock() - self.held_since
            self.held_since = None
        if self.due and self.announced is not None:
            self.due = False
            self.evaluator.start(self.announced)
