"""Where every training prompt group of a run is: the one owner of that answer on the learner.

    released ──► outstanding (at an actor, or arrived and waiting for its step)
                    ├── claim: first arrival ── trained at step s   (slot freed once the step is published)
                    │                       └── discarded(reason)  (slot freed at once)
                    ├── claim: a later copy  ── duplicate           (delivery is at-least-once)
                    └── dead-lettered by the broker                 (slot freed)

The coordinator releases into the book and waits on its condition for a free slot; the
learner's admission claims and discards; the step loop marks groups trained. Every change is a
ledger line. A copy of a group this book never released (released by a learner process that
crashed before its checkpoint) is trained normally but frees no slot. Thread-safe.
"""
from __future__ import annotations

import threading
from collections import Counter

from tidal.learner.ledger import Ledger


class GroupBook:
    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.cond = threading.Condition()  # notified whenever a slot frees; the coordinator waits on it
        self.outstanding: dict[str, tuple[int, int]] = {}  # group id -> (train prompt index, min_version)
        self.consumed: set[str] = set()  # group ids trained on or discarded
        self.dead: set[str] = set()  # group ids given up on by the broker
        self.counts: Counter[str] = Counter()

    def release(self, groups: dict[str, tuple[int, int]]) -> None:
        """Groups handed to the broker: group id -> (train prompt index, min_version). Lock held by the caller."""
        self.outstanding.update(groups)
        self.ledger.record("released", ids=list(groups))

    def claim(self, group_id: str) -> bool:
        """True the first time a group id arrives; later copies are recorded as duplicates."""
        with self.cond:
            if group_id in self.consumed:
                self.counts["duplicates"] += 1
                self.ledger.record("duplicate", id=group_id)
                self._free(group_id)  # a re-released copy of a group first seen before a restart
                return False
            self.consumed.add(group_id)
            if group_id not in self.outstanding:
                self.counts["unknown"] += 1  # released before a restart; trained, frees no slot
            return True

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
            self._free(group_id)

    def in_flight(self) -> bool:
        """Some released group has not arrived yet."""
        with self.cond:
            return not all(g in self.consumed for g in self.outstanding)

    def _free(self, group_id: str) -> None:
        if self.outstanding.pop(group_id, None) is not None:
            self.cond.notify_all()

    def state_dict(self) -> dict:
        with self.cond:
            return {"outstanding": {k: list(v) for k, v in self.outstanding.items()},
                    "consumed": sorted(self.consumed), "dead": sorted(self.dead), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        with self.cond:
            self.outstanding = {k: (int(v[0]), int(v[1])) for k, v in state["outstanding"].items()}
            self.consumed, self.dead = set(state["consumed"]), set(state["dead"])
            self.counts = Counter(state["counts"])
