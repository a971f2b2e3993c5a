"""Tool calls on the actor: found in a model turn by vLLM's parser for the model's format, run with a
time limit and an output limit, answered as tool messages. Nothing a tool does stops the actor:
an unknown tool, bad arguments, an exception or a timeout becomes an error message the model reads.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tidal.config import EnvConfig
from tidal.tasks import Message, is_async, one_line, raised_by

log = logging.getLogger(__name__)

TOOL_THREADS = 32  # sync tools run here, apart from rewards and environment steps: a hung one holds one thread


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCallParser:
    """The tool calls in a model turn, read by vLLM's parser `name` (env.tool_parser)."""

    def __init__(self, name: str, tokenizer):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        try:
            parser_class = ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise ValueError(
                f"config key 'env.tool_parser' = {name!r}: vLLM has no such tool parser "
                f"({', '.join(sorted(ToolParserManager.list_registered()))})"
            ) from None
        self.parser = parser_class(tokenizer)
        self.request = ChatCompletionRequest(messages=[], model="tidal")  # the parsers read no field of it here
        # a call the model garbled is the model's mistake, answered below; vLLM would log each with a traceback
        logging.getLogger(parser_class.__module__).setLevel(logging.CRITICAL)
        self.start_marker = getattr(self.parser, "tool_call_start_token", None)

    def parse(self, reply: str) -> tuple[list[ToolCall], bool]:
        """The calls, and whether the turn began a call that could not be read."""
        info = self.parser.extract_tool_calls(reply, self.request)
        calls = [
            ToolCall(c.id or f"call-{i}", c.function.name, c.function.arguments or "{}")
            for i, c in enumerate(info.tool_calls if info.tools_called else [])
        ]
        garbled = not calls and bool(self.start_marker) and self.start_marker in reply
        return calls, garbled


@dataclass
class ToolOutcome:
    message: Message
    status: str  # ok | error | timeout


class ToolRunner:
    """Runs an environment's tools by name with env.tool_timeout_s and env.tool_output_chars."""

    def __init__(self, tools: Sequence[Callable], cfg: EnvConfig):
        self.tools = {tool.__name__: tool for tool in tools}
        self.cfg = cfg
        self.pool = ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="tidal-tool") if tools else None
        self.failures: Counter[tuple[str, str, str]] = Counter()  # (tool, error type, where) -> times

    async def run(self, calls: list[ToolCall]) -> list[ToolOutcome]:
        """Every call answered, in order; those beyond env.max_tool_calls with an error."""
        limit = self.cfg.max_tool_calls
        outcomes = await asyncio.gather(*(self.call(c) for c in calls[:limit]))
        extra = [
            ToolOutcome(self.message(c, f"error: more than {limit} tool calls in one turn"), "error")
            for c in calls[limit:]
        ]
        return [*outcomes, *extra]

    async def call(self, call: ToolCall) -> ToolOutcome:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolOutcome(
                self.message(call, f"error: no tool named {call.name!r} (tools: {', '.join(self.tools) or 'none'})"),
                "error",
            )
        try:
            kwargs = json.loads(call.arguments)
        except json.JSONDecodeError as err:
            kwargs, problem = None, f"arguments are not JSON ({err})"
        else:
            problem = "" if isinstance(kwargs, dict) else "arguments are not a JSON object"
        if problem:
            return ToolOutcome(self.message(call, f"error: {problem}"), "error")
        try:
            output = await asyncio.wait_for(self.invoke(tool, kwargs), self.cfg.tool_timeout_s)
        except TimeoutError:
            return ToolOutcome(
                self.message(call, f"error: {call.name} took longer than {self.cfg.tool_timeout_s:g} s"), "timeout"
            )
        except Exception as err:  # the tool's own failure: the model reads it, as from any API
            self.note_failure(call.name, err)
            return ToolOutcome(self.message(call, f"error: {type(err).__name__}: {err}"), "error")
        return ToolOutcome(self.message(call, str(output)), "ok")

    def note_failure(self, name: str, err: Exception) -> None:
        """A tool's own error in the actor's log at the user's file and line, at the 1st, 10th, 100th, ...
        of each kind: the model reads each one, so a bug in the tool would otherwise pass for the model's."""
        _, where = raised_by(err)
        kind = (name, type(err).__name__, where)
        self.failures[kind] += 1
        times = self.failures[kind]
        if str(times).rstrip("0") == "1":
            log.warning(
                "tool %s raised %s (%d time%s so far)%s",
                name,
                one_line(err),
                times,
                "s" * (times > 1),
                f"\n{where}" if where else "",
            )

    async def invoke(self, tool: Callable, kwargs: dict):
        if is_async(tool):
            return await tool(**kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: tool(**kwargs))

    def message(self, call: ToolCall, content: str) -> Message:
        return {
            "role": "tool",
            "name": call.name,
            "tool_call_id": call.id,
            "content": truncate(content, self.cfg.tool_output_chars),
        }

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def truncate(text: str, limit: int) -> str:
    """The first `limit` characters of `text`, and a line saying how many more were cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[cut: {len(text) - limit} more characters]"
