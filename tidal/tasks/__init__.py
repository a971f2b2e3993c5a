"""Tasks: each module makes its prompts (for the learner's coordinator) and scores completions
(for the actors). A task module exposes `load_prompts(cfg) -> Split`, `reward(text, payload)` and
`ALPHABET`, the characters the tiny model's tokenizer is built from (tasks for real models raise on it).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Prompt:
    prompt_id: int  # stable across runs (curriculum and eval key)
    text: str
    payload: dict[str, str]  # what the reward needs, e.g. {"answer": "85"}


@dataclass(frozen=True)
class Split:
    train: list[Prompt]
    val: list[Prompt]  # held out: never trained on


TASKS = ("arithmetic", "math")


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt token ids exactly as actors and learner see them (no special tokens added)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def get_task(name: str) -> ModuleType:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r} (config key task.name); known: {', '.join(TASKS)}")
    return importlib.import_module(f"tidal.tasks.{name}")


def get_reward(name: str) -> Callable[[str, dict[str, str]], float]:
    return get_task(name).reward
