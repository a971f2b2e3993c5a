"""What a rollout must mean before the learner trusts it: checked against what was released.

The wire schema already guarantees shapes and types; these checks are about sense. A rollout is
rejected when its prompt id, prompt, sample count or evaluation version differ from what was sent
out; when a completion is empty or longer than its budget, starts with an injected token, or has
a finish reason its tokens contradict; when a token id is outside the vocabulary, a behaviour
logprob is positive or below what any sampled token can have (`logprob_floor`); when a token claims
weights older than the group's min_version or newer than the learner's; when a reward falls
outside `task.reward_range`, or a reward component's name could not be a metric's; or when its
timings could not have been measured since the release. Whatever passes is something `Trainer.step`
can train on. Rejections are counted by reason and logged at the 1st, 10th, 100th ... occurrence;
none is fatal by itself (a RefusalWatch stops the run when most groups are refused).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter

from tidal.broker.schema import COMPONENT_NAME, RolloutGroup, Sample
from tidal.learner.rank0.groups import Release, prompt_digest
from tidal.learner.rank0.refusals import RefusalWatch
from tidal.logs import power_of_ten

log = logging.getLogger(__name__)

LOGPROB_SLACK = 1e-4  # a logprob is <= 0; float rounding of log_softmax may land a hair above

# log(2^-150): the largest x whose float32 exp(x) rounds to 0 (half the smallest subnormal, 2^-149,
# rounds up to it; anything below rounds down to 0).
FLOAT32_EXP_UNDERFLOW = -150 * math.log(2)  # about -103.97

# A group's gen_seconds + queue_seconds may exceed the learner's wall time since its release only
# by clock drift and adjustments: this much, plus TIMING_SLACK_FRACTION of that time.
TIMING_SLACK_S = 30.0
TIMING_SLACK_FRACTION = 0.01
CLOCK_ROUNDING_S = 1e-3  # between two durations the actor measured on one clock


# Why this floor. Actors report logprobs after temperature: log p_i = x_i - m - log S, with x = logits / T,
# m = max(x) and S = sum_j exp(x_j - m), where every term is at most 1, so 1 <= S <= V. A sampler in
# float32 can only pick a token whose weight exp(x_i - m) did not underflow to 0 (a normalized softmax
# underflows sooner still), i.e. x_i - m > log(2^-150); so log p_i > log(2^-150) - log V, about -115.9 for
# V = 151,936. The temperature does not move it: T scales the logits before the softmax, and the bound
# is on the softmax's input, at any T. Samplers in half precision or with flush-to-zero underflow
# sooner, which only raises the lowest value they can give. Anything lower (the -999 of a forged
# rollout) is poison. Above it, with the learner's logprob <= 0, rho = exp(learner - behaviour) <=
# V * 2^150, so rho^2 summed over any batch stays finite in float64: the off-policy metrics stay finite.
def logprob_floor(vocab_size: int) -> float:
    """The lowest behaviour logprob a sampled token can have, from a float32 softmax over `vocab_size` tokens."""
    return FLOAT32_EXP_UNDERFLOW - math.log(max(vocab_size, 1)) - 1e-3  # 1e-3: log_softmax's own rounding


class Validator:
    def __init__(
        self,
        vocab_size: int,
        max_tokens: int,
        reward_range: tuple[float, float],
        clock=time.time,
        watch: RefusalWatch | None = None,
    ):
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.reward_range = reward_range
        self.logprob_floor = logprob_floor(vocab_size)
        self.clock = clock  # wall-clock seconds, as Release.released_at
        self.rejected: Counter[str] = Counter()
        self.watch = watch  # told every verdict: many refusals for one reason are said, and may stop the run
        self.detail = ""  # what the last refused group held that was refused (where a value says more)

    def check(self, group: RolloutGroup, release: Release, version: int) -> str | None:
        """Why `group` must not be used (a short reason), or None."""
        self.detail = ""
        reason = self._why(group, release, version)
        if reason is not None:
            self.rejected[reason] += 1
            count = self.rejected[reason]
            if power_of_ten(count):
                log.warning(
                    "rejected rollout %s from %s: %s%s (#%d)",
                    group.group_id[:80],
                    group.actor_id,
                    reason,
                    f" ({self.detail})" if self.detail else "",
                    count,
                )
        if self.watch is not None:
            self.watch.observe(reason, self.detail, group.actor_id)
        return reason

    def _why(self, group: RolloutGroup, release: Release, version: int) -> str | None:
        if group.eval_version != release.eval_version:
            return "eval_version"
        if group.prompt_id != release.prompt_id:  # the curriculum judges prompts by this id
            return "prompt_id"
        if len(group.samples) != release.n:
            return "sample_count"
        if prompt_digest(group.prompt_tokens.data) != release.digest:
            return "prompt"
        for s in group.samples:
            reason = self._completion(s, release)
            if reason is not None:
                return reason
        return (
            self._arrays(group) or self._versions_and_rewards(group, release, version) or self._timings(group, release)
        )

    def _completion(self, s: Sample, release: Release) -> str | None:
        """A completion's length and finish reason, as an actor makes them (tidal.actor.length_control,
        tidal.actor.episode): every completion starts with a sampled token, and one that ended on a stop
        token ends with a sampled token too."""
        if s.num_tokens == 0:
            return "empty_completion"  # every request samples at least one token
        if s.num_tokens > self.max_tokens:
            return "length"
        if s.injected_spans and s.injected_spans[0][0] == 0:
            return "injected_spans"  # nothing sampled before it: an injection answers a sampled turn
        if s.finish_reason in ("stop", "interrupted") and s.injected_spans and s.injected_spans[-1][1] == s.num_tokens:
            return "finish_reason"  # a stop is a sampled token
        if s.finish_reason == "interrupted" and s.num_tokens > release.interrupted_max_tokens:
            return "finish_reason"  # released without interruptions (0), or longer than one allows
        # "length" shorter than max_tokens is accepted: an episode ends there when the environment's
        # reply does not fit, an interrupted sample when its answer budget runs out, and any request when
        # the engine's max_model_len does
        return None

    def _arrays(self, group: RolloutGroup) -> str | None:
        tokens, logprobs = group.tokens.numpy("i4", "tokens"), group.logprobs.numpy("f4", "logprobs")
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:  # not empty: every completion has a token
            return "token_id"
        if not (self.logprob_floor <= float(logprobs.min()) and float(logprobs.max()) <= LOGPROB_SLACK):
            return "logprob"
        return None

    def _versions_and_rewards(self, group: RolloutGroup, release: Release, version: int) -> str | None:
        low, high = self.reward_range
        for s in group.samples:
            versions = [v for v, start, end in s.version_spans if end > start]
            if versions and (min(versions) < release.min_version or max(versions) > version):
                return "version"
            if not (low <= s.reward <= high and low <= s.task_reward <= high):
                self.detail = (
                    f"a reward of {s.reward:g} (task reward {s.task_reward:g}) outside "
                    f"task.reward_range = [{low:g}, {high:g}]"
                )
                return "reward"
            odd = next((name for name in s.reward_components if not COMPONENT_NAME.fullmatch(name)), None)
            if odd is not None:  # it would be a metric's name (rewards/<name>/mean): one a store refuses stops a run
                self.detail = f"a reward component named {odd[:64]!r}; a name is letters, digits and _ . : -"
                return "reward_component"
        return None

    def _timings(self, group: RolloutGroup, release: Release) -> str | None:
        """Timings that fit in the time since the release: the actor measured them between its grant and
        its send, an episode's environment time inside its group's generation. (The wire schema refuses
        negative and non-finite ones too; every comparison here also fails on NaN.)"""
        episodes = [s.episode.env_seconds for s in group.samples if s.episode is not None]
        if not all(0 <= t < math.inf for t in (group.gen_seconds, group.queue_seconds, *episodes)):
            return "timing"
        since_release = self.clock() - release.released_at
        if not group.gen_seconds + group.queue_seconds <= since_release * (1 + TIMING_SLACK_FRACTION) + TIMING_SLACK_S:
            return "timing"
        if not all(env_seconds <= group.gen_seconds + CLOCK_ROUNDING_S for env_seconds in episodes):
            return "timing"
        return None
