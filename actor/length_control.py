"""Length control on the actor: ScaleRL forced interruptions (the DAPO overlong penalty is added where the
sample is built, tidal.actor.sample).

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

from tidal.actor.engine import Completion
from tidal.actor.sample import Transcript
from tidal.broker.schema import InterruptParams, PromptGroup, SamplingParams


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


def splice(thinking: Completion, interrupt: InterruptParams, answer: Completion) -> Completion:
    """One completion from an interrupted thinking phase and its answer."""
    transcript = Transcript().add_sampled(thinking).add_injected(interrupt.tokens, interrupt.text).add_sampled(answer)
    # a truncation is a sample that ran out of its final budget without a stop token
    return transcript.completion("interrupted" if answer.finish_reason == "stop" else "length")


async def generate(engine, group: PromptGroup) -> list[Completion]:
    """group.n completions of the group's prompt; with interruptions, one think (and maybe one answer)
    request per sample, since budgets differ per sample."""
    prompt = group.prompt_tokens.numpy("i4", "prompt_tokens").tolist()
    params, interrupt = group.sampling, group.sampling.interrupt
    if interrupt is None:
        return await engine.sample(prompt, group.n, params, request_id=group.group_id)
    budgets = think_budgets(group.group_id, group.n, interrupt)
    return list(
        await asyncio.gather(
            *(
                _think_then_answer(engine, prompt, params, budget, f"{group.group_id}-s{i}")
                for i, budget in enumerate(budgets)
            )
        )
    )


async def _think_then_answer(
    engine, prompt: list[int], params: SamplingParams, budget: int, request_id: str
) -> Completion:
    interrupt = params.interrupt
    [thinking] = await engine.sample(prompt, 1, params, request_id=request_id, max_tokens=budget)
    if not needs_interruption(thinking):
        return thinking
    [answer] = await engine.sample(
        answer_prompt(prompt, thinking, interrupt),
        1,
        params,
        request_id=f"{request_id}-answer",
        max_tokens=interrupt.answer_tokens,
    )
    return splice(thinking, interrupt, answer)
