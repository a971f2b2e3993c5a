"""Length control on the actor: ScaleRL forced interruptions and the DAPO overlong penalty.

    sample i: think request (budget B_i) ──ends with a stop token──────────────────► finish "stop"
                     │ reached B_i
                     ▼
              prompt + thinking + interruption tokens ──► answer request (answer_tokens)
                                                              ├─ stop token ──► finish "interrupted"
                                                              └─ budget     ──► finish "length"

A spliced completion is thinking + interruption + answer tokens, so positions line up for the
learner; the interruption tokens are listed in `injected_spans` (never trained on) and carry
behavior logprob 0.0. Both settings travel in each PromptGroup's SamplingParams, so the learner
decides per group (eval groups have them off unless configured). Everything here except
`generate` is a pure function.
"""
from __future__ import annotations

import asyncio
import random

import numpy as np

from tidal.actor.engine import Completion
from tidal.broker.schema import Episode, InterruptParams, PromptGroup, SampleArrays, SamplingParams

Span = tuple[int, int, int]  # (version, start, end) over completion tokens


def think_budgets(group_id: str, n: int, interrupt: InterruptParams) -> list[int]:
    """Each sample's thinking budget, uniform over [min_think_tokens, max_think_tokens] inclusive."""
    # a str seed is hashed with sha512: a re-dispatched group draws the same budgets on any actor
    rng = random.Random(group_id)
    return [rng.randint(interrupt.min_think_tokens, interrupt.max_think_tokens) for _ in range(n)]


def needs_interruption(thinking: Completion) -> bool:
    """The think request was sent with max_tokens = the budget, so 'length' means it reached it."""
    return thinking.finish_reason == "length"


def answer_prompt(prompt_tokens: list[int], thinking: Completion, interrupt: InterruptParams) -> list[int]:
    """The answer request's prompt: the original prompt, the thinking so far, the interruption."""
    return [*prompt_tokens, *thinking.tokens.tolist(), *interrupt.tokens]


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
        return Completion(tokens=np.concatenate(self.tokens), logprobs=np.concatenate(self.logprobs),
                          version_spans=list(self.spans), text="".join(self.texts), finish_reason=finish_reason,
                          injected_spans=list(self.injected))


def splice(thinking: Completion, interrupt: InterruptParams, answer: Completion) -> Completion:
    """One completion from an interrupted thinking phase and its answer."""
    transcript = Transcript().add_sampled(thinking).add_injected(interrupt.tokens, interrupt.text).add_sampled(answer)
    # a truncation is a sample that ran out of its final budget without a stop token
    return transcript.completion("interrupted" if answer.finish_reason == "stop" else "length")


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


def to_sample(completion: Completion, raw_reward: float, params: SamplingParams,
              episode: Episode | None = None) -> SampleArrays:
    """The wire sample: reward = task reward + overlong penalty (when the group asks for one)."""
    penalty = overlong_penalty(len(completion.tokens), params.max_tokens, params.overlong_buffer_tokens)
    return SampleArrays.of(completion.tokens, completion.logprobs, version_spans=completion.version_spans,
                           reward=raw_reward + penalty, finish_reason=completion.finish_reason,
                           injected_spans=completion.injected_spans, raw_reward=raw_reward, episode=episode)


async def generate(engine, group: PromptGroup) -> list[Completion]:
    """group.n completions of the group's prompt; with interruptions, one think (and maybe one answer)
    request per sample, since budgets differ per sample."""
    prompt = group.prompt_tokens.numpy("i4", "prompt_tokens").tolist()
    params, interrupt = group.sampling, group.sampling.interrupt
    if interrupt is None:
        return await engine.sample(prompt, group.n, params, request_id=group.group_id)
    budgets = think_budgets(group.group_id, group.n, interrupt)
    return list(await asyncio.gather(*(
        _think_then_answer(engine, prompt, params, budget, f"{group.group_id}-s{i}")
        for i, budget in enumerate(budgets))))


async def _think_then_answer(engine, prompt: list[int], params: SamplingParams, budget: int,
                             request_id: str) -> Completion:
    interrupt = params.interrupt
    [thinking] = await engine.sample(prompt, 1, params, request_id=request_id, max_tokens=budget)
    if not needs_interruption(thinking):
        return thinking
    [answer] = await engine.sample(answer_prompt(prompt, thinking, interrupt), 1, params,
                                   request_id=f"{request_id}-answer", max_tokens=interrupt.answer_tokens)
    return splice(thinking, interrupt, answer)
