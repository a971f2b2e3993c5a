"""Who holds which prompt group, for transports that acknowledge nothing (ZeroMQ, in-process).

Prompts are pulled, not pushed: a live actor (one heard from within `actor_timeout_s`) asks for
as many samples as it has free slots and is granted whole groups that fit; an id that never
introduced itself with a heartbeat is granted nothing. Every granted group is kept until its
rollout comes back, and a rollout is accepted only from an actor the group was granted to. An
actor silent for `actor_timeout_s`, or one that says hello again under the same id (it restarted),
has its unreturned groups queued again at the front; one of its earlier holders may still deliver
first, and the learner deduplicates by group id. Redis keeps the same record itself (its pending
entries). Not thread-safe: the owning transport serializes every call.
"""
from __future__ import annotations

import collections
import logging
import time

from tidal.broker.base import ActorInfo, ActorJoin, HelloLog, actor_info, common_metrics
from tidal.broker.schema import Heartbeat, PromptGroup

log = logging.getLogger(__name__)


class GrantTable:
    def __init__(self, actor_timeout_s: float, max_actors: int = 1024):
        self.actor_timeout_s = actor_timeout_s
        self.max_actors = max_actors
        self.pending: collections.deque[PromptGroup] = collections.deque()
        self.granted: dict[str, tuple[str, PromptGroup]] = {}  # group id -> (actor id, group), until returned
        self.holders: dict[str, set[str]] = {}  # group id -> every actor it was granted to, until returned
        self.actors: dict[str, ActorInfo] = {}
        self.joins: dict[str, ActorJoin] = {}  # the newest hello of each id since take_joins, in arrival order
        self.hellos = HelloLog(max_actors)
        self.announced_version = 0  # the newest weight version announced, for the join record
        self.num_granted = 0
        self.num_redispatched = 0
        self.refused: collections.Counter[str] = collections.Counter()  # messages refused, by reason

    def submit(self, groups: list[PromptGroup]) -> None:
        self.pending.extend(groups)

    def take(self, actor_id: str, max_samples: int) -> list[PromptGroup]:
        """Whole groups from the front of the queue while their samples fit `max_samples`; nothing
        for an id that is not a live actor."""
        if actor_id not in self.actors:
            return []
        groups: list[PromptGroup] = []
        budget = max_samples
        while self.pending and self.pending[0].n <= budget:
            group = self.pending.popleft()
            budget -= group.n
            groups.append(group)
            self.granted[group.group_id] = (actor_id, group)
            self.holders.setdefault(group.group_id, set()).add(actor_id)
        self.num_granted += len(groups)
        return groups

    def returned(self, group_id: str, actor_id: str) -> str | None:
        """A rollout arrived; the reason to refuse it (not granted, or not to this actor), or None."""
        holders = self.holders.get(group_id)
        if holders is None:
            return "ungranted"  # never granted, or already returned: a forgery or a late copy
        if actor_id not in holders:
            return "wrong_actor"
        self.granted.pop(group_id, None)
        del self.holders[group_id]
        return None

    def on_heartbeat(self, beat: Heartbeat) -> bool:
        """A heartbeat (the first one, or a hello, introduces an actor); False when refused."""
        if beat.actor_id not in self.actors and len(self.actors) >= self.max_actors:
            self.refused["too_many_actors"] += 1
            return False
        if beat.hello:
            self.hellos.hello(beat, self.announced_version)
            self.joins.pop(beat.actor_id, None)  # the newest one, moved to the end: bounded by the live ids
            self.joins[beat.actor_id] = ActorJoin(beat.actor_id, beat.version, self.announced_version)
            self._requeue(beat.actor_id, "said hello again (restarted)")
        self.actors[beat.actor_id] = actor_info(beat, self.actors.get(beat.actor_id))
        return True

    def seen(self, actor_id: str) -> None:
        """A work request is a sign of life too."""
        if actor_id in self.actors:
            self.actors[actor_id].last_seen = time.monotonic()

    def expire_silent_actors(self) -> None:
        """Actors silent too long are gone; groups held by an id that is not a live actor go back."""
        now = time.monotonic()
        for actor_id, info in list(self.actors.items()):
            if now - info.last_seen > self.actor_timeout_s:
                del self.actors[actor_id]
                self._requeue(actor_id, f"silent for {now - info.last_seen:.1f} s")

    def take_joins(self) -> list[ActorJoin]:
        joins, self.joins = self.joins, {}
        return list(joins.values())

    def _requeue(self, actor_id: str, why: str) -> None:
        """Queue an actor's unreturned groups again, at the front (they are the oldest)."""
        mine = [gid for gid, (owner, _) in self.granted.items() if owner == actor_id]
        if not mine:
            return
        self.pending.extendleft(reversed([self.granted.pop(gid)[1] for gid in mine]))
        self.num_redispatched += len(mine)
        log.warning("actor %s %s: re-dispatching its %d unreturned groups", actor_id, why, len(mine))

    def metrics(self, rejected: dict[str, int]) -> dict[str, float]:
        return {"broker/pending_prompt_groups": float(len(self.pending)),
                "broker/granted_groups": float(self.num_granted),
                "broker/unreturned_groups": float(len(self.granted)),
                "broker/redispatched_groups": float(self.num_redispatched),
                "broker/live_actors": float(len(self.actors))} | common_metrics(list(self.actors.values()),
                                                                                 rejected | self.refused)
