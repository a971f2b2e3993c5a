"""Reward functions as users write them: `task.reward_funcs` names them (import paths, a file's function
such as `./my_rewards.py:accuracy`, or entry points in the group `tidal.rewards`), `task.reward_weights`
weighs them. Each is called with keyword arguments

    prompt            the prompt: its chat messages where the row holds messages, else the text the model read
    completion        the completion's text
    completion_ids    its token ids
    <column>          every column of the dataset row (prompt and answer columns included)

sync or async, and returns a float, or None where it does not apply to the sample (it then adds nothing to
the sum and is left out of its metrics). A function with a `completions` parameter is called once per
group with lists instead (BatchedReward): `prompts`, `completions`, `completion_ids` and every column as
a list, one entry per sample, returning a list of floats (or Nones) in the same order, as TRL's reward
functions are written. Or an http(s) URL: a remote reward (RemoteReward), batched the same way, for
rewards that need a GPU or a sandbox. A sample's reward is the weighted sum; each function's own value
travels in `Sample.reward_components` under the function's name (metrics `rewards/<name>/mean`, `/std`).

A function whose signature does not fit the row (a parameter no column fills, no **kwargs for the columns
it has no parameter for) is reported at its def, naming the columns; one that raises, at the line that
raised (tidal.tasks.user_code).

Rows travel to the actors in the prompt's payload, a dict of strings on the wire: string columns as they
are, others as JSON (named under JSON_COLUMNS), decoded back before the call.
"""

from __future__ import annotations

import asyncio
import difflib
import http.client
import inspect
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from tidal.config import ConfigError, TaskConfig, redact_uri, reward_file
from tidal.tasks.env import Env, Reply, Turn, is_async
from tidal.tasks.user_code import defined_at, import_file, import_module, one_line, where_raised

ENTRY_POINTS = "tidal.rewards"
JSON_COLUMNS = "_tidal_json_columns"  # payload key: the columns stored as JSON (a JSON list of names)
PROMPT_TEXT = "_tidal_prompt_text"  # payload key Rewarded adds: the prompt as the model read it
RESERVED = ("prompt", "completion", "completion_ids")  # keyword arguments a column of that name cannot override
MAX_COLUMNS = 62  # the wire's payload holds 64 keys: two are the reserved ones above
MAX_VALUE_CHARS = 65_536  # a payload value's bound on the wire
BATCH_NAMES = {"prompt": "prompts", "completion": "completions"}  # a function taking lists gets these plural


@dataclass(frozen=True)
class RewardFunc:
    name: str  # the function's name: its metric is rewards/<name>/mean
    fn: Callable[..., Any]
    weight: float


class RewardFailed(Exception):
    """A reward function raised or returned something that is not a finite number; the message names
    the function, and the user's file and line where it raised."""


# ---- loading -------------------------------------------------------------------------------


def load_reward_funcs(cfg: TaskConfig) -> list[RewardFunc]:
    """task.reward_funcs resolved, with their weights; ConfigError naming the key when one is unknown."""
    weights = list(cfg.reward_weights) or [1.0] * len(cfg.reward_funcs)
    if len(weights) != len(cfg.reward_funcs):
        raise ConfigError(
            f"config key 'task.reward_weights' = {list(cfg.reward_weights)}: one weight per reward "
            f"function ({len(cfg.reward_funcs)} in task.reward_funcs)"
        )
    funcs = [
        RewardFunc(_name(fn, spec), fn, float(w))
        for spec, w in zip(cfg.reward_funcs, weights)
        for fn in [resolve(spec, cfg)]
    ]
    names = [f.name for f in funcs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"config key 'task.reward_funcs' = {list(cfg.reward_funcs)}: two functions named "
            f"{twice[0]!r} (their metrics would collide)"
        )
    if cfg.pass_on and cfg.pass_on not in names:
        raise ConfigError(f"config key 'task.pass_on' = {cfg.pass_on!r}: not one of task.reward_funcs' names {names}")
    return funcs


def resolve(spec: str, cfg: TaskConfig | None = None) -> Callable[..., Any]:
    """`pkg.mod:func`, `pkg.mod.func`, a file's function (`./my_rewards.py:func`, `my_rewards.py:func`),
    an entry-point name in the group tidal.rewards, or an http(s) URL (a RemoteReward) -> the function."""
    key = f"config key 'task.reward_funcs' entry {spec!r}"
    if spec.startswith(("http://", "https://")):
        cfg = cfg or TaskConfig()
        return RemoteReward(spec, cfg.remote_timeout_s, cfg.remote_retries)
    installed = {ep.name: ep for ep in entry_points(group=ENTRY_POINTS)}
    if spec in installed:
        fn = installed[spec].load()
    else:
        module, attr = _module_of(spec, key, installed)
        fn = getattr(module, attr, None)
        if fn is None:
            raise ConfigError(f"{key}: {module.__name__} has no {attr!r}")
    if not callable(fn):
        raise ConfigError(f"{key}: {type(fn).__name__} is not callable")
    return BatchedReward(fn) if takes_lists(fn) else fn


def _module_of(spec: str, key: str, installed: dict) -> tuple[ModuleType, str]:
    """The module a spec names (a file or an import path) and the function's name in it."""
    in_file = reward_file(spec)
    if in_file is not None:
        path, attr = in_file
        if not attr:
            raise ConfigError(f"{key}: name the function after the file ({path}:accuracy)")
        return import_file(path, key), attr
    module_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not (module_name and attr):
        known = ", ".join(sorted(installed)) or "none installed"
        raise ConfigError(
            f"{key}: not an import path (my_pkg.rewards:accuracy), a file's function "
            f"(./my_rewards.py:accuracy) nor an entry point of {ENTRY_POINTS} ({known})"
        )
    return import_module(module_name, key), attr


def takes_lists(fn: Callable) -> bool:
    """A function written for a batch: it names a `completions` parameter (TRL's convention)."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: one sample at a time
        return False


def _name(fn: Callable, spec: str) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__ or spec


# ---- rows in payloads --------------------------------------------------------------------------


def encode_row(row: dict[str, Any], where: str = "") -> dict[str, str]:
    """A dataset row as a payload: strings as they are, other values as JSON."""
    if len(row) > MAX_COLUMNS:
        raise ConfigError(f"{where}: {len(row)} columns; a prompt's payload carries at most {MAX_COLUMNS}")
    payload, as_json = {}, []
    for column, value in row.items():
        if not isinstance(value, str):
            value, _ = json.dumps(value, default=str), as_json.append(column)
        if len(value) > MAX_VALUE_CHARS:
            raise ConfigError(
                f"{where}: column {column!r} holds {len(value)} characters; a payload value holds "
                f"at most {MAX_VALUE_CHARS}"
            )
        payload[column] = value
    if as_json:
        payload[JSON_COLUMNS] = json.dumps(as_json)
    return payload


def decode_row(payload: dict[str, str]) -> dict[str, Any]:
    """The row `encode_row` stored, its columns' types back (the actor's own keys left out)."""
    as_json = set(json.loads(payload.get(JSON_COLUMNS, "[]")))
    return {k: json.loads(v) if k in as_json else v for k, v in payload.items() if k not in (JSON_COLUMNS, PROMPT_TEXT)}


def call_kwargs(
    payload: dict[str, str], prompt_field: str, completion: str, completion_ids: Sequence[int]
) -> dict[str, Any]:
    """The keyword arguments of every reward function for one completion."""
    row = decode_row(payload)
    prompt = row.get(prompt_field)
    if not isinstance(prompt, list):  # chat messages are passed as they are; text as the model read it
        prompt = payload.get(PROMPT_TEXT, prompt if prompt is not None else "")
    columns = {k: v for k, v in row.items() if k not in RESERVED}
    return {**columns, "prompt": prompt, "completion": completion, "completion_ids": list(completion_ids)}


# ---- scoring -------------------------------------------------------------------------------


async def score(funcs: Sequence[RewardFunc], kwargs: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """(the weighted sum, each function's value); plain functions run on a worker thread. A function that
    answered None does not apply to this sample: it adds nothing and has no component."""
    return _summed(funcs, await asyncio.gather(*(_call(f, kwargs) for f in funcs)))


async def score_rows(funcs: Sequence[RewardFunc], samples: list[dict[str, Any]]) -> list[tuple[float, dict]]:
    """score() of each sample, a function taking lists called once with them all, as with a group
    (so one that answers the wrong number of values fails here, not in a run)."""
    per_func = await asyncio.gather(*(_call_all(f, samples) for f in funcs))  # [funcs][samples]
    return [_summed(funcs, [values[i] for values in per_func]) for i in range(len(samples))]


def _summed(funcs: Sequence[RewardFunc], values: Sequence[float | None]) -> tuple[float, dict[str, float]]:
    components = {f.name: v for f, v in zip(funcs, values) if v is not None}
    return sum(f.weight * v for f, v in zip(funcs, values) if v is not None), components


async def _call_all(func: RewardFunc, samples: list[dict[str, Any]]) -> list[float | None]:
    if not isinstance(func.fn, BatchedReward):
        return list(await asyncio.gather(*(_call(func, s) for s in samples)))
    try:
        values = await func.fn.call_batch(samples)
    except RewardFailed:
        raise
    except Exception as err:
        raise _failed(func, err, samples[0]) from err
    return [as_reward(func.name, v) for v in values]


async def _call(func: RewardFunc, kwargs: dict[str, Any]) -> float | None:
    try:
        value = await func.fn(**kwargs) if is_async(func.fn) else await asyncio.to_thread(func.fn, **kwargs)
    except RewardFailed:
        raise
    except Exception as err:
        raise _failed(func, err, kwargs) from err
    return as_reward(func.name, value)


def _failed(func: RewardFunc, err: Exception, kwargs: dict[str, Any]) -> RewardFailed:
    """The function's error, at the user's line: a call its signature does not fit at the def, with
    what to change; another error at the line that raised it (a URL says where itself)."""
    mismatch = signature_mismatch(func, kwargs) if isinstance(err, TypeError) else None
    if mismatch:
        return RewardFailed(mismatch)
    where = "" if isinstance(func.fn, RemoteReward) else where_raised(err, user_function(func.fn))
    return RewardFailed(f"reward function {func.name} raised {one_line(err)}" + (f"\n{where}" if where else ""))


def user_function(fn: Callable) -> Callable:
    """The user's own function: a batched one's, not its wrapper's."""
    return fn.fn if isinstance(fn, BatchedReward) and fn.fn is not None else fn


def signature_mismatch(func: RewardFunc, kwargs: dict[str, Any], columns: Sequence[str] = ()) -> str | None:
    """What in a reward function's signature does not fit one sample's keyword arguments (a parameter
    none of them fills; no **kwargs for those it has no parameter for), with the function's file and
    line; None when they fit, or it has no signature to read (a URL, a builtin). `columns`: the row's."""
    fn = user_function(func.fn)
    if isinstance(fn, RemoteReward):
        return None
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    batched = isinstance(func.fn, BatchedReward)
    passed = [BATCH_NAMES.get(k, k) if batched else k for k in kwargs]
    columns = list(columns) or [k for k in kwargs if k not in ("completion", "completion_ids")]
    takes_rest = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [
        n
        for n, p in params.items()
        if n not in passed and p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    extra = [] if takes_rest else [k for k in passed if k not in params]
    if not (missing or extra):
        return None
    problems = [_asks_for(missing, passed, columns, batched)] if missing else []
    if extra:
        given, own = [c for c in columns if c in extra], [k for k in extra if k not in columns]
        parts = [f"the row's columns {', '.join(given)}" if given else "", ", ".join(own)]
        problems.append("add **kwargs: it is passed " + " and ".join(p for p in parts if p))
    where = defined_at(fn)
    head = f"reward function {func.name}({', '.join(str(p) for p in params.values())})"
    return f"{head}{' ' if missing else ': '}{'; '.join(problems)}" + (f"\n{where}" if where else "")


def _asks_for(missing: list[str], passed: list[str], columns: list[str], batched: bool) -> str:
    close = difflib.get_close_matches(missing[0], passed, n=1, cutoff=0.85)  # a typo such as answers for answer
    return (
        f"asks for {', '.join(map(repr, missing))}, which the rows lack (columns: {', '.join(columns)}"
        f"{', each passed as a list' if batched else ''})" + (f"; did you mean {close[0]!r}?" if close else "")
    )


def as_reward(name: str, value: Any) -> float | None:
    """A reward function's answer as a finite float, or None (does not apply); RewardFailed otherwise."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardFailed(
            f"reward function {name} returned {type(value).__name__} {repr(value)[:60]}, not a number"
        ) from None
    if not math.isfinite(number):
        raise RewardFailed(f"reward function {name} returned {number}, not a finite number")
    return number


class Rewarded(Env):
    """task.reward_funcs as a one-turn environment: its step scores the reply with every function (given
    the prompt as the model read it, the reply's text and token ids) and is done, the weighted sum its
    reward and each function's value a component."""

    max_turns = 1

    def __init__(self, cfg: TaskConfig, funcs: Sequence[RewardFunc] | None = None):
        super().__init__(cfg)
        self.funcs = list(funcs if funcs is not None else load_reward_funcs(cfg))

    async def step(self, state: dict[str, str], reply: Reply) -> Turn:
        total, values = await self.score({**state, PROMPT_TEXT: reply.prompt}, str(reply), reply.token_ids)
        return Turn(done=True, reward=total, components=values)

    async def score(
        self, state: dict[str, str], completion: str, completion_ids: Sequence[int]
    ) -> tuple[float, dict[str, float]]:
        return await score(self.funcs, call_kwargs(state, self.cfg.prompt_field, completion, completion_ids))


class BatchedReward:
    """A reward scored a group at a time: the calls made in one pass of the event loop for one prompt (a
    group's samples, whose episodes reach their reward together) are gathered into one call of
    `call_batch`, and each caller gets its own entry of the answer. Other groups finishing in the same
    pass get calls of their own, so one group's error fails that group alone. Wraps a function written
    for lists (TRL's convention)."""

    def __init__(self, fn: Callable[..., Any] | None = None):
        self.fn = fn
        if fn is not None:
            self.__name__ = _name(fn, "")
        self.pending: dict[str, list[tuple[dict, asyncio.Future]]] = {}  # prompt -> its calls
        self.posts: set[asyncio.Task] = set()  # the loop holds tasks weakly

    async def __call__(self, **kwargs) -> float | None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self.pending:
            loop.call_soon(self._flush)
        self.pending.setdefault(json.dumps(kwargs.get("prompt"), default=str), []).append((kwargs, future))
        return await future

    def _flush(self) -> None:
        batches, self.pending = list(self.pending.values()), {}
        for batch in batches:
            task = asyncio.ensure_future(self._send(batch))
            self.posts.add(task)
            task.add_done_callback(self.posts.discard)

    async def _send(self, batch: list[tuple[dict, asyncio.Future]]) -> None:
        try:
            values = await self.call_batch([kwargs for kwargs, _ in batch])
        except Exception as err:
            values = [err] * len(batch)
        for (_, future), value in zip(batch, values):
            if future.done():
                continue
            if isinstance(value, Exception):
                future.set_exception(value)
            else:
                future.set_result(value)

    async def call_batch(self, samples: list[dict]) -> list:
        """The function called once with each keyword as a list (prompt -> prompts, completion ->
        completions); its answer checked to hold one value per sample."""
        columns = {BATCH_NAMES.get(k, k): [s[k] for s in samples] for k in samples[0]}
        if is_async(self.fn):
            values = await self.fn(**columns)
        else:
            values = await asyncio.to_thread(self.fn, **columns)
        if isinstance(values, str | bytes) or not hasattr(values, "__len__") or len(values) != len(samples):
            got = (
                f"{len(values)} value{'s' * (len(values) != 1)}"
                if hasattr(values, "__len__")
                else type(values).__name__
            )
            raise RewardFailed(
                f"reward function {self.__name__} takes lists (it names `completions`) and returned "
                f"{got} for {len(samples)} samples: it must return one value per completion"
            )
        return list(values)


class RemoteReward(BatchedReward):
    """A reward served over HTTP: a batch goes in one POST of JSON {"samples": [<keyword arguments>, ...]},
    answered with {"rewards": [float, ...]} in the same order. Each POST, reply included, ends within
    `timeout_s` (a server that drips its reply is cut off there), its reply is at most MAX_REPLY_BYTES,
    a redirect is a failure (never followed), and a failed one is tried `retries` more times. The POSTs
    run on threads of the reward's own, so a slow server never holds the threads that other reward
    functions and environment steps run on. Its URL is shown with credentials as *** wherever it
    appears (errors travel to the learner)."""

    RETRY_PAUSE_S = 0.2  # first pause between tries, doubled after each
    MAX_REPLY_BYTES = 16 << 20  # a float per sample needs far less
    THREADS = 4  # POSTs in flight at once per remote reward; more wait their turn

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 2):
        super().__init__()
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        self.shown = redact_uri(url)
        parts = urlsplit(url)
        last = parts.path.rstrip("/").rsplit("/", 1)[-1] or parts.hostname or "remote"
        self.__name__ = re.sub(r"[^\w.-]", "_", last)  # the metric's name: the URL path's last part, no query
        self._pool: ThreadPoolExecutor | None = None

    async def call_batch(self, samples: list[dict]) -> list:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.THREADS, thread_name_prefix=f"reward-{self.__name__}")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.post, samples)

    def post(self, samples: list[dict]) -> list[float]:
        """One batch's rewards, tried 1 + retries times; raises naming the URL and the last failure."""
        body = json.dumps({"samples": samples}).encode()
        pause, failure = self.RETRY_PAUSE_S, ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(pause)
                pause *= 2
            try:
                answer = json.loads(self.post_once(body))
            except (RemoteFailed, TimeoutError, OSError, http.client.HTTPException, json.JSONDecodeError) as err:
                failure = f"{type(err).__name__}: {err}"
                continue
            rewards = answer.get("rewards") if isinstance(answer, dict) else None
            if not (isinstance(rewards, list) and len(rewards) == len(samples)):
                raise ValueError(
                    f'{self.shown} answered {repr(answer)[:80]}, not {{"rewards": [...]}} with {len(samples)} values'
                )
            return rewards
        raise ConnectionError(f"{self.shown}: {self.retries + 1} tries failed, the last with {failure}")

    def post_once(self, body: bytes) -> bytes:
        """One POST's reply body, within timeout_s from its start: every socket wait is given only the
        time left, so neither a slow connect nor a dripped reply outlasts it."""
        deadline = time.monotonic() + self.timeout_s

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no whole reply within task.remote_timeout_s = {self.timeout_s:g} s")
            return remaining

        parts = urlsplit(self.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = kind(parts.hostname, parts.port, timeout=left())
        try:
            conn.connect()
            sock = conn.sock  # the response reads from it too, even once the connection hands it over
            conn.request(
                "POST",
                (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                body,
                {"Content-Type": "application/json"},
            )
            sock.settimeout(left())
            response = conn.getresponse()
            if response.status >= 300:  # a redirect is not followed: its target was never configured
                raise RemoteFailed(
                    f"HTTP {response.status}" + (" (redirects are not followed)" if response.status < 400 else "")
                )
            chunks, size = [], 0
            while True:
                sock.settimeout(left())
                chunk = response.read1(1 << 16)
                if not chunk:
                    return b"".join(chunks)
                size += len(chunk)
                if size > self.MAX_REPLY_BYTES:
                    raise RemoteFailed(f"a reply of more than {self.MAX_REPLY_BYTES} bytes")
                chunks.append(chunk)
        finally:
            conn.close()


class RemoteFailed(RuntimeError):
    """A remote reward's server answered with an error, a redirect or too many bytes."""
