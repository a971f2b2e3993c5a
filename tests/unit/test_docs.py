"""The docs say what the code does: every metric the learner can log is in docs/metrics.md and
every metric there is logged somewhere; the docs' links resolve; nothing cites a document that
is not in the repository."""

import re
import subprocess
from pathlib import Path

from test_staleness import MIXED, build_learner, group, trainer_metrics

from tidal.config import OnViolation

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
# metric names as the code writes them: literals, and f-strings whose {placeholder} is one family
FAMILIES = "rollout|learner|offpolicy|broker|compute|timing|eval|curriculum|optim|episode|rewards|flow|weights"
METRIC = re.compile(rf"""f?["']((?:{FAMILIES})/[\w/{{}}]+)["']""")


def normalized(name: str) -> str:
    """`broker/rejected/{reason}` (code) and `broker/rejected/<reason>` (docs) both as `broker/rejected/*`."""
    return re.sub(r"\{\w+\}|<\w+>", "*", name)


def documented() -> set[str]:
    text = (DOCS / "metrics.md").read_text()
    return {normalized(n) for n in re.findall(r"^\| `([a-z]+/[^`]+)` \|", text, re.MULTILINE)}


def logged_by_code() -> set[str]:
    found = set()
    for folder in ("learner", "broker", "actor"):
        for path in (ROOT / folder).rglob("*.py"):
            found |= {normalized(n) for n in METRIC.findall(path.read_text())}
    return found


def matches(name: str, patterns: set[str]) -> bool:
    return any(re.fullmatch(re.escape(p).replace(r"\*", r"[\w]+"), name) for p in patterns)


def test_every_metric_the_code_logs_is_documented_and_every_documented_one_is_logged():
    docs, code = documented(), logged_by_code()
    assert sorted(c for c in code if c not in docs and not matches(c, docs)) == [], "not in docs/metrics.md"
    assert sorted(d for d in docs if d not in code and not any(matches(c, {d}) for c in code)) == [], (
        "in docs/metrics.md but logged nowhere"
    )


def test_a_real_steps_metrics_are_all_documented(tmp_path):
    learner = build_learner(tmp_path, OnViolation.mask_tokens)
    from tidal.learner.rank0.admission import StepBatch

    batch = StepBatch()
    learner.parts.admission.add(group(MIXED, "a"), batch, learner.version)
    metrics = learner.step_metrics(batch, trainer_metrics() | {"offpolicy/fresh_tokens": 1.0})
    docs = documented()
    assert [k for k in metrics if not matches(k, docs)] == []


def test_rejection_reasons_in_the_docs_are_the_codes():
    text = (DOCS / "metrics.md").read_text()
    listed = set(re.findall(r"`([a-z_]+)`", text.split("`broker/rejected/<reason>`")[1].split("\n")[0]))
    code = "\n".join(p.read_text() for p in (ROOT / "broker").rglob("*.py"))
    raised = set(re.findall(r"""(?:WireError\(|refuse\(|rejected\[|refused\[)\s*["']([a-z_]+)["']""", code))
    assert listed == raised


def test_doc_links_resolve_and_nothing_cites_a_missing_document():
    for doc in [*DOCS.glob("*.md"), ROOT / "README.md", *ROOT.glob("*/README.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to missing {target}"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    cited = [
        name
        for name in tracked
        if Path(name).suffix in (".py", ".md", ".yaml", ".toml", ".sh")
        and re.search("DESIGN" + r"(\.md| §)", (ROOT / name).read_text(errors="ignore"))
    ]
    assert cited == []


def test_every_prometheus_metric_is_documented_and_every_documented_one_is_served():
    served = set()
    for path in (ROOT / "actor" / "metrics.py", ROOT / "learner" / "rank0" / "flow.py"):
        served |= set(re.findall(r'"(tidal_[a-z_]+)"', path.read_text()))
    documented = set(re.findall(r"^\| `(tidal_[a-z_]+)` \|", (DOCS / "metrics.md").read_text(), re.MULTILINE))
    assert served and sorted(served - documented) == [], "not in docs/metrics.md"
    assert sorted(documented - served) == [], "in docs/metrics.md but served nowhere"
