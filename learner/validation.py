"""What a rollout must mean before the learner trusts it: checked against what was released.

The wire schema already guarantees shapes and types; these checks are about sense. A rollout is
rejected when its prompt, sample count or evaluation version differ from what was sent out, a
token id is outside the vocabulary, a completion is longer than its budget, a behaviour logprob
is positive or absurdly negative, a token claims weights older than the group's min_version or newer than the
learner's, or a reward falls outside `task.reward_range`. Rejections are counted by reason and
logged at the 1st, 10th, 100th ... occurrence; none is fatal.
"""
from __future__ import annotations

import logging
from collections import Counter

from tidal.broker.schema import RolloutGroup
from tidal.learner.groups import Release, prompt_digest

log = logging.getLogger(__name__)

LOGPROB_SLACK = 1e-4  # a logprob is <= 0; float rounding of log_softmax may land a hair above
LOGPROB_FLOOR = -1e3  # below any sampled token's logprob in float32 (about -104): such a value is poison


class Validator:
    def __init__(self, vocab_size: int, max_tokens: int, reward_range: tuple[float, float]):
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.reward_range = reward_range
        self.rejected: Counter[str] = Counter()

    def check(self, group: RolloutGroup, release: Release, version: int) -> str | None:
        """Why `group` must not be used (a short reason), or None."""
        reason = self._why(group, release, version)
        if reason is not None:
            self.rejected[reason] += 1
            count = self.rejected[reason]
            if _is_power_of_ten(count):
                log.warning("rejected rollout %s from %s: %s (#%d)", group.group_id[:80], group.actor_id, reason,
                            count)
        return reason

    def _why(self, group: RolloutGroup, release: Release, version: int) -> str | None:
        if group.eval_version != release.eval_version:
            return "eval_version"
        if len(group.samples) != release.n:
            return "sample_count"
        if prompt_digest(group.prompt_tokens.data) != release.digest:
            return "prompt"
        if any(s.num_tokens > self.max_tokens for s in group.samples):
            return "length"
        tokens, logprobs = group.tokens.numpy("i4", "tokens"), group.logprobs.numpy("f4", "logprobs")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            return "token_id"
        if tokens.size and not (LOGPROB_FLOOR <= float(logprobs.min()) and float(logprobs.max()) <= LOGPROB_SLACK):
            return "logprob"
        low, high = self.reward_range
        for s in group.samples:
            versions = [v for v, start, end in s.version_spans if end > start]
            if versions and (min(versions) < release.min_version or max(versions) > version):
                return "version"
            if not (low <= s.reward <= high and low <= s.task_reward <= high):
                return "reward"
        return None


def _is_power_of_ten(n: int) -> bool:
    return str(n).rstrip("0") == "1"
