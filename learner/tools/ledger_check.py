"""`tidal ledger check RUN_DIR`: a run's exactly-once promise, checked from its ledger.

Every training group the learner released meets exactly one fate: trained at one step, discarded at
arrival (with its reason), dead-lettered by the broker, or still outstanding when the run ended (the
summary names those). Nothing is released twice, trained twice, or trained without having been
released. A resumed learner cuts the ledger back to its checkpoint, so the ledger is the lineage of
the live model and the check holds across resumes. While a run goes on (no summary yet, or one older
than the ledger), groups without a fate are in flight, not lost.

With `--redis`, the run's Redis streams (broker/redis_streams.py) are held against the ledger:
- a group without a fate (in flight, or outstanding at the end of a run that did not stop early) is in
  Redis as a prompt entry, an unacknowledged rollout or a dead letter, else it is LOST: no actor answers
  it and the learner waits on it. A run that stopped early acknowledged the batch it stopped with; its
  final checkpoint sends those groups again on a resume;
- a group whose rollout Redis acknowledged has a fate: the learner acknowledges at a checkpoint only
  rollouts trained or discarded before it;
- a finished run's ledger records every prompt Redis dead-lettered (the learner records it in the call
  that moves it) and releases every training prompt left in Redis (a resumed learner withdraws every
  entry its ledger no longer holds).

Tallied, not violations: rollouts of trained or discarded groups not yet acknowledged (the next
checkpoint does), dead letters the learner has yet to record (it reads them once a second, and a
resumed learner reads them all again), and prompt entries of groups with a fate that no commit will
acknowledge (they lose nothing, but trimming stops at the oldest). Trimming drops acknowledged entries
only, so the undelivered and pending ones are always all there. A run still going moves between reads:
the ledger is read before and after each look at Redis, a group counts as released only when both
readings have it and its fate comes from the second, and what a first look finds wrong is looked at
again: only what both looks find is reported. (A learner killed between writing a release and adding
its prompt leaves that group lost here until it resumes: a resume sends again, or cuts from the ledger,
every group without a fate.)
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from tidal.broker.redis_streams import NoRunStreams, RunStreams, read_run_streams
from tidal.broker.redis_transport import BrokerAuthError, BrokerUnavailable
from tidal.config import load_config
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
    summary = json.loads(path.read_text())
    # a run stopped by a signal or a failure did not finish: its groups without a fate were in flight when it
    # stopped (a resume takes them up from its checkpoint), not lost, and its summary names none of them
    return None if "error" in summary else summary


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


# ---- the run's Redis streams against the ledger ------------------------------------------------

LOST = "released, without a fate, and nowhere in Redis (lost: no prompt entry, unacknowledged rollout or dead letter)"
ACKNOWLEDGED_FATELESS = "whose rollout Redis acknowledged while the ledger gives them no fate"
DEAD_PROMPT_OUTSTANDING = "whose prompt Redis dead-lettered while the ledger leaves them outstanding"
NEVER_RELEASED = "whose prompts are in Redis but whose release the ledger does not hold"


@dataclass
class RedisCheck:
    streams: RunStreams
    violations: dict[str, set[str]] = field(default_factory=dict)  # what is wrong -> group ids
    consumed_unacknowledged: set[str] = field(default_factory=set)  # trained or discarded, rollout not acknowledged
    dead_unrecorded: set[str] = field(default_factory=set)  # dead letters the learner has yet to record
    # groups with a fate whose prompt entry no commit will acknowledge (a second entry from an XADD retried after
    # a lost reply, a copy sent again, a group dead-lettered from its rollout): harmless, but it holds back trimming
    stranded_prompts: set[str] = field(default_factory=set)
    sent_again: set[str] = field(default_factory=set)  # outstanding at an early stop, no longer waiting in Redis

    def tallies(self) -> dict[str, int]:
        prompts, rollouts = self.streams.prompts, self.streams.rollouts
        return {
            "prompts_undelivered": len(prompts.undelivered),
            "prompts_pending": len(prompts.pending),
            "rollouts_unacknowledged": len(rollouts.unacknowledged),
            "rollouts_acknowledged": len(rollouts.acknowledged),
            "dead": len(self.streams.dead),
            "consumed_unacknowledged": len(self.consumed_unacknowledged),
            "dead_unrecorded": len(self.dead_unrecorded),
            "stranded_prompts": len(self.stranded_prompts),
            "sent_again": len(self.sent_again),
        }

    def lines(self) -> list[str]:
        t = self.tallies()
        line = (
            f"redis {self.streams.where}: prompts of {t['prompts_undelivered']} groups undelivered and "
            f"{t['prompts_pending']} at actors; rollouts of {t['rollouts_unacknowledged']} groups unacknowledged "
            f"({t['consumed_unacknowledged']} trained or discarded, acknowledged at the next checkpoint) and "
            f"{t['rollouts_acknowledged']} acknowledged, not yet trimmed; {t['dead']} dead-lettered "
            f"({t['dead_unrecorded']} not yet recorded by the learner); prompts of {t['stranded_prompts']} groups "
            "with a fate left unacknowledged (they hold back trimming)"
        )
        if self.sent_again:
            line += (
                f"; {t['sent_again']} outstanding at the early stop, sent again from the final checkpoint on a resume"
            )
        if not self.violations:
            return [line, "redis agrees: every group without a fate is in Redis, every acknowledged rollout has a fate"]
        return [line, *(f"VIOLATION: {len(ids)} groups {what}: {_named(ids)}" for what, ids in self.violations.items())]

    def confirmed_by(self, later: RedisCheck) -> RedisCheck:
        """`later`, reporting only the violations this look found too (a run still going moved in between)."""
        both = {what: ids & self.violations.get(what, set()) for what, ids in later.violations.items()}
        return replace(later, violations={what: ids for what, ids in both.items() if ids})


def cross_check(view: LedgerView, streams: RunStreams) -> RedisCheck:
    """The rules of the module's table, on one reading of the ledger and one look at Redis."""
    fateless = view.fateless
    in_redis = streams.prompts.all | streams.rollouts.unacknowledged | set(streams.dead)
    covered = view.outstanding if view.stopped_early else set()  # sent again from the final checkpoint
    must_hold = (fateless & view.outstanding if view.finished else fateless) - covered
    dead_prompts = {g for g, stream in streams.dead.items() if stream == "prompts"}
    rules = [(LOST, must_hold - in_redis), (ACKNOWLEDGED_FATELESS, streams.rollouts.acknowledged & fateless - covered)]
    if view.finished:
        rules += [
            (DEAD_PROMPT_OUTSTANDING, dead_prompts & fateless),
            (NEVER_RELEASED, streams.prompts.all - set(view.released)),
        ]
    return RedisCheck(
        streams,
        {what: ids for what, ids in rules if ids},
        consumed_unacknowledged=streams.rollouts.unacknowledged & (set(view.trained) | set(view.discarded)),
        dead_unrecorded=(set(streams.dead) - (dead_prompts if view.finished else set())) & fateless,
        stranded_prompts=streams.prompts.unacknowledged & view.fated - streams.rollouts.unacknowledged,
        sent_again=covered - streams.prompts.unacknowledged - streams.rollouts.unacknowledged,
    )


def check_with_redis(run_dir: Path, read_streams: Callable[[], RunStreams]) -> tuple[LedgerView, RedisCheck]:
    """The last reading of the ledger, and what Redis holds against it (a second look when the first finds
    something wrong in a run still going: only what both looks find is reported)."""
    before = read_view(run_dir)
    found, after = _look(run_dir, before, read_streams)
    if found.violations and not after.finished:
        again, after = _look(run_dir, after, read_streams)
        found = found.confirmed_by(again)
    return after, found


def _look(run_dir: Path, before: LedgerView, read_streams) -> tuple[RedisCheck, LedgerView]:
    """Redis between two readings of the ledger: released as both have it, fates as the second has them
    (a fate is written before Redis acknowledges, a release before the prompt is added)."""
    streams = read_streams()
    after = read_view(run_dir)
    released = Counter({i: n for i, n in after.released.items() if i in before.released})
    return cross_check(replace(after, released=released), streams), after


def streams_of(run_dir: Path, url: str) -> Callable[[], RunStreams]:
    """A look at the run's streams: named by the run's name in its config.yaml, read with the learner's
    Redis settings (user, password from its environment variable, CA file), at `url` ('': the config's)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no config.yaml, which names the run's Redis streams (is {run_dir} a run folder?)"
        )
    cfg = load_config(path)
    redis_cfg = replace(cfg.broker.redis, url=url) if url else cfg.broker.redis
    return lambda: read_run_streams(redis_cfg, cfg.name)


def main(run_dir: str, redis_url: str | None = None) -> int:
    """Print the check; 0 when the promise holds, 1 on a violation, 2 without a ledger, or with a Redis
    (`redis_url`; '': the run's own) that cannot be read."""
    try:
        if redis_url is None:
            result, against = check_ledger(Path(run_dir)), None
        else:
            view, against = check_with_redis(Path(run_dir), streams_of(Path(run_dir), redis_url))
            result = ledger_rules(view)
    # ValueError: a damaged ledger line, named by read_ledger, or a config.yaml that does not load
    except (FileNotFoundError, ValueError, BrokerUnavailable, BrokerAuthError, NoRunStreams) as err:
        print(f"tidal ledger check: {err}")
        return 2
    print("\n".join(result.lines() + (against.lines() if against else [])))
    return 1 if result.violations or (against and against.violations) else 0
