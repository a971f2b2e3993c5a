"""task.*, sampling.* and env.*: the prompts and rewards, how actors sample each prompt group
(with its length control: interruptions or the overlong penalty), and multi-turn episodes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from tidal.config.base import Section, _require, opt


@dataclass(frozen=True)
class TaskConfig(Section):
    """The task: prompts for the coordinator, the reward for the actors."""

    name: str = opt(
        "arithmetic",
        "built-in (arithmetic, chain, count, math, rows, skyrl), installed (entry-point "
        "group tidal.tasks) or an import path (my_pkg.my_task)",
    )
    kwargs: dict[str, Any] = opt({}, "options of the task itself, e.g. {tolerance: 0.01}")
    max_operand: int = opt(99, "arithmetic: operands are drawn from 0..max_operand")
    num_val: int = opt(256, "held-out prompts for evaluation (never trained on); math: at most this many")
    seed: int = opt(0, "split seed")
    data_path: str = opt(
        "", "training prompts: a JSON Lines (.jsonl, .json) or Parquet file, a folder of them, or a Hub dataset id"
    )
    data_config: str = opt("", "Hub datasets: the configuration (subset) name; empty = the default")
    data_split: str = opt("train", "folders and Hub datasets: the split of data_path to train on")
    val_path: str = opt(
        "", "held-out prompts (num_val drawn by seed), read like data_path; empty = split off data_path"
    )
    val_split: str = opt("test", "folders and Hub datasets: the split of val_path")
    prompt_field: str = opt(
        "problem",
        "the column holding each prompt: a string, or chat messages [{role, content}, "
        "...] (TRL's conversational format)",
    )
    answer_field: str = opt("answer", 'the column holding the gold answer, e.g. "\\\\frac{1}{2}" or "12"')
    prompt_template: str = opt(
        "{problem}\nPut the final answer in \\boxed{{}}.",
        "task math's string prompts (the other built-in tasks refuse it; rows sends each prompt as it is): the text; "
        "{<prompt_field>} is replaced by the prompt, {{ and }} are literal braces",
    )
    chat_template: bool = opt(
        False,
        "apply the tokenizer's chat template (a string prompt becomes one user message; chat messages always get it)",
    )
    system_prompt: str = opt("", "with a chat template: a system message first, unless the prompt's messages have one")
    reward_range: tuple[float, float] = opt(
        (-10.0, 10.0),
        "rollouts with a reward outside it are rejected, counted; "
        "config check refuses a scored row's reward outside it",
    )
    pass_threshold: float = opt(
        1.0,
        "a sample passes when its reward is at least this: pass rates (rollout/, eval/), "
        "the curriculum and the scaling fits count passes by it, whatever the reward's "
        "scale (partial credit, summed components)",
    )
    reward_funcs: list[str] = opt(
        [],
        "reward functions, each an import path (my_pkg.rewards:accuracy or "
        "my_pkg.rewards.accuracy; the working folder is importable), a file's function "
        "(./my_rewards.py:accuracy) or a name in the entry-point group tidal.rewards, "
        "called with prompt, completion, completion_ids and every column of the row; the "
        "sample's reward is their weighted sum (instead of the task's own reward)",
    )
    reward_weights: list[float] = opt([], "one per reward function; empty = all 1.0")
    pass_on: str = opt(
        "",
        "the reward function (by name) whose value says whether a sample passed, compared with "
        "pass_threshold: the accuracy of accuracy + 0.2 x format, so a format bonus is no pass; "
        "empty = the weighted sum (the reward)",
    )
    remote_timeout_s: float = opt(
        30.0,
        "a remote reward (an http:// or https:// URL in reward_funcs): each POST of a "
        "batch, its whole reply included, ends within this long",
    )
    remote_retries: int = opt(2, "more tries of a remote reward's failed POST (error status, timeout, refused)")

    def check(self) -> None:
        low, high = self.reward_range
        _require(low < high, "task.reward_range", list(self.reward_range), "expected [low, high] with low < high")
        funcs, weights = self.reward_funcs, self.reward_weights
        _require(
            all(isinstance(f, str) and f.strip() for f in funcs),
            "task.reward_funcs",
            list(funcs),
            "each an import path (my_pkg.rewards:accuracy) or an entry-point name",
        )
        _require(
            not weights or len(weights) == len(funcs),
            "task.reward_weights",
            list(weights),
            f"one weight per reward function ({len(funcs)} in task.reward_funcs), or none for all 1.0",
        )
        _require(
            all(abs(w) < float("inf") for w in weights), "task.reward_weights", list(weights), "weights must be finite"
        )
        _require(
            not self.pass_on or bool(funcs),
            "task.pass_on",
            self.pass_on,
            "names one of task.reward_funcs, and there are none",
        )
        _require(self.remote_timeout_s > 0, "task.remote_timeout_s", self.remote_timeout_s, "must be > 0")
        _require(self.remote_retries >= 0, "task.remote_retries", self.remote_retries, "must be >= 0")


def reward_file(spec: str) -> tuple[str, str] | None:
    """(the file, the function's name or "") of a task.reward_funcs entry naming a Python file's function,
    verl's way (`./my_rewards.py:accuracy`, `my_rewards.py:accuracy`, `rewards/my.py:f`); None for an
    import path, an entry-point name or a URL."""
    if spec.startswith(("http://", "https://")):
        return None
    path, _, attr = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if not (path.endswith(".py") or "/" in path or os.sep in path):
        return None
    return path, attr


def absolute_reward_files(specs: list[str]) -> list[str]:
    """task.reward_funcs with each file made absolute (from the working folder), so that the processes a
    run starts, and a config.yaml read elsewhere, find the same file."""
    out = []
    for spec in specs:
        in_file = reward_file(spec)
        out.append(
            spec
            if in_file is None
            else os.path.abspath(os.path.expanduser(in_file[0])) + (f":{in_file[1]}" if in_file[1] else "")
        )
    return out


@dataclass(frozen=True)
class InterruptConfig(Section):
    """ScaleRL forced interruptions: a sample still going at its thinking budget (drawn uniformly per
    sample from [min_tokens, max_tokens]) gets `text` appended and `answer_tokens` more to answer."""

    enabled: bool = opt(False, "interrupt training samples that reach their thinking budget")
    min_tokens: int = opt(0, "smallest thinking budget (tokens); required (>= 1) when enabled")
    max_tokens: int = opt(0, "largest thinking budget (tokens); required (>= min_tokens) when enabled")
    text: str = opt("\n\nOkay, time is up. Let me give my final answer now.\n\n", "injected; never trained on")
    answer_tokens: int = opt(0, "budget after the interruption (tokens); required (>= 1) when enabled")
    eval: bool = opt(False, "interrupt eval groups too (pass rate under the same thinking budget)")


@dataclass(frozen=True)
class OverlongConfig(Section):
    """DAPO overlong penalty on training rewards, the alternative to interruptions: a completion of L
    tokens gets min(0, (sampling.max_tokens - buffer_tokens - L) / buffer_tokens) added to its reward."""

    enabled: bool = opt(False, "shape the rewards of training samples (eval rewards never)")
    buffer_tokens: int = opt(0, "L_cache: the penalty falls from 0 to -1 over these last tokens; required when enabled")


@dataclass(frozen=True)
class SamplingConfig(Section):
    """How actors sample each prompt group (travels inside every PromptGroup)."""

    n: int = opt(8, "samples per prompt")
    temperature: float = opt(1.0, "behavior temperature; the learner uses the same one")
    top_p: float = opt(
        1.0,
        "nucleus sampling: keep the most likely tokens holding this much mass (1.0: all); the "
        "learner scores the same truncated sampler",
    )
    top_k: int = opt(0, "keep the k most likely tokens, before top_p (0: all); the learner scores the same sampler")
    max_tokens: int = opt(1024, "completion token budget (interruption text and answer included)")
    interrupt: InterruptConfig = field(default_factory=InterruptConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)

    def check(self) -> None:
        _require(self.n >= 2, "sampling.n", self.n, "group-relative advantages need at least 2 samples")
        _require(self.temperature > 0, "sampling.temperature", self.temperature, "must be > 0")
        _require(0 < self.top_p <= 1, "sampling.top_p", self.top_p, "must be in (0, 1]")
        _require(self.top_k >= 0, "sampling.top_k", self.top_k, "must be >= 0 (0 keeps every token)")
        _require(self.max_tokens >= 1, "sampling.max_tokens", self.max_tokens, "must be >= 1")
        self.check_length_control()

    def check_length_control(self) -> None:
        """Interruptions or the overlong penalty, each enabled one's keys fitting sampling.max_tokens."""
        it, ol = self.interrupt, self.overlong
        _require(
            not (it.enabled and ol.enabled),
            "sampling.overlong.enabled",
            ol.enabled,
            "interruptions and the overlong penalty are alternatives: enable one of them",
        )
        if it.enabled:
            _require(it.min_tokens >= 1, "sampling.interrupt.min_tokens", it.min_tokens, "must be >= 1")
            _require(
                it.max_tokens >= it.min_tokens,
                "sampling.interrupt.max_tokens",
                it.max_tokens,
                f"must be >= sampling.interrupt.min_tokens = {it.min_tokens}",
            )
            _require(it.answer_tokens >= 1, "sampling.interrupt.answer_tokens", it.answer_tokens, "must be >= 1")
            _require(bool(it.text), "sampling.interrupt.text", it.text, "must not be empty")
            # the text's token count is known once tokenized: the learner checks the exact sum then
            _require(
                it.max_tokens + it.answer_tokens < self.max_tokens,
                "sampling.interrupt.max_tokens",
                it.max_tokens,
                f"+ answer_tokens {it.answer_tokens} + the text's tokens must fit "
                f"sampling.max_tokens {self.max_tokens}",
            )
        if ol.enabled:
            _require(
                1 <= ol.buffer_tokens < self.max_tokens,
                "sampling.overlong.buffer_tokens",
                ol.buffer_tokens,
                f"must be in [1, sampling.max_tokens = {self.max_tokens})",
            )


@dataclass(frozen=True)
class EnvConfig(Section):
    """Episodes of several turns (tasks that define an Environment): their budgets and tool calls.
    An episode's tokens, the environment's and tools' included, stay within sampling.max_tokens."""

    max_turns: int = opt(8, "model turns per episode (one that calls tools counts); the environment may set fewer")
    step_timeout_s: float = opt(60.0, "an environment's start or step that takes longer fails its episode (reward 0)")
    tool_parser: str = opt(
        "hermes", "vLLM's tool-call parser for the model's format (hermes, pythonic, llama3_json, ...)"
    )
    max_tool_calls: int = opt(4, "tool calls run per model turn; more are answered with an error")
    tool_timeout_s: float = opt(10.0, "a tool call that takes longer is answered with an error")
    tool_output_chars: int = opt(2000, "a tool's output beyond this is cut, and the model told how much was cut")
    kwargs: dict[str, Any] = opt({}, "options of the task's environment (its self.kwargs)")

    def check(self) -> None:
        # each turn after the first adds one span of injected tokens, and a sample carries at most 1024
        _require(1 <= self.max_turns <= 1000, "env.max_turns", self.max_turns, "must be in [1, 1000]")
        _require(self.max_tool_calls >= 0, "env.max_tool_calls", self.max_tool_calls, "must be >= 0")
        for key in ("step_timeout_s", "tool_timeout_s"):
            _require(getattr(self, key) > 0, f"env.{key}", getattr(self, key), "must be > 0")
        _require(self.tool_output_chars >= 1, "env.tool_output_chars", self.tool_output_chars, "must be >= 1")
