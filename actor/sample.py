"""One place builds a sample: the transcript of a completion (turns the model sampled, tokens the actor
injected) and the wire sample made from it, its reward's named parts included."""

from __future__ import annotations

import numpy as np

from tidal.actor.engine import Completion
from tidal.broker.schema import Episode, SampleArrays, SamplingParams

Span = tuple[int, int, int]  # (version, start, end) over completion tokens


class Transcript:
    """A completion built piece by piece: turns the model sampled and tokens the actor injected
    (interruption text, an environment's replies), in order. Injected tokens carry behaviour logprob
    0.0, are listed in `injected_spans`, and take the version of the sampled token before them: no
    policy produced them, and this never makes a sample look older (for staleness) than its own
    oldest generated token."""

    def __init__(self):
        self.tokens: list[np.ndarray] = []
        self.logprobs: list[np.ndarray] = []
        self.spans: list[Span] = []  # adjacent equal versions merged
        self.injected: list[tuple[int, int]] = []
        self.texts: list[str] = []
        self.size = 0

    def add_sampled(self, turn: Completion) -> Transcript:
        assert turn.version_spans or not len(turn.tokens), "vLLM reported no weight_versions for a completion"
        for version, start, end in turn.version_spans:
            self._span(version, self.size + start, self.size + end)
        return self._add(turn.tokens, turn.logprobs, turn.text)

    def add_injected(self, tokens, text: str) -> Transcript:
        tokens = np.asarray(tokens, dtype=np.int32)
        if len(tokens):
            assert self.spans, "a completion starts with a sampled turn"
            self._span(self.spans[-1][0], self.size, self.size + len(tokens))
            self.injected.append((self.size, self.size + len(tokens)))
        return self._add(tokens, np.zeros(len(tokens), dtype=np.float32), text)

    def _span(self, version: int, start: int, end: int) -> None:
        if self.spans and self.spans[-1][0] == version and self.spans[-1][2] == start:
            self.spans[-1] = (version, self.spans[-1][1], end)
        elif end > start:
            self.spans.append((version, start, end))

    def _add(self, tokens, logprobs, text: str) -> Transcript:
        self.tokens.append(np.asarray(tokens, dtype=np.int32))
        self.logprobs.append(np.asarray(logprobs, dtype=np.float32))
        self.texts.append(text)
        self.size += len(tokens)
        return self

    def token_ids(self) -> list[int]:
        """Every token so far, as the next request's continuation of the prompt."""
        return np.concatenate(self.tokens).tolist()

    def completion(self, finish_reason: str) -> Completion:
        return Completion(
            tokens=np.concatenate(self.tokens),
            logprobs=np.concatenate(self.logprobs),
            version_spans=list(self.spans),
            text="".join(self.texts),
            finish_reason=finish_reason,
            injected_spans=list(self.injected),
        )


def to_sample(
    completion: Completion,
    raw_reward: float,
    params: SamplingParams,
    episode: Episode | None = None,
    components: dict[str, float] | None = None,
) -> SampleArrays:
    """The wire sample: reward = task reward + overlong penalty (when the group asks for one); the reward's
    named parts (task.reward_funcs: each function's value) beside it."""
    penalty = overlong_penalty(len(completion.tokens), params.max_tokens, params.overlong_buffer_tokens)
    arrays = SampleArrays.of(
        completion.tokens,
        completion.logprobs,
        version_spans=completion.version_spans,
        reward=raw_reward + penalty,
        finish_reason=completion.finish_reason,
        injected_spans=completion.injected_spans,
        raw_reward=raw_reward,
        episode=episode,
    )
    if components:
        arrays.sample.reward_components = components
    return arrays


def overlong_penalty(num_tokens: int, max_tokens: int, buffer_tokens: int) -> float:
    """DAPO's soft overlong punishment for a completion of L = num_tokens tokens, with
    L_max = max_tokens and L_cache = buffer_tokens:

        0                                 if L <= L_max - L_cache
        (L_max - L_cache - L) / L_cache   if L_max - L_cache < L <= L_max   (0 down to -1, linearly)
        -1                                if L > L_max

    buffer_tokens = 0 turns it off. E.g. L_max = 16, L_cache = 4: L = 12 -> 0, 13 -> -0.25, 16 -> -1.
    """
    if buffer_tokens <= 0:
        return 0.0
    over = num_tokens - (max_tokens - buffer_tokens)
    return -min(max(over, 0) / buffer_tokens, 1.0)
