"""Every example of the README whose first line names its file and command runs as written: the file is
written into an empty folder with JSON Lines rows of the shape the README shows, and the command runs
there, shortened (one step, a short warm start of the task's own tiny model)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
HEADER = re.compile(r"# (?P<file>[\w/]+\.py): (?P<command>tidal .*)")
SHORTENED = ["learner.max_steps=1", "eval.every=0", "model.tiny.warmstart.max_steps=20", "actor.max_restarts=0"]


def examples() -> list[tuple[str, list[str], str]]:
    """(file, command words, source) of each python block that opens with `# <file>: tidal ...`."""
    found = []
    for block in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S):
        lines = block.splitlines()
        head = HEADER.fullmatch(lines[0])
        if head is None:
            continue
        command, rest = head["command"], iter(lines[1:])
        while command.endswith("\\"):  # continued on the next comment line
            command = command[:-1] + next(rest).lstrip("# ")
        found.append((head["file"], command.split(), block))
    return found


def rows(count: int = 600) -> str:
    """Rows as the README shows them: {"prompt": "37+48=", "answer": "085"} (the tiny preset holds 256 out)."""
    pairs = [(a, b) for a in range(10, 100, 2) for b in range(10, 100, 3)][:count]
    return "".join(json.dumps({"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"}) + "\n" for a, b in pairs)


def test_the_readme_has_examples_to_run():
    assert {file for file, _, _ in examples()} >= {"my_rewards.py", "my_tasks/countdown.py", "my_tasks/retry.py"}


@pytest.mark.parametrize("file, command, source", examples(), ids=[e[0] for e in examples()])
def test_a_readme_example_runs_as_written(tmp_path, file, command, source):
    (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / file).write_text(source)
    for word in command:
        if word.startswith("task.data_path="):
            (tmp_path / word.split("=", 1)[1]).write_text(rows())
    assert command[0] == "tidal"
    # the installed command, not `python -m` (which would put the folder on the path itself)
    cmd = [
        str(Path(sys.executable).parent / "tidal"),
        *command[1:],
        *SHORTENED,
        "run_dir=run",
        f"model.cache_dir={tmp_path / 'models'}",
    ]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["steps"] == 1
