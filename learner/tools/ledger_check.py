"""`tidal ledger check RUN_DIR`: a run's exactly-once promise, checked from its ledger.

Every training group the learner released meets exactly one fate: trained at one step, discarded at
arrival (with its reason), dead-lettered by the broker, or still outstanding when the run ended (the
summary names those). Nothing is released twice, trained twice, or trained without having been
released. A resumed learner cuts the ledger back to its checkpoint, so the ledger is the lineage of
the live model and the check holds across resumes. While a run goes on (no summary yet, or one older
than the ledger), groups without a fate are in flight, not lost.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tidal.learner.rank0.ledger import read_ledger

SHOWN_IDS = 10  # group ids named per violation


@dataclass
class LedgerCheck:
    released: int = 0
    trained: int = 0
    discarded: Counter[str] = field(default_factory=Counter)  # by reason
    dead_lettered: int = 0
    outstanding: int = 0  # at the end of a finished run
    in_flight: int = 0  # no fate yet, in a run still going on (or stopped before its summary)
    duplicates: int = 0  # later copies the learner dropped
    steps: int = 0
    finished: bool = False
    violations: list[str] = field(default_factory=list)

    def tallies(self) -> dict[str, int]:
        return {
            "released": self.released,
            "trained": self.trained,
            "discarded": sum(self.discarded.values()),
            "dead": self.dead_lettered,
            "outstanding": self.outstanding,
            "duplicates": self.duplicates,
        }

    def lines(self) -> list[str]:
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(self.discarded.items())) or "none"
        state = (
            f"{self.outstanding} outstanding at the end"
            if self.finished
            else f"{self.in_flight} in flight (the run has not finished)"
        )
        lines = [
            f"{self.released} training groups released over {self.steps} steps: {self.trained} trained once, "
            f"{sum(self.discarded.values())} discarded ({reasons}), {self.dead_lettered} dead-lettered, {state}; "
            f"{self.duplicates} later copies dropped"
        ]
        if not self.violations:
            return [*lines, "exactly once: every released group met one fate, none was trained twice"]
        return [*lines, *(f"VIOLATION: {v}" for v in self.violations)]


def _named(ids) -> str:
    ids = sorted(ids)
    return ", ".join(ids[:SHOWN_IDS]) + (f" and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else "")


def _summary(run_dir: Path, ledger: Path) -> dict | None:
    """The run's summary when it describes this ledger: written after its last line (a resumed run still
    going on has the summary of the run before it)."""
    path = run_dir / "summary.json"
    if not path.is_file() or path.stat().st_mtime < ledger.stat().st_mtime - 1.0:
        return None
    return json.loads(path.read_text())


@dataclass
class LedgerView:
    """What a run's ledger and summary say of its training groups, at one reading."""

    released: Counter[str]
    trained: Counter[str]
    discarded: dict[str, str]  # group id -> reason
    discards: Counter[str]
    dead: set[str]
    duplicates: int
    steps: int
    summary: dict | None  # the summary of this ledger's run once it has finished, else None

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def stopped_early(self) -> bool:
        return bool(self.summary and self.summary.get("stopped_early"))

    @property
    def outstanding(self) -> set[str]:
        return set(self.summary.get("outstanding_groups", [])) if self.summary else set()

    @property
    def fated(self) -> set[str]:
        return set(self.trained) | set(self.discarded) | self.dead

    @property
    def fateless(self) -> set[str]:
        return set(self.released) - self.fated


def read_view(run_dir: Path) -> LedgerView:
    """The run's ledger and summary; raises FileNotFoundError naming the file when there is no ledger."""
    path = Path(run_dir) / "ledger.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no ledger (is {run_dir} a run folder?)")
    events = read_ledger(path)
    return LedgerView(
        released=Counter(i for e in events if e["event"] == "released" for i in e["ids"]),
        trained=Counter(i for e in events if e["event"] == "trained" for i in e["ids"]),
        discarded={e["id"]: e.get("reason", "") for e in events if e["event"] == "discarded"},
        discards=Counter(e["id"] for e in events if e["event"] == "discarded"),
        dead={e["id"] for e in events if e["event"] == "dead_letter"},
        duplicates=sum(e["event"] == "duplicate" for e in events),
        steps=sum(e["event"] == "trained" for e in events),
        summary=_summary(Path(run_dir), path),
    )


def check_ledger(run_dir: Path) -> LedgerCheck:
    """The run's ledger checked; raises FileNotFoundError naming the file when there is none."""
    return ledger_rules(read_view(run_dir))


def ledger_rules(view: LedgerView) -> LedgerCheck:
    """The exactly-once rules applied to one reading of the ledger."""
    out, outstanding = LedgerCheck(), view.outstanding
    trained, discarded, released = set(view.trained), set(view.discarded), set(view.released)
    out.released, out.trained, out.dead_lettered = len(released), len(trained), len(view.dead)
    out.discarded = Counter(view.discarded.values())
    out.duplicates, out.steps = view.duplicates, view.steps
    out.finished, out.outstanding = view.finished, len(outstanding)
    rules = [
        ("released more than once", {i for i, n in view.released.items() if n > 1}),
        ("trained more than once", {i for i, n in view.trained.items() if n > 1}),
        ("discarded more than once", {i for i, n in view.discards.items() if n > 1}),
        ("both trained and discarded", trained & discarded),
        ("trained or discarded but never released", (trained | discarded) - released),
        ("outstanding at the end but trained, discarded or dead-lettered", outstanding & view.fated),
    ]
    fateless = view.fateless - outstanding
    if view.finished:
        rules.append(("released and never trained, discarded, dead-lettered or left outstanding (lost)", fateless))
    else:
        out.in_flight = len(fateless)
    out.violations = [f"{len(ids)} groups {what}: {_named(ids)}" for what, ids in rules if ids]
    return out


def main(run_dir: str) -> int:
    """Print the check; 0 when the promise holds, 1 on a violation, 2 without a ledger."""
    try:
        result = check_ledger(Path(run_dir))
    except (FileNotFoundError, ValueError) as err:  # ValueError: a damaged line, named by read_ledger
        print(f"tidal ledger check: {err}")
        return 2
    print("\n".join(result.lines()))
    return 1 if result.violations else 0
