"""The code-execution tool: a program's output comes back; one that spins, grows, floods, sleeps or
reaches for the network is stopped by its limit and says which; the actor's tool runner sees a string."""

from dataclasses import replace

import pytest

from tidal.tasks import tool_schemas
from tidal.tasks.sandbox import Limits, execute, network_namespace, python_tool

LIMITS = Limits(cpu_s=1, memory_mb=256, output_chars=200, wall_s=3.0)


def test_a_program_prints_and_its_errors_come_back():
    assert execute("print(6 * 7)", LIMITS) == "42\n"
    out = execute("1 / 0", LIMITS)
    assert "ZeroDivisionError" in out and out.endswith("[exit status 1]")


# a sleeper uses no CPU, so its wall-clock limit can be short; the others keep LIMITS' 3 s, so that the
# spinning one reaches its 1 s of CPU first even on a loaded machine
SHORT_WALL = replace(LIMITS, wall_s=0.5)


@pytest.mark.parametrize(
    "code, limits, ending",
    [
        ("while True: pass", LIMITS, "[stopped: used more than 1 s of CPU]"),
        ("import time; time.sleep(60)", SHORT_WALL, "[stopped: took longer than 0.5 s]"),
        ("x = bytearray(1 << 30)", LIMITS, "[exit status 1]"),  # MemoryError: the address space is capped
        ("while True: print('y' * 1000)", LIMITS, "[stopped: printed too much]"),
    ],
)
def test_limits_stop_a_program_and_say_which(code, limits, ending):
    out = execute(code, limits)
    assert out.endswith(ending)
    assert len(out) < limits.output_chars + 100


def test_the_network_is_off():
    code = (
        "import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
        "except OSError as e:\n    print('off', e)\n"
    )
    out = execute(code, LIMITS)
    assert out.startswith("off"), out
    # a namespace of its own has no interface but a loopback that is down; without one, no sockets
    assert ("network is off" in out) != network_namespace()


def test_the_tool_has_a_schema_for_the_chat_template():
    [schema] = tool_schemas([python_tool()])
    assert schema["function"]["name"] == "run_python"
    assert schema["function"]["parameters"]["required"] == ["code"]
