"""Evaluations: held-out prompts sampled at a version, aggregated into a mean@n pass rate.

Eval groups travel the same path as training groups (actors generate and score them) and carry
the version they evaluate (`eval_version`); the learner never trains on them. An evaluation is
complete when every one of its groups arrived or was given up on by the broker.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from tidal.broker.schema import RolloutGroup

log = logging.getLogger(__name__)


@dataclass
class Evaluations:
    expected: dict[int, set[str]] = field(default_factory=dict)  # version -> group ids still to come
    rewards: dict[int, list[float]] = field(default_factory=dict)
    results: dict[int, float] = field(default_factory=dict)  # version -> pass rate
    dispatched: set[str] = field(default_factory=set)  # every eval group id this learner sent out
    multi_version_samples: int = 0  # eval samples whose tokens came from two or more weight versions

    def expect(self, version: int, group_ids: list[str]) -> None:
        self.expected[version] = set(group_ids)
        self.rewards[version] = []
        self.dispatched.update(group_ids)

    def add(self, group: RolloutGroup) -> tuple[int, float] | None:
        """Returns (version, pass rate) when this group completes an evaluation."""
        self.multi_version_samples += sum(s.spans_several_versions() for s in group.samples)
        pending = self.expected.get(group.eval_version)
        if pending is None or group.group_id not in pending:
            return None  # a duplicate or a leftover of an earlier run
        pending.discard(group.group_id)
        self.rewards[group.eval_version].extend(s.reward for s in group.samples)
        return None if pending else self._complete(group.eval_version)

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

    def owns(self, group_id: str) -> bool:
        return group_id in self.dispatched

    def waiting(self) -> bool:
        return any(self.expected.values())

    def pending_versions(self) -> list[int]:
        return [v for v, pending in self.expected.items() if pending]

    def _complete(self, version: int) -> tuple[int, float]:
        self.results[version] = float(np.mean(self.rewards[version]))
        return version, self.results[version]
