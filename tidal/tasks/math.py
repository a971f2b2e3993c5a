"""Math problems from a local JSON Lines or Parquet file, scored 1/0 by math-verify equivalence.

Prompts: each row's `task.prompt_field` put into `task.prompt_template`; the payload carries the row's
`task.answer_field`. Rewards: math-verify extracts the completion's final answer and compares it with
the gold answer symbolically, so `\\boxed{1/2}`, `0.5` and `\\frac{1}{2}` all match a gold `\\frac{1}{2}`.

math-verify bounds its own work with signal.alarm, which works only on a process's main thread
(elsewhere `parse` and `verify` raise ValueError even with raise_on_error=False) and only in whole
seconds. So the checks run in a helper process with the library's timeouts off, and the caller, on
any thread, waits at most REWARD_TIMEOUT_S: a helper stuck on an input like `\\boxed{9^{9^{9^{9}}}}`
is killed and replaced, and that sample scores 0. Its address space is capped too (RLIMIT_AS,
HELPER_MEMORY_HEADROOM_BYTES above what it holds once math-verify is imported), so an answer whose
evaluation would need gigabytes fails with MemoryError (scored 0) instead of taking the actor's
memory with it. Outcomes are counted (`reward_stats`); timeouts
and other oddities are logged at 1, 10, 100, ... occurrences.

For real models only (model.path): the tiny model is character-level and built for arithmetic.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import string
import subprocess
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable

from tidal.config import ConfigError, TaskConfig
from tidal.logs import power_of_ten
from tidal.tasks import Prompt, Split
from tidal.tasks.data import load_rows, row_payload, split_rows

log = logging.getLogger(__name__)

OPTIONS: dict[str, str] = {}  # task.kwargs: this task takes none
REWARD_TIMEOUT_S = 2.0  # longest check of one completion; a legitimate one takes milliseconds
STARTUP_TIMEOUT_S = 120.0  # a fresh helper imports sympy and math-verify (seconds on a busy machine)
# CPU seconds one check may use before the kernel ends the helper: the parent kills it long before,
# unless the parent itself was killed mid-check (a stuck check ignores its stdin closing).
HELPER_CPU_LIMIT_S = 30
# Address space one helper may grow by once math-verify is imported: a legitimate check needs a few MiB.
HELPER_MEMORY_HEADROOM_BYTES = 1 << 30
# Only the completion's tail is checked: the final answer is there, and extraction regexes over a
# runaway completion would cost more than sampling it did.
MAX_COMPLETION_CHARS = 4000

# Outcomes of one check; all but CORRECT score 0.
CORRECT, WRONG, NO_ANSWER = "correct", "wrong", "no_answer"
BAD_GOLD, TIMEOUT, CRASHED, ERROR = "bad_gold", "timeout", "crashed", "error"
_WORTH_A_WARNING = (BAD_GOLD, TIMEOUT, CRASHED, ERROR)


def __getattr__(name: str):
    # The tiny model builds its tokenizer from a task's ALPHABET. Math needs a real model's tokenizer,
    # so being asked for one means the config left model.path empty.
    if name == "ALPHABET":
        raise ConfigError(
            "config key 'model.path' = '': task.name = 'math' needs a Hugging Face model "
            "directory; the tiny model is character-level, for task.name = 'arithmetic' only"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- prompts -------------------------------------------------------------------------------


def load_prompts(cfg: TaskConfig) -> Split:
    """Rows of task.data_path; held out: num_val rows drawn by seed from task.val_path, else split off data_path."""
    rows = read_rows(cfg, cfg.data_path, "task.data_path", cfg.data_split)
    val_rows = read_rows(cfg, cfg.val_path, "task.val_path", cfg.val_split) if cfg.val_path else []
    # the template is for string prompts; chat messages go through the tokenizer's chat template instead
    strings = any(isinstance(r[cfg.prompt_field], str) for r in rows + val_rows)
    render = build_renderer(cfg.prompt_template, cfg.prompt_field) if strings else None
    return split_rows(cfg, rows, val_rows, lambda i, row: _prompt(i, row, cfg, render))


def read_rows(cfg: TaskConfig, source: str, key: str, split: str) -> list[dict]:
    # reward functions are called with every column of the row; the built-in reward reads the answer alone
    return load_rows(
        source,
        key,
        cfg.prompt_field,
        cfg.answer_field,
        split=split,
        config=cfg.data_config,
        every_column=bool(cfg.reward_funcs),
    )


def _prompt(prompt_id: int, row: dict, cfg: TaskConfig, render: Callable[[str], str] | None) -> Prompt:
    """A string prompt goes through the template; chat messages are kept as they are."""
    prompt = row[cfg.prompt_field]
    answer = row_payload(cfg, row, {"answer": row[cfg.answer_field].strip()}, f"{cfg.data_path}: row {prompt_id}")
    if isinstance(prompt, list):
        return Prompt(prompt_id=prompt_id, text="", payload=answer, messages=tuple(prompt))
    return Prompt(prompt_id=prompt_id, text=render(prompt), payload=answer)


def build_renderer(template: str, field: str) -> Callable[[str], str]:
    """problem -> prompt text; the template must hold exactly one placeholder, {<field>}."""
    key = f"config key 'task.prompt_template' = {template!r}"
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise ConfigError(f"{key}: {err} (literal braces are written {{{{ and }}}})") from None
    if names != {field}:
        found = ", ".join(f"{{{n}}}" for n in sorted(names)) or "none"
        raise ConfigError(
            f"{key}: needs exactly the placeholder {{{field}}} (task.prompt_field), found {found} "
            f"(literal braces are written {{{{ and }}}})"
        )
    return lambda problem: template.format(**{field: problem})


# ---- reward --------------------------------------------------------------------------------


def reward(text: str, payload: dict[str, str]) -> float:
    """1.0 if the completion's final answer equals payload["answer"] (math-verify), else 0.0; never raises on it."""
    return 1.0 if _shared_verifier().judge(payload["answer"], text[-MAX_COMPLETION_CHARS:]) == CORRECT else 0.0


def reward_stats() -> dict[str, int]:
    """Outcome counts of this process's reward calls, e.g. rollout/math_timeout."""
    counts = _shared.counts if _shared is not None else Counter()
    return {f"rollout/math_{outcome}": n for outcome, n in sorted(counts.items())}


_shared: Verifier | None = None
_shared_lock = threading.Lock()


def _shared_verifier() -> Verifier:
    """The process's helper, started on the first reward call (no import-time side effects)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Verifier()
        return _shared


class Verifier:
    """math-verify in a helper process: an outcome within timeout_s from any thread, else TIMEOUT."""

    def __init__(self, timeout_s: float = REWARD_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # one request at a time per helper
        self._helper: _Helper | None = None
        self._ready = False

    def judge(self, gold: str, completion: str) -> str:
        """CORRECT, WRONG, NO_ANSWER, BAD_GOLD, TIMEOUT, CRASHED or ERROR; raises only if math-verify cannot start."""
        with self._lock:
            if self._helper is None or self._helper.owner_pid != os.getpid():  # new, or a forked copy
                self._start()
            self._wait_ready()
            try:
                self._helper.send(gold, completion)
                reply = self._helper.read_line(self.timeout_s)
                outcome = TIMEOUT if reply is None else reply or CRASHED  # "" = end of file: it died
            except OSError:  # BrokenPipeError: it died before reading (e.g. a crash inside sympy)
                outcome = CRASHED
            if outcome in (TIMEOUT, CRASHED):
                self.close()
                self._start()  # at once, so its imports overlap with the caller's next sampling
            self.counts[outcome] += 1
            num = self.counts[outcome]
        if outcome in _WORTH_A_WARNING and power_of_ten(num):
            log.warning(
                "math reward: %s #%d (gold %.60r, completion ending %.80r); the sample scores 0",
                outcome,
                num,
                gold,
                completion[-80:],
            )
        return outcome

    def close(self) -> None:
        """Stop the helper (a later judge starts a new one)."""
        if self._helper is not None:
            self._helper.stop()
        self._helper = None

    def _start(self) -> None:
        self._helper, self._ready = _Helper(), False

    def _wait_ready(self) -> None:
        """A missing or broken math-verify is the environment's fault, not the sample's: raise."""
        if self._ready:
            return
        reply = self._helper.read_line(STARTUP_TIMEOUT_S)
        if reply != "ready":
            why = (
                f"no answer within {STARTUP_TIMEOUT_S:.0f} s"
                if reply is None
                else reply or f"exited with code {self._helper.proc.wait()} (its error is above)"
            )
            self.close()
            raise RuntimeError(f"math reward helper did not start: {why} (the math task needs math-verify)")
        self._ready = True


class _Helper:
    """One helper process: requests as JSON lines on its stdin, one reply line each on a private pipe."""

    def __init__(self):
        # A private pipe, not stdout: nothing a library prints can be mistaken for a reply.
        read_fd, write_fd = os.pipe()
        # A fresh interpreter rather than multiprocessing: fork would copy the actor's threads and
        # engine state, and spawn re-runs the caller's __main__, which breaks unguarded scripts.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from tidal.tasks.math import _serve; "
                f"_serve({write_fd}, {HELPER_CPU_LIMIT_S}, {HELPER_MEMORY_HEADROOM_BYTES})",
            ],
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
            env=env,
            bufsize=0,
        )
        os.close(write_fd)
        self.replies = os.fdopen(read_fd, "rb", buffering=0)
        self.owner_pid = os.getpid()
        # Also at exit: a helper stuck mid-check would never see its stdin close.
        self.stop = weakref.finalize(self, _stop, self.proc, self.replies, self.owner_pid)

    def send(self, gold: str, completion: str) -> None:
        data = (json.dumps([gold, completion]) + "\n").encode()  # ASCII: lone surrogates are escaped
        while data:
            data = data[os.write(self.proc.stdin.fileno(), data) :]

    def read_line(self, timeout_s: float) -> str | None:
        """The next reply; None when none came within timeout_s, "" when the helper exited."""
        ready, _, _ = select.select([self.replies], [], [], timeout_s)
        if not ready:
            return None
        return self.replies.readline().decode().strip()  # unbuffered: never reads past one reply


def _stop(proc: subprocess.Popen, replies, owner_pid: int) -> None:
    if os.getpid() != owner_pid:
        return  # a forked copy must leave its parent's helper alone
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stdin.close()
    replies.close()


def cap_memory(headroom_bytes: int) -> int:
    """Cap this process's address space at what it maps now plus `headroom_bytes` (soft and hard: the
    helper cannot raise it again); returns the cap. Where the mapped size is unknown, the cap is the
    headroom alone above 1 GiB."""
    import resource

    try:
        with open("/proc/self/statm") as statm:
            mapped = int(statm.read().split()[0]) * resource.getpagesize()
    except OSError:
        mapped = 1 << 30
    limit = mapped + headroom_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return limit


def _serve(reply_fd: int, cpu_limit_s: int, memory_headroom_bytes: int = HELPER_MEMORY_HEADROOM_BYTES) -> None:
    """The helper process: a reply line per request line ([gold, completion] as JSON) until stdin closes."""
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which stops this helper
    replies = os.fdopen(reply_fd, "w", buffering=1)
    # Its "timeout is disabled" warning: the parent enforces the timeout.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        from math_verify import parse, verify
    except Exception as err:
        replies.write(f"cannot import math_verify: {type(err).__name__}: {err}".replace("\n", " ") + "\n")
        return
    cap_memory(memory_headroom_bytes)  # after the imports: only the checks are bounded
    replies.write("ready\n")
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    for line in sys.stdin.buffer:  # ends when the parent closes the pipe or exits
        gold, completion = json.loads(line)
        # SIGXCPU ends this process even while sympy holds the GIL in C, where no Python code runs
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(used.ru_utime + used.ru_stime) + cpu_limit_s
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        replies.write(_check(parse, verify, gold, completion) + "\n")


def _check(parse, verify, gold: str, completion: str) -> str:
    """One comparison, run inside the helper with math-verify's signal timeouts off."""
    try:
        # boxed, so plain answers such as "\\sqrt{2}" or "x^2+1" parse as LaTeX
        gold_parsed = parse(gold if "\\boxed" in gold else f"\\boxed{{{gold}}}", parsing_timeout=None)
        if not gold_parsed:
            return BAD_GOLD
        answer = parse(completion, parsing_timeout=None)
        if not answer:
            return NO_ANSWER
        return CORRECT if verify(gold_parsed, answer, timeout_seconds=None) else WRONG
    except Exception:  # math-verify raising on an odd completion is the completion's fault: it scores 0
        return ERROR
