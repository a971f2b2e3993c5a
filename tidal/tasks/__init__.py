"""Tasks: each makes its prompts (for the learner's coordinator) and scores completions (for the
actors). A task is a module with

    load_prompts(cfg: TaskConfig) -> Split          training and held-out prompts
    reward(text: str, payload: dict) -> float       on any scale; a pass is a reward >= task.pass_threshold
                                                    (default 1.0); or build_reward(cfg) -> that function;
                                                    or Environment: an Env subclass, for episodes of several
                                                    turns and tool calls (tidal.tasks.env)
    ALPHABET (optional)                             characters the tiny model's tokenizer is built from
    MAX_POSITIONS (optional)                        the tiny model's context length (default 64)
    teacher_slip(answer, rng) -> str (optional)     the tiny model's warm-start teacher when sloppy

Or no module at all: `task.name=rows` reads task.data_path and scores with `task.reward_funcs`, plain
functions called with the prompt, the completion and every column of the row (tidal.tasks.rewards).

`task.name` is a built-in task (arithmetic, count, math, rows), one installed under the entry-point group
`tidal.tasks`, or an import path (`my_pkg.my_task`); `task.kwargs` holds its own options. Prompts
become token ids once, on the learner (`PromptEncoder`): actors receive tokens, so both sides see
exactly the same prompt, chat template and system prompt included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import ModuleType

from tidal.config import ConfigError, TaskConfig
from tidal.tasks.env import ChatRenderer, Env, Message, Reply, SingleTurn, Turn, bad_messages, is_async, tool_schemas
from tidal.tasks.rewards import RewardFailed
from tidal.tasks.user_code import failure, import_module, one_line, raised_by

# what the actor needs of tasks (it imports nothing else of them): environments, their turns, chat messages
# and how user code that failed is named
__all__ = [
    "ChatRenderer",
    "Env",
    "Message",
    "Prompt",
    "PromptEncoder",
    "Reply",
    "RewardFailed",
    "SingleTurn",
    "Split",
    "Turn",
    "bad_messages",
    "encode_prompt",
    "failure",
    "get_environment",
    "get_reward",
    "get_task",
    "installed_tasks",
    "is_async",
    "one_line",
    "raised_by",
    "tool_schemas",
]

BUILTIN = {
    "arithmetic": "tidal.tasks.arithmetic",
    "chain": "tidal.tasks.chain",
    "count": "tidal.tasks.count",
    "math": "tidal.tasks.math",
    "rows": "tidal.tasks.data",
    "skyrl": "tidal.tasks.skyrl",
}
ENTRY_POINTS = "tidal.tasks"

Reward = Callable[[str, dict[str, str]], float]


@dataclass(frozen=True)
class Prompt:
    prompt_id: int  # stable across runs (curriculum and eval key)
    text: str  # the prompt as text; empty when it is chat messages
    payload: dict[str, str]  # what the reward needs, e.g. {"answer": "85"}
    messages: tuple[dict[str, str], ...] | None = None  # chat messages [{role, content}, ...] instead of text


@dataclass(frozen=True)
class Split:
    train: list[Prompt]
    val: list[Prompt]  # held out: never trained on


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Raw text's token ids exactly as actors and learner see them (no special tokens added)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class PromptEncoder:
    """Prompt -> token ids: the raw text, or chat messages through the tokenizer's chat template
    (with `task.chat_template` a string prompt becomes one user message), a system prompt first, and
    the environment's tools (their schemas) where the template lists them."""

    def __init__(
        self, tokenizer, chat_template: bool = False, system_prompt: str = "", tools: list[dict] | None = None
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.tools = tools or None
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "config key 'task.chat_template' = True: the tokenizer at model.path has no chat template"
            )

    @classmethod
    def for_task(cls, tokenizer, cfg: TaskConfig, env_kwargs: dict | None = None) -> PromptEncoder:
        """The encoder of `cfg`'s prompts, its environment's tools (built with `env_kwargs`) listed."""
        tools = tool_schemas(get_environment(cfg, env_kwargs).tools())
        return cls(tokenizer, cfg.chat_template, cfg.system_prompt, tools)

    def __call__(self, prompt: Prompt) -> list[int]:
        if prompt.messages is None and not (self.chat_template or self.tools):
            return encode_prompt(self.tokenizer, prompt.text)
        messages = list(prompt.messages or [{"role": "user", "content": prompt.text}])
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                f"prompt {prompt.prompt_id} holds chat messages but the tokenizer at model.path has no chat template"
            )
        # rendered, then tokenized without special tokens: the template writes them itself
        text = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=True, tokenize=False
        )
        return encode_prompt(self.tokenizer, text)


def installed_tasks() -> dict[str, str]:
    """Task name -> module, built-in and installed (entry-point group tidal.tasks)."""
    return BUILTIN | {ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS)}


def get_task(name: str) -> ModuleType:
    """The task module `name` names; a ConfigError naming task.name when there is none or it is incomplete."""
    known = installed_tasks()
    module_name = known.get(name) or (name if "." in name else None)
    if module_name is None:
        raise ConfigError(
            f"config key 'task.name' = {name!r}: not a known task ({', '.join(sorted(known))}) nor "
            "an import path (my_pkg.my_task)"
        )
    # the working folder imports; a syntax error or a raise at import is one line at the user's own line
    module = import_module(module_name, f"config key 'task.name' = {name!r}")
    missing = [f for f in ("load_prompts",) if not callable(getattr(module, f, None))]
    if not any(callable(getattr(module, f, None)) for f in ("reward", "build_reward", "Environment")):
        missing.append("reward (or build_reward, or Environment)")
    if missing:
        raise ConfigError(f"config key 'task.name' = {name!r}: {module_name} has no {' and no '.join(missing)}")
    return module


def get_reward(cfg: TaskConfig) -> Reward:
    """The task's reward function, built from its config when the task asks (build_reward)."""
    module = get_task(cfg.name)
    build = getattr(module, "build_reward", None)
    if not callable(build) and not callable(getattr(module, "reward", None)):
        raise ConfigError(
            f"config key 'task.name' = {cfg.name!r}: {module.__name__} is an environment of "
            "episodes (Environment), with no reward of one completion to score alone"
        )
    return build(cfg) if callable(build) else module.reward


def get_environment(cfg: TaskConfig, env_kwargs: dict | None = None) -> Env:
    """The task's environment: task.reward_funcs as one turn (tidal.tasks.rewards), its Environment built
    with its config and `env_kwargs` (env.kwargs), or its reward as one turn."""
    module = get_task(cfg.name)
    env_class = getattr(module, "Environment", None)
    if cfg.reward_funcs:
        from tidal.tasks.rewards import Rewarded

        if env_class is not None:
            raise ConfigError(
                f"config key 'task.reward_funcs' = {list(cfg.reward_funcs)}: task {cfg.name!r} is an "
                "environment of episodes, scored by its own steps"
            )
        return Rewarded(cfg)
    if env_class is None:
        return SingleTurn(get_reward(cfg))
    if not (isinstance(env_class, type) and issubclass(env_class, Env)):
        raise ConfigError(
            f"config key 'task.name' = {cfg.name!r}: {module.__name__}.Environment is not a subclass of tidal.tasks.Env"
        )
    return env_class(cfg, env_kwargs)
