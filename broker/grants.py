"""Who holds which prompt group, for transports that acknowledge nothing (ZeroMQ, in-process).

Prompts are pulled, not pushed: a live actor (one heard from within `actor_timeout_s`) asks for
as many samples as it has free slots and is granted whole groups that fit; an id that never
introduced itself with a heartbeat is granted nothing. Every granted group is kept until its
rollout comes back, and a rollout is accepted only from an actor the group was granted to. An
actor silent for `actor_timeout_s`, or one that says hello again under the same id (it restarted),
has its unreturned groups queued again at the front; one of its earlier holders may still deliver
first, and the learner deduplicates by group id. Redis keeps the same record itself (its pending
entries). Not thread-safe: the owning transport serializes every call.

An actor the learner bars (its rollouts refused while the others' are kept) is granted nothing
more, its groups are queued again and its rollouts refused. No live actor can hoard the window: each
holds at most its fair share of the groups in circulation (queued or granted, split evenly over the
live actors), and a group granted `grant_timeout_s` ago and not returned is queued again for the
others, its holder still free to deliver it first.
"""

from __future__ import annotations

import collections
import logging
import math
import time

from tidal.broker.base import ActorInfo, ActorJoin, ActorTable, common_metrics
from tidal.broker.schema import Heartbeat, PromptGroup
from tidal.logs import SparseLog

log = logging.getLogger(__name__)


class GrantTable:
    def __init__(
        self, actor_timeout_s: float, max_actors: int = 1024, grant_timeout_s: float = 0.0, clock=time.monotonic
    ):
        self.grant_timeout_s = grant_timeout_s  # 0: a live actor keeps its grants until it returns them
        self.clock = clock
        self.pending: collections.deque[PromptGroup] = collections.deque()
        # group id -> (actor id, group, when granted), until returned or queued again
        self.granted: dict[str, tuple[str, PromptGroup, float]] = {}
        self.held: collections.Counter[str] = collections.Counter()  # actor id -> groups it holds in `granted`
        self.holders: dict[str, set[str]] = {}  # group id -> every actor it was granted to, until returned
        self.refused: collections.Counter[str] = collections.Counter()  # messages refused, by reason
        self.table = ActorTable(actor_timeout_s, max_actors, self.refused)
        self.num_granted = 0
        self.num_redispatched = 0
        self.num_overdue = 0  # grants taken back from a live actor after grant_timeout_s
        self.num_share_capped = 0  # requests cut to the asker's fair share
        self.barred: set[str] = set()  # actor ids whose rollouts the learner refuses (bar)
        self._overdue_log = SparseLog(log)

    @property
    def actors(self) -> dict[str, ActorInfo]:
        return self.table.live

    def submit(self, groups: list[PromptGroup]) -> None:
        self.pending.extend(groups)

    def take(self, actor_id: str, max_samples: int) -> list[PromptGroup]:
        """Whole groups from the front of the queue while their samples fit `max_samples` and the actor
        stays within its fair share; nothing for an id that is not a live actor."""
        if actor_id not in self.actors or actor_id in self.barred:
            return []
        groups: list[PromptGroup] = []
        budget, room = max_samples, self.fair_share() - self.held[actor_id]
        while self.pending and self.pending[0].n <= budget and len(groups) < room:
            group = self.pending.popleft()
            budget -= group.n
            groups.append(group)
            self.granted[group.group_id] = (actor_id, group, self.clock())
            self.holders.setdefault(group.group_id, set()).add(actor_id)
        if self.pending and self.pending[0].n <= budget and len(groups) >= room:
            self.num_share_capped += 1
        self.held[actor_id] += len(groups)
        self.num_granted += len(groups)
        return groups

    def fair_share(self) -> int:
        """The most groups one live actor may hold at once: an even part of those queued or granted."""
        working = len(self.actors.keys() - self.barred)
        return math.ceil((len(self.pending) + len(self.granted)) / max(working, 1))

    def returned(self, group_id: str, actor_id: str) -> str | None:
        """A rollout arrived; the reason to refuse it (not granted, or not to this actor), or None."""
        if actor_id in self.barred:
            return "barred"
        holders = self.holders.get(group_id)
        if holders is None:
            return "ungranted"  # never granted, or already returned: a forgery or a late copy
        if actor_id not in holders:
            return "wrong_actor"
        self._ungrant(group_id)
        del self.holders[group_id]
        return None

    def bar(self, actor_id: str) -> None:
        """Grant `actor_id` nothing more and refuse its rollouts; the groups it holds go back to the queue."""
        self.barred.add(actor_id)
        self._requeue(actor_id, "is barred (its rollouts are refused)")

    def on_heartbeat(self, beat: Heartbeat) -> bool:
        """A heartbeat (the first one, or a hello, introduces an actor); False when refused. A hello
        from an id that holds groups: it restarted, and they go back."""
        if not self.table.on_heartbeat(beat):
            return False
        if beat.hello:
            self._requeue(beat.actor_id, "said hello again (restarted)")
        return True

    def seen(self, actor_id: str) -> None:
        """A work request is a sign of life too."""
        self.table.seen(actor_id)

    def expire(self) -> None:
        """Actors silent too long are gone, and the groups they held go back; so do groups granted
        grant_timeout_s ago to an actor still alive (its holder may yet deliver first)."""
        for actor_id, silent_s in self.table.forget_silent():
            self._requeue(actor_id, f"silent for {silent_s:.1f} s")
        if self.grant_timeout_s > 0:
            self._take_back_overdue(self.clock() - self.grant_timeout_s)

    def _take_back_overdue(self, granted_before: float) -> None:
        overdue = [gid for gid, (_, _, at) in self.granted.items() if at < granted_before]
        if not overdue:
            return
        owners = collections.Counter(self.granted[gid][0] for gid in overdue)
        self.pending.extendleft(reversed([self._ungrant(gid) for gid in overdue]))
        self.num_overdue += len(overdue)
        self._overdue_log.warning(
            "grants taken back after broker.grant_timeout_s",
            "%d groups granted more than %.0f s ago and not returned are queued again "
            "(broker.grant_timeout_s; held by %s)",
            len(overdue),
            self.grant_timeout_s,
            dict(owners.most_common(3)),
        )

    def _ungrant(self, group_id: str) -> PromptGroup | None:
        """Drop a group's current grant (its holders stay able to deliver); returns the group."""
        grant = self.granted.pop(group_id, None)
        if grant is None:
            return None
        self.held[grant[0]] -= 1
        if self.held[grant[0]] <= 0:
            del self.held[grant[0]]
        return grant[1]

    def take_joins(self) -> list[ActorJoin]:
        return self.table.take_joins()

    def _requeue(self, actor_id: str, why: str) -> None:
        """Queue an actor's unreturned groups again, at the front (they are the oldest)."""
        mine = [gid for gid, (owner, _, _) in self.granted.items() if owner == actor_id]
        if not mine:
            return
        self.pending.extendleft(reversed([self._ungrant(gid) for gid in mine]))
        self.num_redispatched += len(mine)
        log.warning("actor %s %s: re-dispatching its %d unreturned groups", actor_id, why, len(mine))

    def metrics(self, rejected: dict[str, int]) -> dict[str, float]:
        return {
            "broker/pending_prompt_groups": float(len(self.pending)),
            "broker/granted_groups": float(self.num_granted),
            "broker/unreturned_groups": float(len(self.granted)),
            "broker/redispatched_groups": float(self.num_redispatched),
            "broker/overdue_groups": float(self.num_overdue),
            "broker/share_capped_requests": float(self.num_share_capped),
            "broker/live_actors": float(len(self.actors)),
            "broker/barred_actors": float(len(self.barred)),
        } | common_metrics(list(self.actors.values()), rejected | self.refused)
