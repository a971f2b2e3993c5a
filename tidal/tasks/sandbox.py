"""A code-execution tool for environments: Python run in a subprocess of its own, with limits on CPU
time, memory, file size and wall-clock time, its output cut to a length, and no network.

    tools = [python_tool(cpu_s=5, memory_mb=512)]       in an Env's tools()

The network is taken away with a new network namespace (`unshare --net`) where the machine allows
one; where it does not (a container without user namespaces) the program's `socket` module is
disabled before it runs instead, which a determined program can undo: say so in the environment's
threat model, or run actors where namespaces work.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

NO_SOCKETS = (
    "import socket as _s\n"
    "def _off(*a, **k):\n    raise OSError('the network is off in this sandbox')\n"
    "_s.socket = _s.create_connection = _s.socketpair = _off\ndel _s, _off\n"
)


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5  # CPU seconds (SIGXCPU, then SIGKILL)
    memory_mb: int = 512  # address space
    output_chars: int = 4000  # what the model reads of stdout and stderr
    wall_s: float = 10.0  # wall-clock seconds, sleeping included


def python_tool(cpu_s: int = 5, memory_mb: int = 512, output_chars: int = 4000, wall_s: float = 10.0):
    """The tool `run_python(code)`, with these limits."""
    limits = Limits(cpu_s, memory_mb, output_chars, wall_s)

    def run_python(code: str) -> str:
        """Runs a Python program and returns what it printed (stdout and stderr) and how it ended.

        Args:
            code: the program; print what you want to read
        """
        return execute(code, limits)

    return run_python


def execute(code: str, limits: Limits) -> str:
    """Run `code` under `limits`; its output, and a last line when it did not exit with 0."""
    with tempfile.TemporaryDirectory(prefix="tidal-sandbox-") as folder:
        out_path = os.path.join(folder, "out")
        program = code if network_namespace() else NO_SOCKETS + code
        command = [*NETWORK_OFF, sys.executable, "-I", "-"] if network_namespace() else [sys.executable, "-I", "-"]
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=folder,
                env={"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8"},
                preexec_fn=functools.partial(_limit, limits),
                start_new_session=True,
            )
            try:
                proc.communicate(program.encode(), timeout=limits.wall_s)
                flooded = os.path.getsize(out_path) >= _file_limit(limits)
                ended = "[stopped: printed too much]" if flooded else _ending(proc.returncode, limits)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                ended = f"[stopped: took longer than {limits.wall_s:g} s]"
        with open(out_path, "rb") as out:
            text = out.read(_file_limit(limits)).decode("utf-8", errors="replace")
    if len(text) > limits.output_chars:
        text = text[: limits.output_chars] + "\n[cut: output too long]"
    return text + (f"\n{ended}" if ended else "")


def _limit(limits: Limits) -> None:
    """In the child, before the program: its resource limits."""
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    memory = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # a flood stops at the file's limit (Python ignores SIGXFSZ: its writes fail, and so does the program)
    resource.setrlimit(resource.RLIMIT_FSIZE, (_file_limit(limits), _file_limit(limits)))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _file_limit(limits: Limits) -> int:
    return 4 * limits.output_chars + 4096


def _ending(code: int, limits: Limits) -> str:
    if code == 0:
        return ""
    if code == -signal.SIGXCPU or code == -signal.SIGKILL:
        return f"[stopped: used more than {limits.cpu_s} s of CPU]"
    return f"[exit status {code}]"


NETWORK_OFF = ["unshare", "--net", "--map-root-user"]


@functools.lru_cache(maxsize=1)
def network_namespace() -> bool:
    """Whether this machine lets a process start in a network namespace of its own (probed once)."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run([*NETWORK_OFF, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
