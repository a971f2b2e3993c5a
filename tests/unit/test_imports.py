"""The folders keep their places: who may import whom, checked on every import statement in the
package (function-level ones too), so a layering mistake fails here rather than in review.

    tidal.kernels                      imports nothing of tidal
    tidal.broker                       the wire and the channels: only tidal.config, tidal.files, tidal.logs
    tidal.actor  ─┐  never each other  broker, config, tasks, health, prometheus, models (+ tiny)
    tidal.learner ┘                    broker, kernels, config, tasks, health, prometheus, models, tiny
      learner.every_rank               what every rank runs: nothing of learner.rank0 (rank 0's alone)
    tidal.config                       nothing of tidal (the weight channel reads its folder rule from it)
    tidal.files                        nothing of tidal (file helpers for anyone)
    tidal.logs                         nothing of tidal (sparse warnings for anyone)
    tidal.run_files                    nothing of tidal (the run folder's shared file names)
    tidal.prometheus                   nothing of tidal (a process's /metrics endpoint, for both roles)
    tidal.ops                          the roof (cli, launcher, sweep, plans): imported by no one but
                                       `python -m tidal`; reaches the roles only through their public
                                       entry points (ROOF_REACHES)
"""

import ast
from pathlib import Path

from conftest import ROOT

PACKAGES = {"actor": "actor", "learner": "learner", "broker": "broker", "kernels": "kernels", "tidal": None}
SHARED = {"config", "tasks", "health", "files", "logs", "run_files", "prometheus"}
ALLOWED = {
    "kernels": set(),
    "broker": {"config", "files", "logs"},
    "actor": {"broker", "models", "tiny"} | SHARED,
    "learner": {"broker", "kernels", "models", "tiny", "scaling", "mlflow_store"} | SHARED,
    "config": set(),
    "tasks": {"config", "logs"},
    "files": set(),
    "logs": set(),
    "mlflow_store": {"config"},
    "run_files": set(),
    "prometheus": set(),
    "scaling": {"config", "mlflow_store"},
}


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Every `tidal.*` module the file imports, without the `tidal.` prefix: `from tidal.x import y`
    names x.y where y is a module of its own (a file or a folder beside x), else x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.removeprefix("tidal.") for a in node.names if a.name.startswith("tidal.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tidal":
            base = node.module.removeprefix("tidal").lstrip(".")
            for alias in node.names:
                name = f"{base}.{alias.name}" if base else alias.name
                found.add(name if is_module(name, root) or not base else base)
    return found


def is_module(name: str, root: Path = ROOT) -> bool:
    """Whether `name` (without `tidal.`) is a module or package of tidal's, laid out as the folders are."""
    top, *rest = name.split(".")
    folder = root / top if top in PACKAGES and top != "tidal" else root / "tidal" / top
    path = folder.joinpath(*rest)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


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
            for target in imports_of(path, root):
                top = target.split(".")[0]
                if top != part and target not in ALLOWED[part] and top not in ALLOWED[part]:
                    bad.append(f"{path.relative_to(root)} imports tidal.{target}")
    return bad


def test_every_import_respects_the_layers():
    assert violations() == []


def test_the_actor_reaches_tasks_through_the_package_alone():
    """Environments, turns, messages and failures come from `tidal.tasks`; no task module's internals."""
    bad = [
        f"{p.relative_to(ROOT)} imports tidal.{t}"
        for p in sorted((ROOT / "actor").rglob("*.py"))
        for t in sorted(imports_of(p))
        if t.startswith("tasks.")
    ]
    assert bad == []


def test_what_every_rank_runs_imports_nothing_of_what_rank_0_alone_runs():
    every_rank = sorted((ROOT / "learner" / "every_rank").rglob("*.py"))
    assert every_rank
    bad = [
        f"{p.relative_to(ROOT)} imports tidal.{t}"
        for p in every_rank
        for t in sorted(imports_of(p))
        if t.startswith("learner.rank0")
    ]
    assert bad == []


# what the roof may import of each role: its entry, the learner's assembly and tools, the weight channel's
# public names (the wire and the rest of the broker are shared by everyone)
ROOF_REACHES = {
    "learner": ("learner.main", "learner.build", "learner.tools"),
    "actor": ("actor.main",),
    "broker.weights": ("broker.weights",),
}


def test_the_roof_is_imported_by_no_one_and_reaches_roles_only_through_their_entry_points():
    bad = []
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            in_roof = path.is_relative_to(ROOT / "tidal" / "ops")
            for target in sorted(imports_of(path)):
                if target.startswith("ops") and not in_roof and path != ROOT / "tidal" / "__main__.py":
                    bad.append(f"{path.relative_to(ROOT)} imports tidal.{target}")
                for role, public in ROOF_REACHES.items():
                    if (
                        in_roof
                        and (target + ".").startswith(role + ".")
                        and not any(target == p or target.startswith(p + ".") for p in public)
                    ):
                        bad.append(f"{path.relative_to(ROOT)} imports tidal.{target}")
    assert bad == []


CHANNELS = ("file", "tcp", "gloo", "nccl")  # the weight channels; what they share lives beside them


def test_code_outside_the_weight_channels_uses_their_public_names_alone():
    """`tidal.broker.weights` (its __all__) is the weight wing's one boundary for actor, learner and roof."""
    bad = [
        f"{p.relative_to(ROOT)} imports tidal.{t}"
        for folder in ("actor", "learner", "tidal")
        for p in sorted((ROOT / folder).rglob("*.py"))
        for t in sorted(imports_of(p))
        if t.startswith("broker.weights.")
    ]
    assert bad == []


def test_no_weight_channel_imports_another():
    bad = [
        f"broker/weights/{c}.py imports tidal.{t}"
        for c in CHANNELS
        for t in sorted(imports_of(ROOT / "broker" / "weights" / f"{c}.py"))
        if t.startswith("broker.weights.") and t.split(".")[2] in set(CHANNELS) - {c}
    ]
    assert bad == []


def test_the_check_sees_a_violation_inside_a_function(tmp_path):
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    sneaky = "def f():\n    from tidal.actor.loop import Actor\n    return Actor\n"
    (tmp_path / "learner" / "sneaky.py").write_text(sneaky)
    (tmp_path / "broker" / "fine.py").write_text("from tidal.config import BrokerConfig\nimport tidal.broker.schema\n")
    assert violations(tmp_path) == ["learner/sneaky.py imports tidal.actor.loop"]


def module_of(path: Path, root: Path = ROOT) -> str:
    """A file's module name without `tidal.`: learner/rank0/loop.py -> learner.rank0.loop, tidal/config.py -> config."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "tidal":
        parts = parts[1:]
    return ".".join(p for p in parts if p != "__init__")


def circles(root: Path = ROOT) -> list[list[str]]:
    """The import circles among tidal's modules (strongly connected groups of two or more), counting
    imports inside functions too: a deferred import that only hides a circle is still one."""
    graph = {module_of(p, root): imports_of(p, root) for folder in PACKAGES for p in (root / folder).rglob("*.py")}
    graph = {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}
    order, low, stack, found = {}, {}, [], []

    def visit(m: str) -> None:  # Tarjan's strongly connected components
        order[m] = low[m] = len(order)
        stack.append(m)
        for t in graph[m]:
            if t not in order:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], order[t])
        if low[m] == order[m]:
            group = []
            while not group or group[-1] != m:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for m in sorted(graph):
        if m not in order:
            visit(m)
    return sorted(found)


def test_no_module_imports_itself_back():
    assert circles() == []


def test_the_circle_check_sees_one_through_a_deferred_import(tmp_path):
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "learner" / "a.py").write_text("from tidal.learner.b import f\n")
    (tmp_path / "learner" / "b.py").write_text("def f():\n    from tidal.learner import a\n    return a\n")
    (tmp_path / "learner" / "c.py").write_text("from tidal.learner import a\n")
    assert circles(tmp_path) == [["learner.a", "learner.b"]]
