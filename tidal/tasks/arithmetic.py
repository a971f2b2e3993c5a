"""Synthetic arithmetic: `37+48=` -> `085`, `05+07=` -> `012`; exact-match reward 1/0. Needs no download.

`task.kwargs.partial_credit` (default 0) is the reward of a wrong answer: a reward scale other than
0/1, where a pass is still the exact answer (task.pass_threshold = 1.0).
"""

from __future__ import annotations

import random

from tidal.config import ConfigError, TaskConfig
from tidal.tasks import Prompt, Split

# The characters the task needs; the tiny model's tokenizer is built from these.
ALPHABET = "0123456789+="


def load_prompts(cfg: TaskConfig) -> Split:
    """All pairs a+b with a, b in 0..max_operand, shuffled once by cfg.seed; the first num_val are held out."""
    pairs = [(a, b) for a in range(cfg.max_operand + 1) for b in range(cfg.max_operand + 1)]
    if cfg.num_val >= len(pairs):
        raise ConfigError(
            f"task.num_val = {cfg.num_val} leaves no training prompts "
            f"({len(pairs)} pairs with task.max_operand = {cfg.max_operand})"
        )
    random.Random(cfg.seed).shuffle(pairs)
    width = len(str(cfg.max_operand))
    # Fixed-width, zero-padded numbers keep digits aligned, which a small model learns far faster.
    prompts = [
        Prompt(
            prompt_id=a * (cfg.max_operand + 1) + b,
            text=f"{a:0{width}d}+{b:0{width}d}=",
            payload={"answer": f"{a + b:0{width + 1}d}"},
        )
        for a, b in pairs
    ]
    return Split(train=prompts[cfg.num_val :], val=prompts[: cfg.num_val])


OPTIONS = {"partial_credit": "the reward of a wrong answer, in [0, 1) (default 0)"}  # task.kwargs


def reward(text: str, payload: dict[str, str]) -> float:
    """1.0 for the exact answer (surrounding whitespace ignored), else 0.0."""
    return 1.0 if text.strip() == payload["answer"] else 0.0


def build_reward(cfg: TaskConfig):
    """`reward`, with task.kwargs.partial_credit (in [0, 1)) for a wrong answer instead of 0.0."""
    partial = cfg.kwargs.get("partial_credit", 0.0)
    if isinstance(partial, bool) or not isinstance(partial, int | float) or not 0.0 <= partial < 1.0:
        raise ConfigError(
            f"task.kwargs.partial_credit = {partial!r}: the reward of a wrong answer must be a number "
            "in [0, 1) (a right one earns 1.0)"
        )
    if not partial:
        return reward

    def partial_credit_reward(text: str, payload: dict[str, str]) -> float:
        return reward(text, payload) or float(partial)

    return partial_credit_reward
