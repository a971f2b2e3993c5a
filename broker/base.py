"""The two faces of a transport: what the learner sees and what an actor sees.

The learner side is synchronous and thread-safe (the coordinator thread submits prompts, the
training loop takes rollouts and publishes weights); the actor side is asyncio, because the
actor runs vLLM's AsyncLLM. Implementations: zmq (embedded default), redis (durable) and
inproc (both sides in one process, for tests and notebooks).

Delivery is at-least-once on both: a consumer that dies before acknowledging gets its work
redelivered, so every consumer of the learner side deduplicates by group id.
"""

from __future__ import annotations

import abc
import collections
import logging
import time
from dataclasses import dataclass, field

from tidal.broker.schema import Heartbeat, PromptGroup, RolloutGroup, Shutdown, WeightUpdate


@dataclass
class ActorInfo:
    """What the learner knows about one live actor, from its heartbeats."""

    actor_id: str
    version: int
    engine: dict[str, str]
    outstanding: list[str]
    num_generated_tokens: int = 0
    weight_swap_paused_s: float = 0.0
    last_seen: float = field(default_factory=time.monotonic)
    flow: dict[str, float] = field(default_factory=dict)  # where its time went, as its latest heartbeat said
    baseline: dict[str, float] = field(default_factory=dict)  # the flow its shares are measured from
    shares: dict[str, float] = field(default_factory=dict)  # FLOW_SHARES over the latest FLOW_WINDOW_S
    beat_at: float = 0.0  # when its latest heartbeat came (last_seen also moves with its work requests)


log = logging.getLogger(__name__)

HELLO_LOG_EVERY_S = 10.0  # an actor's hello is logged when its engine changes, at most this often per id
ENGINE_LOG_CHARS = 512  # of an engine description in a log line
OUTSTANDING_KEPT = 256  # group ids of a heartbeat kept in ActorInfo (for inspection): a table of live actors
# is then at most broker.max_actors x (an engine description, ~35 KB by the wire's bounds, + these ids)


class HelloLog:
    """Hellos in the log only when an actor's engine changed (a restart changes its pid), and at most
    once per HELLO_LOG_EVERY_S per id: a peer repeating a hello, or alternating two, grows the log by
    a bounded amount. Remembers at most `max_ids` ids, the oldest forgotten first."""

    def __init__(self, max_ids: int, every_s: float = HELLO_LOG_EVERY_S):
        self.max_ids, self.every_s = max_ids, every_s
        # actor id -> (the engine last logged, when, hellos since that were not logged)
        self._last: collections.OrderedDict[str, tuple[dict, float, int]] = collections.OrderedDict()

    def hello(self, beat: Heartbeat, announced: int) -> None:
        now = time.monotonic()
        engine, logged_at, unlogged = self._last.pop(beat.actor_id, (None, -self.every_s, 0))
        if beat.engine == engine or now - logged_at < self.every_s:
            self._remember(beat.actor_id, (engine, logged_at, unlogged + 1))
            return
        since = f"; {unlogged} hellos since the last one logged" if unlogged else ""
        log.info(
            "actor %s joined (engine %s, weight version %d, latest announced %d%s)",
            beat.actor_id,
            str(beat.engine)[:ENGINE_LOG_CHARS],
            beat.version,
            announced,
            since,
        )
        self._remember(beat.actor_id, (beat.engine, now, 0))

    def _remember(self, actor_id: str, entry: tuple[dict, float, int]) -> None:
        self._last[actor_id] = entry
        while len(self._last) > self.max_ids:
            self._last.popitem(last=False)


def actor_info(beat: Heartbeat, known: ActorInfo | None, now: float | None = None) -> ActorInfo:
    """What the learner keeps of a heartbeat: the engine description of the last one when unchanged
    (one copy per actor, not one per heartbeat), the first OUTSTANDING_KEPT group ids, and where the
    actor's time went between this heartbeat and the one before."""
    engine = known.engine if known is not None and known.engine == beat.engine else dict(beat.engine)
    now = time.monotonic() if now is None else now
    flow = {name: getattr(beat, name) for name in ("uptime_s", *FLOW_SHARES.values(), "weight_pull_s")}
    return ActorInfo(
        beat.actor_id,
        beat.version,
        engine,
        beat.outstanding[:OUTSTANDING_KEPT],
        beat.num_generated_tokens,
        beat.weight_swap_paused_s,
        now,
        flow,
        *flow_shares(known, flow),
        now,
    )


# the shares of an actor's time the learner reports, from the heartbeat's totals, each over a window of
# about FLOW_WINDOW_S of the actor's time (one heartbeat's second would be noise)
FLOW_SHARES = {
    "flow/actor_work_wait_share": "work_wait_s",
    "flow/actor_weights_wait_share": "weights_wait_s",
    "flow/actor_pause_share": "weight_pause_s",
    "flow/actor_pull_share": "weight_pulls_s",
}
FLOW_WINDOW_S = 10.0


def flow_shares(known: ActorInfo | None, flow: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(baseline, shares): each FLOW_SHARES total's growth over the actor's uptime since the baseline, within
    [0, 1] (an actor could say anything), once FLOW_WINDOW_S have passed; until then the last shares. An
    uptime that went back (a restarted actor) starts again from this heartbeat."""
    baseline = known.baseline if known is not None and known.baseline else flow
    elapsed = flow["uptime_s"] - baseline["uptime_s"]
    if elapsed < 0:
        return flow, {}
    if elapsed < FLOW_WINDOW_S:
        return baseline, known.shares if known is not None else {}
    shares = {
        name: min(max((flow[total] - baseline[total]) / elapsed, 0.0), 1.0) for name, total in FLOW_SHARES.items()
    }
    return flow, shares


@dataclass
class ActorJoin:
    """An actor's hello: the version it runs then, and the newest version announced by then."""

    actor_id: str
    version: int
    announced: int


class ActorTable:
    """The live actors as their heartbeats describe them, one table for every learner transport: a
    heartbeat introduces an id or keeps it alive (a new id beyond `max_actors` is refused and counted
    in `refused`), a hello is logged (HelloLog) and kept as the id's newest join, and an id silent for
    `actor_timeout_s` is gone. Not thread-safe: the owning transport serializes every call."""

    def __init__(self, actor_timeout_s: float, max_actors: int, refused: collections.Counter[str]):
        self.actor_timeout_s, self.max_actors, self.refused = actor_timeout_s, max_actors, refused
        self.live: dict[str, ActorInfo] = {}
        self.joins: dict[str, ActorJoin] = {}  # the newest hello of each id since take_joins, in arrival order
        self.hellos = HelloLog(max_actors)
        self.announced_version = 0  # the newest weight version announced, for the join record

    def on_heartbeat(self, beat: Heartbeat, now: float | None = None) -> bool:
        """Track the sender; False when refused (a new id while `max_actors` are live)."""
        if beat.actor_id not in self.live and len(self.live) >= self.max_actors:
            self.refused["too_many_actors"] += 1
            return False
        if beat.hello:
            self.hellos.hello(beat, self.announced_version)
            self.joins.pop(beat.actor_id, None)  # the newest one, moved to the end: bounded by the live ids
            self.joins[beat.actor_id] = ActorJoin(beat.actor_id, beat.version, self.announced_version)
        self.live[beat.actor_id] = actor_info(beat, self.live.get(beat.actor_id), now)
        return True

    def seen(self, actor_id: str) -> None:
        """Another sign of life than a heartbeat (a work request)."""
        if actor_id in self.live:
            self.live[actor_id].last_seen = time.monotonic()

    def forget_silent(self, now: float | None = None) -> list[tuple[str, float]]:
        """The ids silent longer than actor_timeout_s, each with how long, taken out of the table."""
        now = time.monotonic() if now is None else now
        gone = [
            (actor_id, now - info.last_seen)
            for actor_id, info in self.live.items()
            if now - info.last_seen > self.actor_timeout_s
        ]
        for actor_id, _ in gone:
            del self.live[actor_id]
        return gone

    def take_joins(self) -> list[ActorJoin]:
        joins, self.joins = self.joins, {}
        return list(joins.values())


def common_metrics(actors: list[ActorInfo], rejected: dict[str, int]) -> dict[str, float]:
    """What every learner transport reports: the slowest recent weight swap and rejected frames."""
    out = {"broker/rejected_frames": float(sum(rejected.values()))}
    out |= {f"broker/rejected/{reason}": float(count) for reason, count in rejected.items()}
    if actors:
        out["timing/actor_weight_swap_paused_s"] = max(a.weight_swap_paused_s for a in actors)
        out["timing/actor_weight_pull_s"] = max(a.flow.get("weight_pull_s", 0.0) for a in actors)
    for name in FLOW_SHARES:
        shares = [a.shares[name] for a in actors if name in a.shares]
        if shares:
            out[name] = sum(shares) / len(shares)
    return out


class LearnerTransport(abc.ABC):
    """Learner side: prompt queue out, rollout stream in, weight announcements out."""

    shutdown_flush_s = 0.0  # how long the shutdown announcement needs before the transport may close
    # the ports it listens on, by name ({} when actors reach a server of their own, Redis, or the same process):
    # the learner writes them to run_dir/endpoints.json for actors started on ports chosen at bind time
    ports: dict[str, int]

    @abc.abstractmethod
    def submit_prompts(self, groups: list[PromptGroup]) -> None:
        """Queue prompt groups for the actors (never blocks; admission control bounds them)."""

    def resubmit_prompts(self, groups: list[PromptGroup]) -> None:
        """A learner resumed from a checkpoint queues again the groups outstanding at it. Whatever an
        earlier learner process queued and this one does not is withdrawn, where the transport kept it."""
        self.submit_prompts(groups)

    @abc.abstractmethod
    def recv_rollout(self, timeout_s: float) -> RolloutGroup | None:
        """The next valid rollout group, or None after timeout_s. Bad frames are counted, not raised."""

    @abc.abstractmethod
    def publish_weights(self, update: WeightUpdate) -> None:
        """Announce a new weight version to every actor, including ones that join later."""

    @abc.abstractmethod
    def shutdown_actors(self, reason: str) -> None:
        """Tell every actor to stop (the run is over)."""

    @abc.abstractmethod
    def actors(self) -> dict[str, ActorInfo]:
        """Actors heard from within the actor timeout."""

    def take_joins(self) -> list[ActorJoin]:
        """Hellos since the last call."""
        return []

    def take_dead_letters(self) -> list[str]:
        """Group ids given up on (delivered too often) since the last call."""
        return []

    def commit(self) -> None:
        """Everything returned by recv_rollout so far is durably handled (checkpointed): acknowledge it."""

    def leave_pending(self, group: RolloutGroup) -> None:
        """A group returned by recv_rollout that this learner will not use: keep it for a later one."""

    @abc.abstractmethod
    def bar(self, actor_id: str) -> None:
        """An actor whose rollouts the learner refuses while it keeps the others': it is granted nothing
        more, what it sends is refused (broker/rejected/barred), and the groups it holds go to the others."""

    @abc.abstractmethod
    def metrics(self) -> dict[str, float]:
        """broker/... counters: rejected frames by reason, queue depths."""

    @abc.abstractmethod
    def close(self) -> None: ...


class ActorTransport(abc.ABC):
    """Actor side (asyncio): ask for work, publish rollouts, hear announcements."""

    @abc.abstractmethod
    async def request_work(self, max_samples: int, timeout_s: float) -> list[PromptGroup]:
        """Prompt groups whose samples fit in max_samples; empty if none came within timeout_s."""

    @abc.abstractmethod
    async def send_rollout(self, group: RolloutGroup) -> None:
        """Publish a finished group; this also acknowledges its prompt."""

    @abc.abstractmethod
    async def next_announcement(self) -> WeightUpdate | Shutdown:
        """The one way an actor hears of new weights and of the run's end. The first call returns
        the current weights (a joining actor loads them before it works); later calls return what
        was announced since, the newest first (announcements are never queued up)."""

    @abc.abstractmethod
    async def heartbeat(self, beat: Heartbeat) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...
