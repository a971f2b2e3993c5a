"""Environments: an episode alternates model turns and environment replies until the environment
says it is done or a budget runs out. A task module offers one by defining `Environment` (a
subclass of `Env`, built with the task's config) instead of `reward`; a task with only `reward`
is the one-turn case, `SingleTurn`, run by the same episode loop.

    start(payload) -> state                         once per episode (sample)
    step(state, reply) -> Turn(messages, done, reward, components)
                                                    after every model turn without a tool call
    finish(state)                                   once the episode is over, however it ended (optional)
    tools() -> [callables]                          offered to the model; the actor runs its calls

`start` and `step` may be `async`; plain functions run on a worker thread, so a slow one never
stalls the actor. The model's turns reach the environment as text, a `Reply` (a str that also holds
the turn's token ids and the prompt as the model read it: decoded for reading only, the tokens the
model sampled are the ones trained on); what the environment answers is rendered by
`ChatRenderer` through the tokenizer's chat template and appended as tokens the model reads but is
never trained on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal.config import ConfigError
from tidal.tasks.user_code import def_line

Message = dict[str, Any]  # a chat message as chat templates take it: {"role", "content", ...}


@dataclass
class Turn:
    """The environment's answer to one model turn."""

    messages: list[Message] = field(default_factory=list)  # appended to the conversation (role user or tool)
    done: bool = False  # the episode is over: the model gets no further turn
    reward: float | None = None  # added to the episode's reward (most environments give one, with done)
    # the reward's named parts (task.reward_funcs: each function's value), logged and shown by name
    components: dict[str, float] = field(default_factory=dict)


class Reply(str):
    """A model turn as `Env.step` receives it: its text, with the token ids it was sampled as
    (`token_ids`) and the prompt as the model read it (`prompt`, decoded on first use)."""

    def __new__(cls, text: str, token_ids: Sequence[int] = (), prompt: Callable[[], str] | str = ""):
        reply = super().__new__(cls, text)
        reply.token_ids, reply._prompt = token_ids, prompt
        return reply

    @property
    def prompt(self) -> str:
        if callable(self._prompt):
            self._prompt = self._prompt()
        return self._prompt


class Env:
    """An environment; one instance serves every episode of a run (keep per-episode data in the state).
    `max_turns` (optional) caps model turns below `env.max_turns`."""

    max_turns: int | None = None
    options: dict[str, str] | None = None  # the env.kwargs it reads, name -> help; None: not declared, not checked

    def __init__(self, cfg=None, kwargs: dict | None = None):
        self.cfg = cfg  # the task's config (TaskConfig)
        self.kwargs = dict(kwargs or {})  # env.kwargs: the environment's own options
        unknown = sorted(set(self.kwargs) - set(self.options)) if self.options is not None else []
        if unknown:
            raise ConfigError(
                f"config key 'env.kwargs.{unknown[0]}': {type(self).__name__} has no such option "
                f"({options_text(self.options)})"
            )

    def tools(self) -> Sequence[Callable]:
        """Python callables the model may call, each with type hints and a docstring with Args (its
        schema is read from them, for the chat template); none by default."""
        return ()

    def start(self, payload: dict[str, str]) -> Any:
        """The new episode's state, from the prompt's payload (a copy of it by default)."""
        return dict(payload)

    def step(self, state: Any, reply: str) -> Turn:
        raise NotImplementedError(f"{type(self).__name__}.step")

    def finish(self, state: Any) -> None:
        """Release what the episode holds (a connection, a sandbox): called once it is over, whether the
        environment ended it, a budget did or it failed."""


def options_text(options: dict[str, str]) -> str:
    """'its options: a (what a is), b (what b is)', or 'it takes none'."""
    return "its options: " + ", ".join(f"{k} ({v})" for k, v in options.items()) if options else "it takes none"


class SingleTurn(Env):
    """A task's reward(text, payload) as an environment: one turn, scored, done."""

    max_turns = 1

    def __init__(self, reward: Callable[[str, dict[str, str]], float]):
        super().__init__()
        self.reward = reward

    def step(self, state: dict[str, str], reply: str) -> Turn:
        return Turn(done=True, reward=float(self.reward(reply, state)))


def tool_schemas(tools: Sequence[Callable]) -> list[dict]:
    """Each tool's JSON schema, read from its signature and docstring (the form chat templates take)."""
    if not tools:
        return []
    from transformers.utils import get_json_schema

    out = []
    for tool in tools:
        try:
            out.append(get_json_schema(tool))
        except Exception as err:  # transformers names what the docstring or hints lack
            at = def_line(tool)
            raise ConfigError(
                f"tool {getattr(tool, '__name__', tool)!r}{f' at {at}' if at else ''}: {err} (a tool "
                "needs type hints and a docstring with an Args: line per parameter)"
            ) from None
    return out


def is_async(fn: Callable) -> bool:
    """A coroutine function, or an object whose __call__ is one (a callable class instance)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class ChatRenderer:
    """Environment messages -> the tokens that follow a model turn, through the chat template.

    The increment is what the template writes after an assistant message's content (its end-of-turn
    text, past the stop token the model sampled itself), then the new messages, then the prompt of
    the next assistant turn: rendered once with and once without the new messages after a fixed
    conversation, and the difference taken. Without a chat template, the messages' contents are
    appended as they are."""

    PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]

    def __init__(self, tokenizer, chat_template: bool, tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.chat_template = bool(chat_template and getattr(tokenizer, "chat_template", None))
        self.closing = self._closing() if self.chat_template else ""

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _closing(self) -> str:
        probe = self._render(self.PROBE, False)
        return probe[probe.rindex("y") + 1 :]

    def increment(self, messages: list[Message], stop_text: str | None) -> list[int]:
        """Token ids of `messages` after a model turn; `stop_text` is the text of the stop token that
        ended the turn (None: the turn ended without one, so the whole end-of-turn text is added)."""
        if not self.chat_template:
            text = "".join(str(m.get("content", "")) for m in messages)
        else:
            before = self._render(self.PROBE, False)
            after = self._render(self.PROBE + list(messages), True)
            if not after.startswith(before):
                raise ValueError(
                    "the chat template renders earlier messages differently once more follow; "
                    "its increments cannot be taken"
                )
            closing = self.closing
            if stop_text and closing.startswith(stop_text):
                closing = closing[len(stop_text) :]
            text = closing + after[len(before) :]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def bad_messages(messages: list) -> str | None:
    """Chat messages: a non-empty list of {"role": str, "content": str}."""
    if not messages:
        return "holds no chat messages"
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f'message {i} is not {{"role": str, "content": str}}: {repr(m)[:60]}'
    return None
