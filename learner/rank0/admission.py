"""What enters a step batch: each arriving training group is counted, feeds the curriculum, and
is checked against the staleness bound and the zero-variance filter, in that order.

A token produced under version v and trained at step s has lag s - v; `staleness.max_lag = k`
bounds it. Tokens over the bound are handled by `staleness.on_violation`: drop the group, mask
those tokens out of the loss, or keep them (counted either way). Tokens the actor injected
(forced interruptions) are never trained and never count as stale.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tidal.broker.schema import RolloutGroup, Sample
from tidal.config import OnViolation, StalenessConfig
from tidal.learner.rank0.accounting import COMPONENT
from tidal.learner.rank0.groups import GroupBook
from tidal.learner.rank0.notices import notice

MAX_FAILURE_KINDS = 32  # distinct kinds of failure kept for the summary; the rest are counted together
FAILING_RUN = 512  # this many training episodes failing in a row stop the run: its reward or environment is broken
RAISED = re.compile(r"^(.* raised \w+)(: .*)?$")  # "<what> raised <Error>: <its message>"


def staleness_masks(
    lags: list[np.ndarray], max_lag: int, on_violation: OnViolation, generated: list[np.ndarray] | None = None
) -> tuple[list[np.ndarray] | None, int]:
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
    groups: list[RolloutGroup] = field(default_factory=list)
    token_masks: list[list[np.ndarray]] = field(default_factory=list)  # [group][sample] bool [completion_len]
    stats: Counter = field(default_factory=Counter)  # counts over every group received, trained or not


class Admission:
    def __init__(
        self,
        staleness: StalenessConfig,
        zero_variance_filter: bool,
        book: GroupBook,
        on_rewards: Callable[[int, list[float]], None],
        pass_threshold: float = 1.0,
        pass_on: str = "",
    ):
        self.staleness = staleness
        self.zero_variance_filter = zero_variance_filter
        self.book = book
        self.on_rewards = on_rewards  # (prompt id, pass scores): the curriculum's evidence
        self.pass_threshold = pass_threshold  # task.pass_threshold: a pass score at least this is a pass
        self.pass_on = pass_on  # task.pass_on: the reward function whose value is the pass score
        self.warned_reward_scale = False
        self.failures: Counter[str] = Counter()  # why episodes failed (a reward or environment raised), by kind
        self.failure_example: dict[str, str] = {}  # kind -> the first failure of that kind, its message included
        self.failure_other: dict[str, str] = {}  # kind -> a later failure of that kind whose text differs
        self.failing_in_a_row = 0  # training episodes that failed since the last that did not

    def failure_summary(self) -> dict:
        """The training episodes that failed and were scored 0, with their most frequent reasons (each
        names the reward function or environment, and the user's file and line where it raised)."""
        return {
            "count": sum(self.failures.values()),
            "reasons": [(self._reason(kind), n) for kind, n in self.failures.most_common(3)],
        }

    def _reason(self, kind: str) -> str:
        """A kind's failure as it was; where its messages differ, the kind with two of them, so that one
        message does not stand for many (KeyError 5207 for keys 39, 16, 8040, ...)."""
        first, other = self.failure_example.get(kind, kind), self.failure_other.get(kind)
        if other is None:
            return first
        head, _, where = kind.partition("\n")
        said = [e.partition("\n")[0].removeprefix(head).removeprefix(": ")[:80] for e in (first, other)]
        return f"{head} with different messages, e.g. {said[0]!r} and {said[1]!r}" + (f"\n{where}" if where else "")

    def add(self, group: RolloutGroup, batch: StepBatch, version: int) -> None:
        """Count a claimed training group and append it to `batch` unless it is stale or carries no signal."""
        count(group, batch.stats, self.pass_threshold, self.pass_on)
        self._check_reward_scale(group)
        self._note_failures(group)
        # every received group is evidence of the prompt's pass rate, discarded ones included
        self.on_rewards(self._released_prompt_id(group), [pass_score(s, self.pass_on) for s in group.samples])
        generated = [~s.injected_mask() for s in group.samples]  # interruption text is never trained
        masks, num_stale = staleness_masks(
            [version - s.versions() for s in group.samples],
            self.staleness.max_lag,
            self.staleness.on_violation,
            generated,
        )
        batch.stats["stale_tokens"] += num_stale
        if masks is None:
            batch.stats["dropped_stale"] += 1
            batch.stats["discarded_tokens/stale"] += int(sum(g.sum() for g in generated))
            self.book.discard(group.group_id, "stale")
            return
        rewards = [s.reward for s in group.samples]
        if self.zero_variance_filter and max(rewards) == min(rewards):
            batch.stats["zero_variance"] += 1
            batch.stats["discarded_tokens/filtered"] += int(sum(g.sum() for g in generated))
            self.book.discard(group.group_id, "zero_variance")
            return
        if self.staleness.on_violation is OnViolation.mask_tokens:
            batch.stats["masked_stale_tokens"] += num_stale
            batch.stats["discarded_tokens/stale"] += num_stale
        batch.groups.append(group)
        batch.token_masks.append([m & g for m, g in zip(masks, generated)])  # aggregation counts real tokens only

    def _note_failures(self, group: RolloutGroup) -> None:
        """Count failed episodes by kind; raise EpisodesFailing when FAILING_RUN in a row failed (every
        reward 0: groups without variance are dropped, so the run would sample on and never step)."""
        for s in group.samples:
            if s.episode is None or not s.episode.env_error:
                self.failing_in_a_row = 0
                continue
            self.failing_in_a_row += 1
            kind = failure_kind(s.episode.env_error)
            # kinds are bounded: a run's failures are a few kinds, and a peer's text is not trusted
            if kind not in self.failures and len(self.failures) >= MAX_FAILURE_KINDS:
                kind = "(other reasons)"
            self.failures[kind] += 1
            if self.failure_example.setdefault(kind, s.episode.env_error) != s.episode.env_error:
                self.failure_other.setdefault(kind, s.episode.env_error)
        if self.failing_in_a_row >= FAILING_RUN:
            example, times = self.failure_summary()["reasons"][0]
            raise EpisodesFailing(
                f"the last {self.failing_in_a_row} training episodes all failed (each scored 0, so "
                "their groups teach nothing): fix the reward or environment; the most frequent "
                f"reason ({times} times):\n{example}"
            )

    def _check_reward_scale(self, group: RolloutGroup) -> None:
        """Warn once when rewards other than 0 and 1 meet the default threshold 1.0, which assumes them:
        partial credit or summed components then pass only at 1.0 or more, which may not be what was meant."""
        if self.warned_reward_scale or self.pass_threshold != 1.0 or self.pass_on:  # an explicit choice: no warning
            return
        other = next((s.task_reward for s in group.samples if s.task_reward not in (0.0, 1.0)), None)
        if other is None:
            return
        self.warned_reward_scale = True
        notice.warning(
            "task rewards are not all 0 or 1 (prompt %d got %.4g) and task.pass_threshold is 1.0: a sample "
            "counts as a pass only at a reward >= 1.0 (rollout/pass_rate, eval/pass_rate, the curriculum); "
            "set task.pass_threshold to the reward a solved sample earns if that is not it",
            group.prompt_id,
            other,
        )

    def _released_prompt_id(self, group: RolloutGroup) -> int:
        """The prompt the book released this group for: the curriculum never takes a rollout's word for
        it (the validator refuses one naming another; this holds without a validator too). A group the
        book holds no release of (admitted directly, as in unit tests) is taken at its word."""
        with self.book.cond:
            release = self.book.outstanding.get(group.group_id)
        return group.prompt_id if release is None or release.prompt_id is None else release.prompt_id


class EpisodesFailing(RuntimeError):
    """Every recent training episode failed: the task's reward or environment raises on all of them."""


def failure_kind(error: str) -> str:
    """An episode's failure without its message: what raised, which error, and where (the user's file
    and line), so one bug whose messages quote each completion counts as one kind."""
    first, _, where = error.partition("\n")
    match = RAISED.match(first)
    return (match.group(1) if match else first) + (f"\n{where}" if where else "")


def pass_score(sample: Sample, pass_on: str = "") -> float:
    """What says whether a sample passed, compared with task.pass_threshold: the value of reward function
    `pass_on` (task.pass_on; -inf where it gave none: not a pass), else the task reward."""
    if not pass_on:
        return sample.task_reward
    return sample.reward_components.get(pass_on, -math.inf)


def count(group: RolloutGroup, stats: Counter, pass_threshold: float = 1.0, pass_on: str = "") -> None:
    """The rollout counts every received training group adds to its step's metrics; a sample passes when
    its pass score (pass_score) is at least `pass_threshold` (task.pass_threshold)."""
    stats["groups_received"] += 1
    stats["samples"] += len(group.samples)
    stats["gen_tokens"] += sum(s.num_tokens for s in group.samples)
    stats["prompt_tokens"] += len(group.samples) * group.num_prompt_tokens
    stats["truncated"] += sum(s.finish_reason == "length" for s in group.samples)
    stats["reward_sum"] += sum(s.reward for s in group.samples)
    stats["task_reward_sum"] += sum(s.task_reward for s in group.samples)
    stats["passed"] += sum(pass_score(s, pass_on) >= pass_threshold for s in group.samples)  # length shaping aside
    stats["multi_version_samples"] += sum(s.spans_several_versions() for s in group.samples)
    stats["injected_tokens"] += sum(end - start for s in group.samples for start, end in s.injected_spans)
    for s in group.samples:  # task.reward_funcs: each function's values, for rewards/<name>/mean and /std
        for name, value in s.reward_components.items():
            stats[f"{COMPONENT}n/{name}"] += 1
            stats[f"{COMPONENT}sum/{name}"] += value
            stats[f"{COMPONENT}sq/{name}"] += value * value
    episodes = [s.episode for s in group.samples if s.episode is not None]
    if episodes:
        stats["episodes"] += len(episodes)
        stats["episode_turns"] += sum(e.turns for e in episodes)
        stats["tool_calls"] += sum(e.tool_calls for e in episodes)
        stats["tool_errors"] += sum(e.tool_errors for e in episodes)
        stats["tool_timeouts"] += sum(e.tool_timeouts for e in episodes)
        stats["env_errors"] += sum(bool(e.env_error) for e in episodes)
        stats["env_ms"] += round(1000 * sum(e.env_seconds for e in episodes))
