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
from tidal.broker.schema import InterruptParams, PromptGroup, SampleArrays, SamplingParams

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


def splice_spans(think_spans: list[Span], num_think: int, num_injected: int, answer_spans: list[Span]) -> list[Span]:
    """Version spans over thinking + injected + answer tokens, adjacent equal versions merged.

    Injected tokens take the version of the last thinking token: no policy produced them, and this
    never makes the sample look older (for staleness) than its own oldest generated token.
    """
    assert think_spans and answer_spans, "vLLM reported no weight_versions for a completion"
    offset = num_think + num_injected
    pieces = [*think_spans, (think_spans[-1][0], num_think, offset),
              *((v, start + offset, end + offset) for v, start, end in answer_spans)]
    merged: list[Span] = []
    for version, start, end in pieces:
        if merged and merged[-1][0] == version and merged[-1][2] == start:
            merged[-1] = (version, merged[-1][1], end)
        elif end > start:
            merged.append((version, start, end))
    return merged


def splice(thinking: Completion, interrupt: InterruptParams, answer: Completion) -> Completion:
    """One completion from an interrupted thinking phase and its answer."""
    num_think, num_injected = len(thinking.tokens), len(interrupt.tokens)
    tokens = np.concatenate([thinking.tokens, np.asarray(interrupt.tokens, dtype=np.int32), answer.tokens])
    logprobs = np.concatenate([thinking.logprobs, np.zeros(num_injected, dtype=np.float32), answer.logprobs])
    return Completion(
        tokens=tokens.astype(np.int32), logprobs=logprobs.astype(np.float32),
        version_spans=splice_spans(thinking.version_spans, num_think, num_injected, answer.version_spans),
        text=thinking.text + interrupt.text + answer.text,
        # a truncation is a sample that ran out of its final budget without a stop token
        finish_reason="interrupted" if answer.finish_reason == "stop" else "length",
        injected_spans=[(num_think, num_think + num_injected)])


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


def to_sample(completion: Completion, raw_reward: float, params: SamplingParams) -> SampleArrays:
    """The wire sample: reward = task reward + overlong penalty (when the group asks for one)."""
    penalty = overlong_penalty(len(completion.tokens), params.max_tokens, params.overlong_buffer_tokens)
    return SampleArrays.of(completion.tokens, completion.logprobs, version_spans=completion.version_spans,
                           reward=raw_reward + penalty, finish_reason=completion.finish_reason,
                           injected_spans=completion.injected_spans, raw_reward=raw_reward)


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
