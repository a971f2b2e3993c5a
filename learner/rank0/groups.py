"""Where every training prompt group of a run is: the one owner of that answer on the learner.

    released ──► outstanding (at an actor, or arrived and waiting for its step)
                    ├── claim: first arrival ── trained at step s   (slot freed once the step is published)
                    │                       └── discarded(reason)  (slot freed at once)
                    ├── claim: a later copy  ── duplicate           (delivery is at-least-once)
                    └── dead-lettered by the broker                 (slot freed)
    never released (forged, or from a learner process that crashed before its checkpoint) ── rejected

The coordinator releases into the book and waits on its condition for a free slot; the learner
claims and discards; the step loop marks groups trained. Every change is a ledger line. Memory
grows with what is in flight, not with the run: a consumed group is remembered (to tell a late
copy from a forgery) only among the last `remember` ones. Thread-safe.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass

from tidal.learner.rank0.ledger import Ledger

NEW, DUPLICATE, UNRELEASED = "new", "duplicate", "unreleased"


def prompt_digest(tokens: bytes) -> str:
    """What a released prompt's tokens hash to: a rollout must come back with the same prompt."""
    return hashlib.blake2b(tokens, digest_size=8).hexdigest()


@dataclass
class Release:
    """What was sent out as one group: what its rollout must match."""

    index: int  # the prompt's index in the training split (eval: in the held-out split)
    min_version: int  # no token of the rollout may come from older weights
    n: int  # samples
    digest: str  # prompt_digest of the prompt tokens
    eval_version: int | None = None
    claimed: bool = False  # its first copy arrived
    # the released prompt's id: a rollout naming another is refused. None only in a checkpoint made
    # before releases carried it (the coordinator fills it in on resume, with interrupted_max_tokens)
    prompt_id: int | None = None
    # the longest completion that may finish "interrupted" (thinking budget + interruption + answer);
    # 0: released without forced interruptions, so no sample of it can finish "interrupted"
    interrupted_max_tokens: int = 0
    released_at: float = 0.0  # wall-clock time.time() of the release; 0.0: unknown (older checkpoints)


class _Recent:
    """A set that remembers only its newest `limit` members."""

    def __init__(self, limit: int, members=()):
        self.limit, self._items = limit, OrderedDict.fromkeys(members)

    def add(self, item: str) -> None:
        self._items[item] = None
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def __contains__(self, item: str) -> bool:
        return item in self._items

    def __iter__(self):
        return iter(self._items)


class GroupBook:
    def __init__(self, ledger: Ledger, remember: int = 100_000):
        self.ledger = ledger
        self.cond = threading.Condition()  # notified whenever a slot frees; the coordinator waits on it
        self.outstanding: dict[str, Release] = {}
        self.consumed = _Recent(remember)  # group ids trained on or discarded lately
        self.dead = _Recent(remember)  # group ids given up on by the broker lately
        self.counts: Counter[str] = Counter()

    def release(self, groups: dict[str, Release]) -> None:
        """Groups handed to the broker. Lock held by the caller."""
        self.outstanding.update(groups)
        self.ledger.record("released", ids=list(groups))

    def claim(self, group_id: str) -> str:
        """NEW the first time a released group arrives; DUPLICATE for a later copy; UNRELEASED for an
        id this book never released (or consumed too long ago to remember), which must not be trained."""
        with self.cond:
            release = self.outstanding.get(group_id)
            if release is not None and not release.claimed:
                release.claimed = True
                return NEW
            if release is not None or group_id in self.consumed or group_id in self.dead:
                self.counts["duplicates"] += 1
                self.ledger.record("duplicate", id=group_id)
                return DUPLICATE
            self.counts["rejected/unreleased"] += 1
            return UNRELEASED

    def discard(self, group_id: str, reason: str) -> None:
        """A group dropped at arrival: its slot is free now."""
        with self.cond:
            self.counts[f"discarded/{reason}"] += 1
            self.ledger.record("discarded", reason=reason, id=group_id)
            self._free(group_id)

    def trained(self, step: int, group_ids: list[str]) -> None:
        """Step `step` trained on these groups and its weights are published: their slots are free."""
        with self.cond:
            self.ledger.record("trained", step=step, ids=group_ids)
            for group_id in group_ids:
                self._free(group_id)

    def dead_letter(self, group_id: str) -> None:
        """The broker gave up on a group (too many deliveries): free its slot, once."""
        with self.cond:
            if group_id in self.dead:
                return
            self.dead.add(group_id)
            self.counts["dead_lettered"] += 1
            self.ledger.record("dead_letter", id=group_id)
            if self.outstanding.pop(group_id, None) is not None:
                self.cond.notify_all()

    def in_flight(self) -> bool:
        """Some released group has not arrived yet."""
        with self.cond:
            return not all(r.claimed for r in self.outstanding.values())

    def _free(self, group_id: str) -> None:
        self.consumed.add(group_id)
        if self.outstanding.pop(group_id, None) is not None:
            self.cond.notify_all()

    def state_dict(self) -> dict:
        with self.cond:
            return {
                "outstanding": {k: asdict(v) for k, v in self.outstanding.items()},
                "consumed": list(self.consumed),
                "dead": list(self.dead),
                "counts": dict(self.counts),
            }

    def load_state_dict(self, state: dict) -> None:
        with self.cond:
            self.outstanding = {k: Release(**{**v, "claimed": False}) for k, v in state["outstanding"].items()}
            self.consumed = _Recent(self.consumed.limit, state["consumed"])
            self.dead = _Recent(self.dead.limit, state["dead"])
            self.counts = Counter(state["counts"])
