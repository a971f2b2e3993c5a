"""The folders keep their places: who may import whom, checked on every import statement in the
package (function-level ones too), so a layering mistake fails here rather than in review.

    tidal.kernels                      imports nothing of tidal
    tidal.broker                       the wire and the channels: only tidal.config and tidal.files
    tidal.actor  ─┐  never each other  broker, config, tasks, health, models (+ tiny)
    tidal.learner ┘                    broker, kernels, config, tasks, health, models, tiny
    tidal.config                       nothing of tidal (the weight channel reads its folder rule from it)
    tidal.files                        nothing of tidal (file helpers for anyone)
"""
import ast
from pathlib import Path

from conftest import ROOT

PACKAGES = {"actor": "actor", "learner": "learner", "broker": "broker", "kernels": "kernels", "tidal": None}
SHARED = {"config", "tasks", "health", "files"}
ALLOWED = {
    "kernels": set(),
    "broker": {"config", "files"},
    "actor": {"broker", "models", "tiny"} | SHARED,
    "learner": {"broker", "kernels", "models", "tiny"} | SHARED,
    "config": set(),
    "tasks": {"config"},
    "files": set(),
}


def imports_of(path: Path) -> set[str]:
    """Every `tidal.*` module the file imports, without the `tidal.` prefix."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        found |= {n.removeprefix("tidal.") for n in names if n.startswith("tidal.")}
    return found


def part_of(path: Path, root: Path) -> str:
    """actor, learner, broker, kernels, or the module's name under tidal/ (config, tasks, launcher, ...)."""
    folder = path.relative_to(root).parts[0]
    return folder if folder != "tidal" else path.relative_to(root / "tidal").parts[0].removesuffix(".py")


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            part = part_of(path, root)
            if part not in ALLOWED:
                continue  # the entry points (cli, launcher, ...) may import anything
            for target in imports_of(path):
                top = target.split(".")[0]
                if top != part and target not in ALLOWED[part] and top not in ALLOWED[part]:
                    bad.append(f"{path.relative_to(root)} imports tidal.{target}")
    return bad


def test_every_import_respects_the_layers():
    assert violations() == []


def test_the_check_sees_a_violation_inside_a_function(tmp_path):
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    sneaky = "def f():\n    from tidal.actor.loop import Actor\n    return Actor\n"
    (tmp_path / "learner" / "sneaky.py").write_text(sneaky)
    (tmp_path / "broker" / "fine.py").write_text("from tidal.config import BrokerConfig\nimport tidal.broker.schema\n")
    assert violations(tmp_path) == ["learner/sneaky.py imports tidal.actor.loop"]
