"""Counting, a long-generation task: `037>052:` -> `037 038 039 ... 052`; exact-match reward 1/0.

The completion's length follows the prompt's span (4 characters a number): spans run from 2 to
MAX_SPAN and the number of prompts of span L falls as L^-1.5, so one batch holds completions of 7
to 95 characters, most of them short and a few several times longer than the median. That is the shape
of generation where sampling and learning overlap best: the longest samples of a batch decide how long
a synchronous step waits. Three-digit numbers give thousands of prompts, so a run of a few hundred
steps sees most of them once and has to learn where a count stops rather than where each one does.
Needs no download.
"""

from __future__ import annotations

import random

from tidal.config import ConfigError, TaskConfig
from tidal.tasks import Prompt, Split

OPTIONS: dict[str, str] = {}  # task.kwargs: this task takes none

ALPHABET = "0123456789 >:"
MAX_SPAN = 24  # numbers in the longest answer (95 characters)
MAX_POSITIONS = 128  # the tiny model's context: an 8-character prompt, 95 answer characters and <eos>
PROMPTS_PER_SPAN = 6000  # prompts of span L: min(6000 / L^1.5, every start that fits)


def load_prompts(cfg: TaskConfig) -> Split:
    """Spans a..b of 2 to MAX_SPAN numbers within 0..max_operand, fewer the longer, shuffled by
    cfg.seed; the first num_val are held out."""
    top = cfg.max_operand
    if not 2 <= top <= 999:
        raise ConfigError(
            f"config key 'task.max_operand' = {top}: the count task writes three-digit numbers; use 2..999"
        )
    rng = random.Random(cfg.seed)
    spans = []
    for span in range(2, min(MAX_SPAN, top + 1) + 1):
        starts = list(range(top - span + 2))
        spans += [(a, span) for a in rng.sample(starts, min(len(starts), round(PROMPTS_PER_SPAN / span**1.5)))]
    if cfg.num_val >= len(spans):
        raise ConfigError(
            f"config key 'task.num_val' = {cfg.num_val} leaves no training prompts "
            f"({len(spans)} spans with task.max_operand = {top})"
        )
    rng.shuffle(spans)
    prompts = [
        Prompt(
            prompt_id=a * 100 + span,
            text=f"{a:03d}>{a + span - 1:03d}:",
            payload={"answer": " ".join(f"{n:03d}" for n in range(a, a + span))},
        )
        for a, span in spans
    ]
    return Split(train=prompts[cfg.num_val :], val=prompts[: cfg.num_val])


def teacher_slip(answer: str, rng: random.Random) -> str:
    """The warm start's sloppy teacher: it counts one or two numbers past the end (it has not learnt
    where to stop), so sampled answers often overshoot until RL teaches the stop."""
    last = int(answer[-3:])
    extra = [f"{(last + i) % 1000:03d}" for i in range(1, rng.choice((1, 2)) + 1)]
    return " ".join([answer, *extra])


def reward(text: str, payload: dict[str, str]) -> float:
    """1.0 for exactly the right count (surrounding whitespace ignored), else 0.0."""
    return 1.0 if text.strip() == payload["answer"] else 0.0
