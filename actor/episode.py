"""Episodes: each sample of a group is one episode of the task's environment, token for token.

    turn 1 of the group's n episodes: one request of n samples (length_control.generate)
    each episode:  reply ──tool calls?──yes──► ToolRunner ──► tool messages ──┐
                     │                                                      │
                     └──no──► env.step(state, reply) ──► Turn(messages, done, reward)
                                                                           │
        done, env.max_turns or sampling.max_tokens reached ◄───────────────┤
        else: the messages through the chat template (ChatRenderer) ──► injected tokens
              ──► next request: prompt + every token so far, as token ids ──► reply

The model's tokens are never decoded and encoded again: each request is the prompt followed by the
tokens sampled and injected so far (prefix caching makes the repeated prefix cheap), and the
completion the learner trains on is exactly those tokens, the injected ones masked out
(`injected_spans`). A single-turn task is an environment whose first step is done.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from dataclasses import asdict, dataclass, field

from tidal.actor.engine import Completion
from tidal.actor.length_control import generate
from tidal.actor.sample import Transcript, to_sample
from tidal.actor.tools import ToolCallParser, ToolRunner
from tidal.broker.schema import Episode, PromptGroup, SampleArrays, SamplingParams
from tidal.config import EnvConfig, TaskConfig
from tidal.tasks import (
    ChatRenderer,
    Env,
    Message,
    Reply,
    RewardFailed,
    Turn,
    bad_messages,
    failure,
    get_environment,
    is_async,
    tool_schemas,
)

log = logging.getLogger(__name__)


class EnvFailed(Exception):
    """The environment raised, timed out or answered with something that is not a Turn."""


def checked_components(env: str, components) -> dict[str, float]:
    """A Turn's named reward parts as the wire carries them: names to finite numbers."""
    if not isinstance(components, dict):
        raise EnvFailed(f"{env}.step's components: not a dict of names to numbers")
    try:
        checked = {str(name): float(value) for name, value in components.items()}
    except (TypeError, ValueError) as err:
        raise EnvFailed(f"{env}.step's components: {err}") from None
    bad = [name for name, value in checked.items() if not math.isfinite(value)]
    if bad:
        raise EnvFailed(f"{env}.step's component {bad[0]!r} is not finite ({checked[bad[0]]})")
    return checked


@dataclass
class EpisodeResult:
    completion: Completion
    reward: float
    episode: Episode | None  # None for a single-turn task's episode that went as expected
    messages: list[Message] = field(default_factory=list)  # the conversation after the prompt, for tables
    components: dict[str, float] = field(default_factory=dict)  # the reward's named parts (task.reward_funcs)

    def sample(self, params: SamplingParams) -> SampleArrays:
        """The wire sample (the overlong penalty added when the group asks for one)."""
        return to_sample(self.completion, self.reward, params, self.episode, self.components)


@dataclass
class Counts:  # the fields of the wire's Episode, counted as the episode runs
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    env_seconds: float = 0.0
    env_error: str = ""


class ThreadBatches:
    """Plain-function calls made in one pass of the event loop run in one hop to a worker thread, in
    order, rather than a hop each: a group's episodes all ask at once after their first turns, so a
    single-turn task's rewards cost one hop per group, as they did before episodes. A call that hangs
    holds the calls after it in its batch (each then fails at its own timeout)."""

    def __init__(self):
        self.pending: list[tuple] = []

    def call(self, fn, *args) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((fn, args, future))
        if len(self.pending) == 1:
            loop.call_soon(self._flush, loop)
        return future

    def _flush(self, loop) -> None:
        batch, self.pending = self.pending, []

        def work() -> None:
            for fn, args, future in batch:
                try:
                    outcome = (True, fn(*args))
                except Exception as err:
                    outcome = (False, err)
                loop.call_soon_threadsafe(self._settle, future, *outcome)

        loop.run_in_executor(None, work)

    @staticmethod
    def _settle(future: asyncio.Future, ok: bool, value) -> None:
        if not future.done():  # one whose wait timed out was cancelled
            future.set_result(value) if ok else future.set_exception(value)


class Episodes:
    """Runs a group's samples as episodes of `env` (one instance for every episode of the run)."""

    def __init__(self, env: Env, cfg: EnvConfig, tokenizer, chat_template: bool):
        tools = list(env.tools())
        self.env = env
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer, chat_template, tool_schemas(tools))
        self.parser = ToolCallParser(cfg.tool_parser, tokenizer) if tools else None
        self.tools = ToolRunner(tools, cfg)
        self.max_turns = min(cfg.max_turns, env.max_turns or cfg.max_turns)
        self.multi_turn = self.max_turns > 1 or bool(tools)
        self._stop_texts: dict[int, str] = {}
        self.threads = ThreadBatches()

    @classmethod
    def of(cls, task: TaskConfig, env: EnvConfig, tokenizer) -> Episodes:
        """The episodes of `task`'s environment, built with env.kwargs."""
        return cls(get_environment(task, env.kwargs), env, tokenizer, task.chat_template)

    async def run(self, engine, group: PromptGroup) -> list[EpisodeResult]:
        """The group's n episodes: their first turns sampled together, then each on its own."""
        first = await generate(engine, group)  # with forced interruptions when the group asks
        prompt = group.prompt_tokens.numpy("i4", "prompt_tokens").tolist()
        prompt_text = functools.cache(lambda: self.tokenizer.decode(prompt))  # once a group, if a step asks
        return list(
            await asyncio.gather(
                *(self.episode(engine, group, prompt, i, turn, prompt_text) for i, turn in enumerate(first))
            )
        )

    async def episode(
        self, engine, group: PromptGroup, prompt: list[int], index: int, turn: Completion, prompt_text
    ) -> EpisodeResult:
        transcript, counts, messages, components = Transcript().add_sampled(turn), Counts(), [], {}
        reward, finish, state, started = 0.0, turn.finish_reason, None, False
        try:
            state = await self.begin(counts, group.payload)
            started = True
            while True:
                messages.append({"role": "assistant", "content": turn.text})
                reply = Reply(turn.text, turn.tokens.tolist(), prompt_text)
                answer, done, gained = await self.respond(counts, state, turn, reply, components)
                messages.extend(answer)
                reward += gained
                if done or counts.turns >= self.max_turns or turn.finish_reason == "length":
                    break
                increment = self.render(answer, turn)
                room = group.sampling.max_tokens - transcript.size - len(increment)
                if room < 1:  # the environment's reply does not fit: the episode ends at its budget
                    finish = "length"
                    break
                transcript.add_injected(increment, self.tokenizer.decode(increment))
                [turn] = await engine.sample(
                    prompt + transcript.token_ids(),
                    1,
                    group.sampling,
                    request_id=f"{group.group_id}-e{index}-t{counts.turns}",
                    max_tokens=room,
                )
                transcript.add_sampled(turn)
                counts.turns += 1
                finish = turn.finish_reason
        except EnvFailed as err:
            reward, counts.env_error, components = 0.0, str(err)[:512], {}
            log.warning("group %s episode %d scored as failed: %s", group.group_id, index, err)
        if started:
            await self.release(counts, state)
        stats = Episode(**asdict(counts)) if self.multi_turn or counts.env_error else None
        return EpisodeResult(transcript.completion(finish), reward, stats, messages, components)

    async def respond(
        self, counts: Counts, state, turn: Completion, reply: Reply, components: dict[str, float]
    ) -> tuple[list[Message], bool, float]:
        """What answers the model's turn: its tool calls' outputs, or the environment's step (its reward's
        named parts added to `components`)."""
        if self.parser is not None and turn.finish_reason != "length":
            calls, garbled = self.parser.parse(turn.text)
            if calls or garbled:
                start = time.perf_counter()
                outcomes = await self.tools.run(calls)
                counts.env_seconds += time.perf_counter() - start
                answer = [o.message for o in outcomes]
                if garbled:
                    answer.append({"role": "tool", "name": "", "content": "error: the tool call could not be read"})
                counts.tool_calls += len(answer)
                counts.tool_errors += sum(o.status == "error" for o in outcomes) + garbled
                counts.tool_timeouts += sum(o.status == "timeout" for o in outcomes)
                return answer, False, 0.0
        result = await self.call_env(counts, self.env.step, state, reply)
        if not isinstance(result, Turn):
            raise EnvFailed(f"{type(self.env).__name__}.step returned {type(result).__name__}, not a Turn")
        messages = result.messages or []
        why = "not a list" if not isinstance(messages, list | tuple) else bad_messages(messages) if messages else None
        if why:
            raise EnvFailed(f"{type(self.env).__name__}.step's messages: {why}")
        gained = 0.0 if result.reward is None else float(result.reward)
        if not math.isfinite(gained):
            raise EnvFailed(f"{type(self.env).__name__}.step gave a non-finite reward {result.reward}")
        components.update(checked_components(type(self.env).__name__, result.components))
        return list(messages), result.done, gained

    def render(self, answer: list[Message], turn: Completion) -> list[int]:
        """The tokens of the answer to `turn`; messages the chat template cannot render fail the episode
        (the environment wrote them), not the actor."""
        try:
            return self.renderer.increment(answer, self.stop_text(turn))
        except Exception as err:
            roles = [m.get("role") if isinstance(m, dict) else type(m).__name__ for m in answer]
            raise EnvFailed(f"messages {roles} could not be rendered: {type(err).__name__}: {err}") from err

    async def call_env(self, counts: Counts, fn, *args):
        """An environment method, async or plain (on a worker thread), within env.step_timeout_s."""
        start = time.perf_counter()
        name = f"{type(self.env).__name__}.{fn.__name__}"
        try:
            work = fn(*args) if is_async(fn) else self.threads.call(fn, *args)
            return await asyncio.wait_for(work, self.cfg.step_timeout_s)
        except RewardFailed as err:  # it names the function, the user's file and line
            raise EnvFailed(str(err)) from err
        except TimeoutError:
            raise EnvFailed(f"{name} took longer than env.step_timeout_s = {self.cfg.step_timeout_s:g} s") from None
        except Exception as err:  # named after the user's method and line, not tidal's adapter around it
            raise EnvFailed(failure(err, name)) from err
        finally:
            counts.env_seconds += time.perf_counter() - start

    async def begin(self, counts: Counts, payload: dict[str, str]):
        """The episode's state from the environment's `start`; the base one's (a copy of the payload)
        is made here, not on a worker thread."""
        if type(self.env).start is Env.start:
            return dict(payload)
        return await self.call_env(counts, self.env.start, dict(payload))

    async def release(self, counts: Counts, state) -> None:
        """The environment's `finish`; a failure there is logged, and the episode kept as it went."""
        if type(self.env).finish is Env.finish:
            return  # nothing to release: no thread hop per sample
        try:
            await self.call_env(counts, self.env.finish, state)
        except EnvFailed as err:
            log.warning("an episode's state was not released: %s", err)

    def stop_text(self, turn: Completion) -> str | None:
        """The text of the stop token that ended the turn (None when it ran out of tokens instead)."""
        if turn.finish_reason == "length" or not len(turn.tokens):
            return None
        token = int(turn.tokens[-1])
        if token not in self._stop_texts:
            self._stop_texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return self._stop_texts[token]

    def close(self) -> None:
        self.tools.close()
