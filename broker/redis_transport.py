"""Redis Streams transport: durable, at-least-once, multi-node.

    <prefix>:<run>:prompts     learner XADD ──► consumer group "actors" (one consumer per actor id)
    <prefix>:<run>:rollouts    actors  XADD ──► consumer group "learner"
    <prefix>:<run>:weights     learner XADD (WeightUpdate / Shutdown, last 16 kept) ──► actors XREAD
    <prefix>:<run>:heartbeats  actors  XADD (last ~1000 kept) ──► learner XREAD
    <prefix>:<run>:dead        entries delivered more than `max_deliveries` times, and bad frames

Acknowledgement rules, so that a crash anywhere loses nothing:
- Actors never acknowledge (their ACL user may not). An actor publishes a rollout; its prompt
  stays pending at it, and it renews its claim on every prompt it holds with each heartbeat, so
  long generations are not stolen. A restarted actor (same id) first re-reads its own pending
  prompts; prompts pending at a silent actor for `claim_idle_ms` are taken over with XAUTOCLAIM.
- The learner takes a rollout only if its group's prompt entry is pending at the actor that sent
  it (`PromptReceipts`), and XACKs both only in `commit()`, after the checkpoint that covers
  them. A restarted learner re-reads its pending rollouts: what it trained after its last
  checkpoint is trained again, once, by the resumed model. It sends again the groups outstanding
  at the checkpoint and withdraws (XACK + XDEL) every other prompt an earlier process left.
- The learner moves prompts delivered more than `max_deliveries` times to the dead stream, once they
  are old enough to have been claimed that often by actors going silent (`claim_idle_ms` apart): an
  actor user's XCLAIM ... RETRYCOUNT cannot make a fresh prompt look overdelivered.
- The learner sends again (a new entry; the old one acknowledged and deleted) every prompt it waits
  on that no actor can answer: one delivered but pending at no consumer (read with NOACK, or its
  consumer deleted), and one added `grant_timeout_s` ago and still not answered, whoever holds it.
- Trimming (XTRIM MINID) never passes the oldest pending entry or the group's read position. The
  learner also trims what actors write (heartbeats it has read; refused rollouts are deleted at once),
  since an actor's XADD may leave out MAXLEN.
- A full Redis (an OOM reply under maxmemory) is back-pressure, not an error: the call waits with
  backoff while the learner trims what it may, counted (broker/redis_oom_waits) and logged once per
  episode. Commands that free memory (XACK, XDEL, XTRIM, DEL, reads) are allowed then, so a learner
  restarted on a full AOF comes up and trims.
- Every call goes through `Reconnect`: while Redis is away (restart, failover) calls retry
  with backoff; after `reconnect_timeout_s` the error is raised, naming the URL.
Writes retried after a lost reply may land twice; consumers deduplicate by group id.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter, deque

import msgspec
import redis
import redis.asyncio
from redis.exceptions import OutOfMemoryError, ResponseError

from tidal.broker.base import (
    ActorInfo,
    ActorJoin,
    ActorTable,
    ActorTransport,
    LearnerTransport,
    common_metrics,
)
from tidal.broker.schema import Heartbeat, PromptGroup, RolloutGroup, Shutdown, WeightUpdate, WireCodec, WireError
from tidal.config import RedisConfig, redact_uri
from tidal.logs import SparseLog

log = logging.getLogger(__name__)

ACTORS, LEARNER = "actors", "learner"  # consumer group names
WEIGHTS_KEPT = 16
HEARTBEATS_KEPT = 1000
DEAD_KEPT = 100_000
DEAD_KEPT_FULL = 1000  # dead letters kept while Redis is full
READ_COUNT = 64
HEARTBEAT_POLL_S = 0.5
DEAD_FRAME_BYTES = 64 * 1024  # a dead letter keeps this much of its frame: enough to diagnose, bounded
PRESSURE_DELAY_S = (0.05, 2.0)  # first and longest wait while Redis is full


class BrokerUnavailable(ConnectionError):
    """Redis stayed unreachable for longer than broker.redis.reconnect_timeout_s."""


class BrokerAuthError(PermissionError):
    """Redis refused the credentials: retrying cannot help."""


class StreamKeys:
    def __init__(self, prefix: str, run: str):
        base = f"{prefix}:{run}"
        self.prompts, self.rollouts, self.weights = f"{base}:prompts", f"{base}:rollouts", f"{base}:weights"
        self.heartbeats, self.dead = f"{base}:heartbeats", f"{base}:dead"

    def all(self) -> list[str]:
        return [self.prompts, self.rollouts, self.weights, self.heartbeats, self.dead]


def client_kwargs(cfg: RedisConfig, block_ms: int) -> dict:
    """Connection settings; the password only ever comes from the environment."""
    kwargs = {"socket_timeout": block_ms / 1000 + 10, "socket_connect_timeout": 5, "health_check_interval": 15}
    password = os.environ.get(cfg.password_env) if cfg.password_env else None
    if password:
        kwargs["password"] = password
    if cfg.username:
        kwargs["username"] = cfg.username
    if cfg.ca_file:
        kwargs["ssl_ca_certs"] = cfg.ca_file
    return kwargs


# BusyLoadingError (AOF replay) is a ConnectionError; READONLY is a replica promoted-to-be after a failover
TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError)


def shown_url(url: str) -> str:
    """The Redis URL for logs and errors: password redacted, and no query string (redis-py takes
    connection options there, a password among them)."""
    return redact_uri(url).split("?", 1)[0]


def is_oom(err: Exception) -> bool:
    """Redis at maxmemory refusing a command that would grow it (also inside a pipeline's error)."""
    return isinstance(err, OutOfMemoryError) or (
        isinstance(err, ResponseError) and "command not allowed when used memory" in str(err)
    )


class Reconnect:
    """Retry policy shared by the sync (learner) and asyncio (actor) sides: while Redis is away, and
    while it is full (back-pressure: `relieve`, if set, is asked to free memory before each wait)."""

    def __init__(self, cfg: RedisConfig, relieve=None):
        self.url = shown_url(cfg.url)
        self.who = f"user {cfg.username or '(from the URL or default)'}, password from ${cfg.password_env}"
        self.timeout_s = cfg.reconnect_timeout_s
        self.down_since: float | None = None
        self.delay = 0.1
        self.reconnects = 0
        self.relieve = relieve  # () -> None: frees what it may (the learner trims); never raises OOM itself
        self.full_since: float | None = None  # start of the current episode of memory pressure
        self.full_delay = PRESSURE_DELAY_S[0]
        self.oom_waits = 0  # waits on a full Redis, over the whole process
        self._relieving = False

    def pressure(self, err: Exception) -> float:
        """Seconds to wait before retrying a write Redis refused for lack of memory."""
        if self.full_since is None:
            self.full_since, self.full_delay = time.monotonic(), PRESSURE_DELAY_S[0]
            log.warning(
                "Redis at %s is full (%s); writes wait and retry until memory is freed "
                "(the learner trims consumed entries; raise maxmemory if this persists)",
                self.url,
                err,
            )
        self.oom_waits += 1
        if self.relieve is not None and not self._relieving:
            self._relieving = True
            try:
                self.relieve()
            finally:
                self._relieving = False
        delay, self.full_delay = self.full_delay, min(self.full_delay * 2, PRESSURE_DELAY_S[1])
        return delay

    def relieved(self) -> None:
        if self.full_since is not None:
            log.warning(
                "Redis at %s accepts writes again after %.1f s full (%d waits so far)",
                self.url,
                time.monotonic() - self.full_since,
                self.oom_waits,
            )
            self.full_since = None

    def failed(self, err: Exception) -> float:
        """Seconds to wait before the next try; raises once Redis has been away too long."""
        if isinstance(err, redis.AuthenticationError):
            raise BrokerAuthError(f"Redis at {self.url} refused the credentials ({self.who}): {err}") from err
        now = time.monotonic()
        if self.down_since is None:
            self.down_since, self.delay = now, 0.1
            log.warning("Redis at %s unreachable (%s); retrying for up to %.0f s", self.url, err, self.timeout_s)
        if now - self.down_since > self.timeout_s:
            raise BrokerUnavailable(
                f"Redis at {self.url} unreachable for {now - self.down_since:.0f} s "
                f"(broker.redis.reconnect_timeout_s): {err}"
            ) from err
        delay, self.delay = self.delay, min(self.delay * 2, 2.0)
        return delay

    def succeeded(self, wrote_after_full: bool = False) -> None:
        """A call went through; one that had waited on a full Redis ends the episode of pressure."""
        if wrote_after_full:
            self.relieved()
        if self.down_since is not None:
            log.warning("Redis at %s back after %.1f s", self.url, time.monotonic() - self.down_since)
            self.reconnects += 1
            self.down_since = None

    def call(self, fn, *args, **kwargs):
        waited_full = False
        while True:
            try:
                result = fn(*args, **kwargs)
            except TRANSIENT as err:
                time.sleep(self.failed(err))
                continue
            except ResponseError as err:
                if not is_oom(err):
                    raise
                waited_full = True
                time.sleep(self.pressure(err))
                continue
            self.succeeded(waited_full)
            return result

    async def acall(self, fn, *args, **kwargs):
        waited_full = False
        while True:
            try:
                result = await fn(*args, **kwargs)
            except TRANSIENT as err:
                await asyncio.sleep(self.failed(err))
                continue
            except ResponseError as err:
                if not is_oom(err):
                    raise
                waited_full = True
                await asyncio.sleep(self.pressure(err))
                continue
            self.succeeded(waited_full)
            return result


def entry_key(entry: bytes | str) -> tuple[int, int]:
    """A stream entry id (b"<ms>-<seq>") as a pair that orders as Redis orders ids."""
    ms, _, seq = (entry.decode() if isinstance(entry, bytes) else entry).partition("-")
    return int(ms), int(seq or 0)


def entry_ms(entry: bytes | str) -> int:
    """When Redis added the entry (ms since the epoch, Redis's clock): the first half of its id."""
    return entry_key(entry)[0]


def is_nogroup(err: ResponseError) -> bool:
    return str(err).startswith("NOGROUP")


def dead_letter_fields(frame: bytes, stream: str, reason: str, group_id: str = "", deliveries: int = 0) -> dict:
    """A dead letter's record: its frame cut to DEAD_FRAME_BYTES, so a flood of large bad frames
    cannot grow the dead stream by their size."""
    return {
        "m": frame[:DEAD_FRAME_BYTES],
        "bytes": len(frame),
        "stream": stream,
        "reason": reason,
        "group_id": group_id,
        "deliveries": deliveries,
    }


class _GroupIdOnly(msgspec.Struct):
    group_id: str = ""


def peek_group_id(frame: bytes) -> str:
    """The group id of a frame we will not use, for the dead-letter record ('' if unreadable).
    Not a second decode through the codec: the frame was rejected (and counted) once already."""
    try:
        return msgspec.msgpack.decode(frame, type=_GroupIdOnly).group_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""


# ---- learner side -----------------------------------------------------------------------------


class PromptReceipts:
    """Which prompt entry stands for which group id, so that the learner takes a rollout only from
    the actor its prompt was delivered to, acknowledges prompts itself, and dead-letters prompts
    delivered too often. Thread-safe (the coordinator adds, the training thread checks)."""

    def __init__(self, r, link: Reconnect, keys: StreamKeys, max_deliveries: int):
        self.r, self.link, self.keys, self.max_deliveries = r, link, keys, max_deliveries
        self.entry_of: dict[str, bytes] = {}  # group id -> its newest prompt entry, until acknowledged
        self.answered: set[bytes] = set()  # entries whose rollout was taken, acknowledged at the next commit
        self.barred: set[str] = set()  # actor ids whose rollouts are refused; what they hold is sent again
        self.lock = threading.Lock()

    def index(self) -> None:
        """A restarted learner: the prompts still in the stream (trimming keeps every pending one)."""
        cursor = "-"
        while True:
            entries = self.link.call(self.r.xrange, self.keys.prompts, cursor, "+", count=1000)
            self.added([(peek_group_id(fields.get(b"m", b"")), entry_id) for entry_id, fields in entries])
            if len(entries) < 1000:
                return
            cursor = b"(" + entries[-1][0]

    def added(self, pairs: list[tuple[str, bytes]]) -> None:
        """New prompt entries; an older entry of the same group is stale: acknowledged and deleted now.
        Deleted too because one that no actor had read yet cannot be acknowledged, and an actor that
        read it later would work on a group whose rollout the learner refuses (it waits for the new entry)."""
        with self.lock:
            stale = [self.entry_of[gid] for gid, _ in pairs if gid in self.entry_of]
            self.entry_of.update((gid, entry) for gid, entry in pairs if gid)
            self.answered.difference_update(stale)
        self._retire_all(stale)

    def withdraw(self, entries: list[bytes]) -> None:
        """Entries whose rollout no learner will take: forgotten, acknowledged and deleted, read or not."""
        with self.lock:
            gone = set(entries)
            self.entry_of = {gid: e for gid, e in self.entry_of.items() if e not in gone}
            self.answered -= gone
        self._retire_all(entries)

    def _retire_all(self, entries: list[bytes]) -> None:
        for i in range(0, len(entries), 1000):
            self.link.call(self._retire, entries[i : i + 1000])

    def _retire(self, entries: list[bytes]) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.xack(self.keys.prompts, ACTORS, *entries)
        pipe.xdel(self.keys.prompts, *entries)
        pipe.execute()

    def check(self, groups: list[RolloutGroup]) -> list[tuple[str | None, bytes | None]]:
        """Per rollout: (why it is refused, or None; its prompt entry). One round trip for them all:
        one XPENDING per rollout cost more than everything else the learner does with it."""
        with self.lock:
            entries = [self.entry_of.get(g.group_id) for g in groups]
        asked = [e for e in entries if e is not None]

        def query():
            pipe = self.r.pipeline(transaction=False)
            for entry in asked:
                pipe.xpending_range(self.keys.prompts, ACTORS, min=entry, max=entry, count=1)
            return pipe.execute()

        answers = iter(self.link.call(query) if asked else [])
        out = []
        for group, entry in zip(groups, entries):
            info = next(answers) if entry is not None else None
            if group.actor_id in self.barred:
                out.append(("barred", None))
            elif not info:  # never granted, or acknowledged already (a copy of a rollout taken before)
                out.append(("ungranted", None))
            elif info[0]["consumer"].decode() != group.actor_id:
                out.append(("wrong_actor", None))
            else:
                out.append((None, entry))
        with self.lock:
            self.answered.update(entry for why, entry in out if why is None)
        return out

    def acknowledge(self, entries: list[bytes]) -> None:
        if not entries:
            return
        with self.lock:
            done = set(entries)
            self.entry_of = {gid: e for gid, e in self.entry_of.items() if e not in done}
            self.answered -= done
        for i in range(0, len(entries), 1000):
            self.link.call(self.r.xack, self.keys.prompts, ACTORS, *entries[i : i + 1000])

    def overdelivered(self, claim_idle_ms: int) -> list[tuple[bytes, str, int]]:
        """(entry, group id, deliveries) of prompts delivered more than max_deliveries times, and old enough
        for that: each redelivery is a claim after `claim_idle_ms` idle, so a count above what the entry's
        age allows was written by an XCLAIM ... RETRYCOUNT, not by actors going silent."""
        try:
            info = self.link.call(self.r.xpending_range, self.keys.prompts, ACTORS, min="-", max="+", count=1000)
        except ResponseError as err:
            if is_nogroup(err):
                return []
            raise
        old_enough = time.time() * 1000 - self.max_deliveries * claim_idle_ms
        over = [
            (p["message_id"], p["times_delivered"])
            for p in info
            if p["times_delivered"] > self.max_deliveries and entry_ms(p["message_id"]) <= old_enough
        ]
        with self.lock:
            by_entry = {e: gid for gid, e in self.entry_of.items()}
        return [(entry, by_entry.get(entry, ""), times) for entry, times in over]

    def unanswerable(self, overdue_s: float) -> dict[str, list[tuple[str, bytes]]]:
        """The prompt entries the learner waits on that no actor will answer, by why: `unpending`, delivered
        but pending at no consumer (read with NOACK, or its consumer deleted: no rollout of it can be
        taken); `overdue`, added more than `overdue_s` ago (0: never), whoever holds it; `barred`, held by
        an actor the learner barred."""
        with self.lock:
            waiting = {gid: e for gid, e in self.entry_of.items() if e not in self.answered}
        if not waiting:
            return {}

        def query():
            pipe = self.r.pipeline(transaction=True)  # one moment: what was delivered, and what is pending
            pipe.xinfo_groups(self.keys.prompts)
            pipe.xpending_range(self.keys.prompts, ACTORS, min="-", max="+", count=len(waiting) + 1000)
            return pipe.execute()

        try:
            groups, pending = self.link.call(query)
        except ResponseError as err:
            if is_nogroup(err):
                return {}
            raise
        ours = [g for g in groups if g["name"] == ACTORS.encode()]
        delivered = entry_key(ours[0]["last-delivered-id"]) if ours else (0, 0)
        held = {p["message_id"]: p["consumer"].decode() for p in pending}
        oldest = time.time() * 1000 - overdue_s * 1000
        found: dict[str, list[tuple[str, bytes]]] = {}
        for group_id, entry in waiting.items():
            if entry_key(entry) <= delivered and entry not in held:
                found.setdefault("unpending", []).append((group_id, entry))
            elif held.get(entry) in self.barred:
                found.setdefault("barred", []).append((group_id, entry))
            elif overdue_s > 0 and entry_ms(entry) < oldest:
                found.setdefault("overdue", []).append((group_id, entry))
        with self.lock:  # acknowledged meanwhile (trained): nothing to send again
            return {
                why: kept
                for why, pairs in found.items()
                if (kept := [(gid, e) for gid, e in pairs if self.entry_of.get(gid) == e])
            }


def ensure_groups(r, link: Reconnect, keys: StreamKeys) -> None:
    """The consumer groups of the prompt and rollout streams, created only when missing: XGROUP CREATE is
    refused by a full Redis even when the group exists."""
    for key, group in ((keys.prompts, ACTORS), (keys.rollouts, LEARNER)):
        if has_group(r, link, key, group):
            continue
        try:
            link.call(r.xgroup_create, key, group, id="0", mkstream=True)
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise


def has_group(r, link: Reconnect, key: str, group: str) -> bool:
    try:
        groups = link.call(r.xinfo_groups, key)
    except ResponseError as err:
        if "no such key" in str(err):
            return False
        raise
    return any(g["name"].decode() == group for g in groups)


def trim_consumed(r, link: Reconnect, key: str, group: str) -> None:
    """Drop a stream's entries before the oldest one still pending, and never past the read position."""
    try:
        groups = {g["name"].decode(): g for g in link.call(r.xinfo_groups, key)}
    except ResponseError as err:
        if "no such key" in str(err):  # Redis lost its data; the next read creates the group again
            return
        raise
    if group not in groups:
        return
    pending = link.call(r.xpending, key, group)
    floor = pending["min"] if pending["pending"] else groups[group]["last-delivered-id"]
    if floor and floor not in (b"0-0", "0-0"):
        link.call(r.xtrim, key, minid=floor)


class Heartbeats:
    """The heartbeat stream as the learner reads it into the live-actor table: at most every HEARTBEAT_POLL_S
    (each step asks several times) unless forced (Redis is full), then trimmed away. Locked: `relieve` may
    read it on another thread."""

    def __init__(self, r, link: Reconnect, keys: StreamKeys, codec: WireCodec, table: ActorTable, claim_idle_ms: int):
        self.r, self.link, self.keys, self.codec, self.table = r, link, keys, codec, table
        self.claim_idle_ms = claim_idle_ms
        self.lock = threading.RLock()
        self.cursor: bytes = b"0"
        self.polled_at = 0.0

    def start_after_the_newest(self) -> None:
        """Hellos from before a (re)start are history, and so is their memory: a Redis restarted full comes
        up with room."""
        last = self.link.call(self.r.xrevrange, self.keys.heartbeats, "+", "-", count=1)
        self.cursor = last[0][0] if last else b"0"
        self.trim()

    def trim(self) -> None:
        """Heartbeats before the newest one read are history: actors may append without MAXLEN."""
        if self.cursor not in (b"0", "0"):
            self.link.call(self.r.xtrim, self.keys.heartbeats, minid=self.cursor, approximate=False)

    def poll(self, force: bool = False) -> None:
        with self.lock:
            if not force and time.monotonic() - self.polled_at < HEARTBEAT_POLL_S:
                return
            self.polled_at = time.monotonic()
            reply = self.link.call(self.r.xread, {self.keys.heartbeats: self.cursor}, count=HEARTBEATS_KEPT)
            now = time.monotonic()
            entries = reply[0][1] if reply else []
            bad = []
            for entry_id, fields in entries:
                self.cursor = entry_id
                try:
                    self.table.on_heartbeat(self.codec.decode(fields.get(b"m", b""), expect=Heartbeat), now)
                except WireError as err:
                    bad.append((entry_id, err))
            if bad:  # one line per poll: a flood of bad entries must not become a flood of log lines
                log.warning("rejected %d heartbeat entries, the last %s: %s", len(bad), bad[-1][0].decode(), bad[-1][1])
            if entries:
                self.trim()
            for actor_id, silent_s in self.table.forget_silent(now):
                log.warning(
                    "actor %s silent for %.1f s; its prompts go to others after %d ms idle",
                    actor_id,
                    silent_s,
                    self.claim_idle_ms,
                )

    def actors(self) -> dict[str, ActorInfo]:
        self.poll()
        with self.lock:
            return dict(self.table.live)

    def take_joins(self) -> list[ActorJoin]:
        self.poll()
        with self.lock:
            return self.table.take_joins()

    def announced(self, version: int) -> None:
        with self.lock:
            self.table.announced_version = version


class DeadLetters:
    """Entries the learner gives up on, moved to the dead-letter stream with a bounded record of each: a
    rollout that cannot be read, a prompt delivered more than broker.redis.max_deliveries times."""

    def __init__(self, r, link: Reconnect, keys: StreamKeys):
        self.r, self.link, self.keys = r, link, keys
        self.cursor = b"0"
        self.num_dead_lettered = 0
        self.num_unrecorded = 0  # dead letters a full Redis had no room to record
        self.unrecorded: list[str] = []  # their group ids, for the next take

    def move(
        self,
        key: str,
        group: str,
        entry_id: bytes,
        frame: bytes,
        stream: str,
        reason: str,
        group_id: str,
        deliveries: int,
    ) -> None:
        """Entry out first (acknowledged and deleted: frees memory even when Redis is full), then its
        bounded record. A full Redis gets no record (waiting for room would stop the reads that free
        it): the group id is reported from memory and the loss counted."""

        def remove():
            pipe = self.r.pipeline(transaction=False)
            pipe.xack(key, group, entry_id)
            pipe.xdel(key, entry_id)
            pipe.execute()

        def record():
            try:
                return self.r.xadd(
                    self.keys.dead,
                    dead_letter_fields(frame, stream, reason, group_id, deliveries),
                    maxlen=DEAD_KEPT,
                    approximate=True,
                )
            except ResponseError as err:
                if not is_oom(err):
                    raise
                return None

        self.link.call(remove)
        if self.link.call(record) is None:
            self.num_unrecorded += 1
            self.num_dead_lettered += 1
            if group_id:
                self.unrecorded.append(group_id)

    def take(self) -> list[str]:
        """The group ids dead-lettered since the last take, by anyone (the stream), or unrecorded here."""
        reply = self.link.call(self.r.xread, {self.keys.dead: self.cursor}, count=1000)
        ids, self.unrecorded = self.unrecorded, []
        for entry_id, fields in reply[0][1] if reply else []:
            self.cursor = entry_id
            self.num_dead_lettered += 1
            if fields.get(b"group_id"):
                ids.append(fields[b"group_id"].decode())
        return ids


SEND_AGAIN_WHY = {
    "unpending": "delivered but pending at no actor: read with NOACK, or its consumer deleted",
    "overdue": "added broker.grant_timeout_s ago and not answered",
    "barred": "held by an actor whose rollouts the learner refuses",
}


class RedisLearnerTransport(LearnerTransport):
    def __init__(
        self,
        cfg: RedisConfig,
        codec: WireCodec,
        run: str,
        actor_timeout_s: float,
        fresh: bool,
        max_actors: int = 1024,
        grant_timeout_s: float = 0.0,
    ):
        self.cfg, self.codec, self.grant_timeout_s = cfg, codec, grant_timeout_s
        self.sent_again: Counter[str] = Counter()  # prompts no actor could answer, sent again, by why
        self.sparse = SparseLog(log)  # refused entries: a line at the 1st, 10th, 100th ... of each reason
        self.keys = StreamKeys(cfg.prefix, run)
        self.link = Reconnect(cfg, relieve=self.relieve)
        self.r = redis.Redis.from_url(cfg.url, **client_kwargs(cfg, cfg.block_ms))
        self.ports: dict[str, int] = {}
        # before the first Redis call, since a full Redis reads them (`relieve`); beyond max_actors live ids,
        # heartbeats of further new ids are refused and counted
        self.beats = Heartbeats(
            self.r,
            self.link,
            self.keys,
            codec,
            ActorTable(actor_timeout_s, max_actors, codec.rejected),
            cfg.claim_idle_ms,
        )
        self.dead = DeadLetters(self.r, self.link, self.keys)
        if fresh:  # a new run under this name: leftovers of an earlier one must not be consumed
            self.link.call(self.r.delete, *self.keys.all())
        self.beats.start_after_the_newest()
        ensure_groups(self.r, self.link, self.keys)
        self.receipts = PromptReceipts(self.r, self.link, self.keys, cfg.max_deliveries)
        if not fresh:
            self.receipts.index()
        self._buffer: deque[tuple[bytes, RolloutGroup, bytes]] = deque()
        self._seen: set[bytes] = set()  # rollout entry ids read by this process and not yet acknowledged
        self._to_ack: list[tuple[bytes, bytes]] = []  # (rollout entry, prompt entry) handed out, not committed
        self._last_entry: dict[str, bytes] = {}  # group id -> its entry, for leave_pending
        self._pending_cursor: bytes | None = b"0"  # re-read our own pending entries first

    # ---- memory ----------------------------------------------------------------------------------

    def relieve(self) -> None:
        """Redis is full: free what the learner may without losing work. Heartbeats (read first, hellos
        included), all but DEAD_KEPT_FULL dead letters, and consumed prompts and rollouts. Unread rollouts
        stay: the training thread reads them and deletes the refused ones."""
        self.beats.poll(force=True)  # read what is there (hellos included), then trim it
        self.link.call(self.r.xtrim, self.keys.dead, maxlen=DEAD_KEPT_FULL, approximate=False)
        trim_consumed(self.r, self.link, self.keys.prompts, ACTORS)
        trim_consumed(self.r, self.link, self.keys.rollouts, LEARNER)

    # ---- prompts and weights out -------------------------------------------------------------

    def submit_prompts(self, groups: list[PromptGroup]) -> None:
        if not groups:
            return
        self._add([(g.group_id, self.codec.encode(g)) for g in groups])

    def _add(self, waiting: list[tuple[str, bytes]]) -> None:
        """(group id, frame) pairs as new prompt entries; each replaces the group's earlier entry."""
        while waiting:  # a full Redis takes some of a pipeline and refuses the rest: only the rest again
            landed, waiting, full = self._xadd_pipelined(waiting)
            self.receipts.added(landed)
            if full is not None:
                time.sleep(self.link.pressure(full))
            elif landed and self.link.full_since is not None:
                self.link.relieved()

    def _xadd_pipelined(self, items: list[tuple[str, bytes]]):
        """One pipeline of prompt XADDs: (group id, entry) landed, items refused for memory, an OOM error."""

        def send():
            pipe = self.r.pipeline(transaction=False)
            for _, frame in items:
                pipe.xadd(self.keys.prompts, {"m": frame})
            return pipe.execute(raise_on_error=False)

        landed, refused, full = [], [], None
        for item, reply in zip(items, self.link.call(send)):
            if isinstance(reply, Exception):
                if not is_oom(reply):
                    raise reply
                refused.append(item)
                full = reply
            else:
                landed.append((item[0], reply if isinstance(reply, bytes) else reply.encode()))
        return landed, refused, full

    def resubmit_prompts(self, groups: list[PromptGroup]) -> None:
        """Also withdraws (acknowledges and deletes, read or not) every entry an earlier learner process
        left for any other group. Most are groups it released after the checkpoint, whose min_version is
        its version then (8 when this learner resumes at 7); this learner refuses their rollouts and
        releases their ids again later, as new entries. Left in the stream, a restarted actor takes them
        back, or reads them before the groups sent again, and they fill its slots waiting for a version
        this learner reaches only with rollouts of the groups sent again, which nobody then asks for.
        (Evaluations under way at the checkpoint go out again from Learner.begin.)"""
        resent = {g.group_id for g in groups}
        with self.receipts.lock:
            earlier = [entry for gid, entry in self.receipts.entry_of.items() if gid not in resent]
        self.submit_prompts(groups)
        self.receipts.withdraw(earlier)
        if earlier:
            log.info(
                "withdrew %d prompt entries an earlier learner process left for groups not sent again", len(earlier)
            )

    def publish_weights(self, update: WeightUpdate) -> None:
        self.beats.announced(update.version)
        self.link.call(
            self.r.xadd, self.keys.weights, {"m": self.codec.encode(update)}, maxlen=WEIGHTS_KEPT, approximate=False
        )

    def shutdown_actors(self, reason: str) -> None:
        self.link.call(
            self.r.xadd,
            self.keys.weights,
            {"m": self.codec.encode(Shutdown(reason=reason))},
            maxlen=WEIGHTS_KEPT,
            approximate=False,
        )

    # ---- rollouts in ---------------------------------------------------------------------------

    def recv_rollout(self, timeout_s: float) -> RolloutGroup | None:
        deadline = time.monotonic() + timeout_s
        while not self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._read(block_ms=max(1, min(int(remaining * 1000), self.cfg.block_ms)))
        entry_id, group, prompt_entry = self._buffer.popleft()
        self._to_ack.append((entry_id, prompt_entry))
        self._last_entry[group.group_id] = entry_id
        return group

    def leave_pending(self, group: RolloutGroup) -> None:
        entry_id = self._last_entry.pop(group.group_id, None)
        self._to_ack = [pair for pair in self._to_ack if pair[0] != entry_id]

    def _read(self, block_ms: int) -> None:
        cursor = self._pending_cursor
        reconnects = self.link.reconnects  # a read whose reply was lost left entries pending at us
        try:
            reply = self.link.call(
                self.r.xreadgroup,
                LEARNER,
                LEARNER,
                {self.keys.rollouts: cursor or ">"},
                count=READ_COUNT,
                block=None if cursor else block_ms,
            )
        except ResponseError as err:
            if not is_nogroup(err):
                raise
            log.warning("rollout consumer group missing (Redis lost its data?); creating it again")
            ensure_groups(self.r, self.link, self.keys)
            return
        entries = reply[0][1] if reply else []
        if cursor is not None:
            self._pending_cursor = entries[-1][0] if entries else None
            entries = [e for e in entries if e[0] not in self._seen]
            if entries:
                entries = self._drop_overdelivered(entries)
        if self.link.reconnects > reconnects:
            self._pending_cursor = b"0"
        fresh = [(entry_id, fields) for entry_id, fields in entries if entry_id not in self._seen]
        self._seen.update(entry_id for entry_id, _ in fresh)
        self._accept(fresh)

    def _drop_overdelivered(self, entries: list) -> list:
        """Pending entries that keep coming back (a poison rollout that kills the learner) go dead."""
        info = self.link.call(
            self.r.xpending_range,
            self.keys.rollouts,
            LEARNER,
            min=entries[0][0],
            max=entries[-1][0],
            count=len(entries),
            consumername=LEARNER,
        )
        times = {p["message_id"]: p["times_delivered"] for p in info}
        keep = []
        for entry_id, fields in entries:
            if times.get(entry_id, 0) > self.cfg.max_deliveries and fields:
                self._dead_letter(entry_id, fields.get(b"m", b""), "max_deliveries", times[entry_id])
            else:
                keep.append((entry_id, fields))
        return keep

    def _accept(self, entries: list) -> None:
        decoded = [
            (entry_id, group) for entry_id, fields in entries if (group := self._decode(entry_id, fields)) is not None
        ]
        for (entry_id, group), (why, prompt_entry) in zip(decoded, self.receipts.check([g for _, g in decoded])):
            if why is not None:  # never delivered to that actor: dropped, counted, and no slot freed
                self.codec.rejected[why] += 1
                self.sparse.warning(
                    f"rollout entries refused ({why})",
                    "refused rollout entry %s (group %s from %s)",
                    entry_id.decode(),
                    group.group_id[:80],
                    group.actor_id,
                )
                self._forget(entry_id)
                self._seen.discard(entry_id)
            else:
                self._buffer.append((entry_id, group, prompt_entry))

    def _forget(self, entry_id: bytes) -> None:
        """A rollout entry nobody will use: acknowledged and deleted now, so that a flood of refused
        entries frees its memory at once (XACK and XDEL are allowed when Redis is full)."""

        def forget():
            pipe = self.r.pipeline(transaction=False)
            pipe.xack(self.keys.rollouts, LEARNER, entry_id)
            pipe.xdel(self.keys.rollouts, entry_id)
            pipe.execute()

        self.link.call(forget)

    def _decode(self, entry_id: bytes, fields: dict | None) -> RolloutGroup | None:
        """The entry's rollout; None (acknowledged, or moved to the dead stream) when there is none."""
        if not fields:  # trimmed or deleted while pending: nothing left to use
            self.link.call(self.r.xack, self.keys.rollouts, LEARNER, entry_id)
            return None
        frame = fields.get(b"m", b"")
        try:
            return self.codec.decode(frame, expect=RolloutGroup)
        except WireError as err:
            self.sparse.warning(
                f"rollout entries rejected ({err.reason})", "rejected rollout entry %s: %s", entry_id.decode(), err
            )
            self._dead_letter(entry_id, frame, err.reason)
            return None

    def _dead_letter(self, entry_id: bytes, frame: bytes, reason: str, deliveries: int = 0) -> None:
        self.dead.move(
            self.keys.rollouts, LEARNER, entry_id, frame, "rollouts", reason, peek_group_id(frame), deliveries
        )

    def commit(self) -> None:
        pairs, self._to_ack = self._to_ack, []
        self._last_entry.clear()
        acks = [entry for entry, _ in pairs]
        for i in range(0, len(acks), 1000):
            self.link.call(self.r.xack, self.keys.rollouts, LEARNER, *acks[i : i + 1000])
        self._seen.difference_update(acks)  # acknowledged entries never come back: forget them
        self.receipts.acknowledge([prompt for _, prompt in pairs])
        trim_consumed(self.r, self.link, self.keys.prompts, ACTORS)
        trim_consumed(self.r, self.link, self.keys.rollouts, LEARNER)

    # ---- actors, dead letters, metrics -------------------------------------------------------

    def actors(self) -> dict[str, ActorInfo]:
        return self.beats.actors()

    def take_joins(self) -> list[ActorJoin]:
        return self.beats.take_joins()

    def take_dead_letters(self) -> list[str]:
        self._send_again(self.receipts.unanswerable(self.grant_timeout_s))
        for entry, group_id, times in self.receipts.overdelivered(self.cfg.claim_idle_ms):
            log.warning(
                "prompt group %s delivered %d times (> broker.redis.max_deliveries %d): dead-lettered",
                group_id or entry.decode(),
                times,
                self.cfg.max_deliveries,
            )
            frame = self.link.call(self.r.xrange, self.keys.prompts, entry, entry)
            self.dead.move(
                self.keys.prompts,
                ACTORS,
                entry,
                frame[0][1].get(b"m", b"") if frame else b"",
                "prompts",
                "max_deliveries",
                group_id,
                times,
            )
            self.receipts.acknowledge([entry])
        return self.dead.take()

    def _send_again(self, found: dict[str, list[tuple[str, bytes]]]) -> None:
        """Prompts no actor can answer (PromptReceipts.unanswerable) as new entries, counted by why."""
        for why, pairs in found.items():

            def frames(pairs=pairs):
                pipe = self.r.pipeline(transaction=False)
                for _, entry in pairs:
                    pipe.xrange(self.keys.prompts, entry, entry)
                return pipe.execute()

            again = [(gid, got[0][1][b"m"]) for (gid, _), got in zip(pairs, self.link.call(frames)) if got]
            self._add(again)
            self.sent_again[why] += len(again)
            if again:
                self.sparse.warning(
                    f"prompt groups sent again ({why})",
                    "sent %d prompt groups again that no actor could answer (%s: %s)",
                    len(again),
                    why,
                    SEND_AGAIN_WHY[why],
                )

    def bar(self, actor_id: str) -> None:
        with self.receipts.lock:
            self.receipts.barred.add(actor_id)  # what it holds is sent again at the next poll

    def metrics(self) -> dict[str, float]:
        live = list(self.actors().values())
        out = {
            "broker/live_actors": float(len(live)),
            "broker/dead_lettered": float(self.dead.num_dead_lettered),
            "broker/reconnects": float(self.link.reconnects),
            "broker/redis_oom_waits": float(self.link.oom_waits),
            "broker/dead_unrecorded": float(self.dead.num_unrecorded),
            "broker/barred_actors": float(len(self.receipts.barred)),
        } | {f"broker/sent_again/{why}": float(self.sent_again[why]) for why in SEND_AGAIN_WHY}
        for key, group, name in ((self.keys.prompts, ACTORS, "prompt"), (self.keys.rollouts, LEARNER, "rollout")):
            for g in self.link.call(self.r.xinfo_groups, key):
                if g["name"].decode() == group:
                    out[f"broker/{name}_pending"] = float(g["pending"])  # delivered, not acknowledged
                    out[f"broker/{name}_lag"] = float(g.get("lag") or 0)  # not delivered yet
        out["broker/pending_prompt_groups"] = out.get("broker/prompt_lag", 0.0)
        return out | common_metrics(live, self.codec.rejected)

    def close(self) -> None:
        self.r.close()


# ---- actor side -------------------------------------------------------------------------------


class RolloutOutbox:
    """Rollouts sent while a pipeline is in flight go out together in the next: an actor finishing
    many groups at once pays one round trip for them, not one each. Every sender waits until its own
    rollout is written (or the pipeline failed), so `send_rollout` keeps its meaning."""

    def __init__(self, write):
        self._write = write  # async (list of frames) -> None: one pipeline
        self._queue: list[tuple[bytes, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None

    async def send(self, frame: bytes) -> None:
        done = asyncio.get_running_loop().create_future()
        self._queue.append((frame, done))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())
        await done

    async def _flush(self) -> None:
        batch: list[tuple[bytes, asyncio.Future]] = []
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    await self._write([frame for frame, _ in batch])
                    error = None
                except Exception as err:  # each sender raises it: none of these frames is known to be written
                    error = err
                for _, done in batch:
                    if done.done():  # its sender was cancelled meanwhile
                        continue
                    if error is None:
                        done.set_result(None)
                    else:
                        done.set_exception(error)
        finally:  # cancelled (the actor stops): whoever still waits is cancelled too
            self._flusher = None
            for _, done in batch + self._queue:
                done.cancel()


class RedisActorTransport(ActorTransport):
    def __init__(self, cfg: RedisConfig, codec: WireCodec, actor_id: str, run: str):
        self.cfg, self.codec, self.actor_id = cfg, codec, actor_id
        self.keys = StreamKeys(cfg.prefix, run)
        self.link = Reconnect(cfg)
        self.r = redis.asyncio.Redis.from_url(cfg.url, **client_kwargs(cfg, cfg.block_ms))
        self._entries: dict[str, bytes] = {}  # group id -> prompt entry id, until its rollout is sent
        self._pending_cursor: bytes | None = b"0"  # a restarted actor first takes back its own prompts
        self._weights_cursor: bytes | None = None  # None until the first announcement is read
        self._next_claim = 0.0
        self._claim_cursor: bytes | str = "0-0"
        self._largest_n: int | None = None  # largest group seen: how many entries fit the free slots
        self._outbox = RolloutOutbox(self._write_rollouts)

    async def request_work(self, max_samples: int, timeout_s: float) -> list[PromptGroup]:
        """Own pending prompts first (after a restart), then idle ones of silent actors, then new
        ones while they fit: the first read blocks up to timeout_s, the rest do not."""
        taken = await self._own_pending() or await self._claim_idle()
        if taken:
            return await self._accept(taken)
        groups, budget, block_ms = [], max_samples, int(timeout_s * 1000)
        if budget < (self._largest_n or 1):  # no group fits yet: yield, or the caller's loop spins
            await asyncio.sleep(min(timeout_s, 0.01))
            return []
        while budget >= (self._largest_n or 1):
            count = max(1, budget // self._largest_n) if self._largest_n else 1
            entries = await self._read_new(count, None if groups else block_ms)
            if not entries:
                break
            new = await self._accept(entries)
            groups += new
            budget -= sum(g.n for g in new)
        return groups

    async def _accept(self, entries: list) -> list[PromptGroup]:
        groups = []
        for entry_id, fields, deliveries in entries:
            group = await self._decode_prompt(entry_id, fields, deliveries)
            if group is not None and self._entries.get(group.group_id) == entry_id:
                continue  # ours already: our own idle entry claimed back
            # a group we hold under another entry is one the learner sent again: the new entry is the one it takes
            if group is not None:
                self._entries[group.group_id] = entry_id
                self._largest_n = max(self._largest_n or 1, group.n)
                groups.append(group)
        return groups

    async def _xreadgroup(self, cursor, count: int, block: int | None):
        try:
            reply = await self.link.acall(
                self.r.xreadgroup, ACTORS, self.actor_id, {self.keys.prompts: cursor}, count=count, block=block
            )
        except ResponseError as err:
            if not is_nogroup(err):
                raise
            await asyncio.sleep(self.cfg.block_ms / 1000)  # the learner has not created the streams yet
            return None
        return reply[0][1] if reply else []

    async def _own_pending(self) -> list | None:
        if self._pending_cursor is None:
            return None
        entries = await self._xreadgroup(self._pending_cursor, READ_COUNT, None)
        if not entries:
            self._pending_cursor = None if entries is not None else self._pending_cursor
            return None
        self._pending_cursor = entries[-1][0]
        log.info("took back %d prompt groups this actor held before it restarted", len(entries))
        return await self._with_deliveries(entries)

    async def _claim_idle(self) -> list | None:
        """Prompts held too long by an actor that went silent become ours."""
        if time.monotonic() < self._next_claim:
            return None
        self._next_claim = time.monotonic() + max(self.cfg.claim_idle_ms / 2000, 1.0)
        try:
            reply = await self.link.acall(
                self.r.xautoclaim,
                self.keys.prompts,
                ACTORS,
                self.actor_id,
                min_idle_time=self.cfg.claim_idle_ms,
                start_id=self._claim_cursor,
                count=READ_COUNT,
            )
        except ResponseError as err:
            if is_nogroup(err):
                return None
            raise
        self._claim_cursor = reply[0]  # Redis scans a bounded slice per call: go on from where it stopped
        entries = [e for e in reply[1] if e[1]]
        if not entries:
            return None
        log.warning(
            "claimed %d prompt groups idle for more than %d ms at a silent actor", len(entries), self.cfg.claim_idle_ms
        )
        return await self._with_deliveries(entries)

    async def _read_new(self, count: int, block_ms: int | None) -> list | None:
        block = None if block_ms is None else max(1, min(block_ms, self.cfg.block_ms))
        entries = await self._xreadgroup(">", count, block)
        if not entries:
            return None
        return [(entry_id, fields, 1) for entry_id, fields in entries]

    async def _with_deliveries(self, entries: list) -> list:
        info = await self.link.acall(
            self.r.xpending_range,
            self.keys.prompts,
            ACTORS,
            min=entries[0][0],
            max=entries[-1][0],
            count=len(entries),
            consumername=self.actor_id,
        )
        times = {p["message_id"]: p["times_delivered"] for p in info}
        return [(entry_id, fields, times.get(entry_id, 1)) for entry_id, fields in entries]

    async def _decode_prompt(self, entry_id: bytes, fields: dict | None, deliveries: int) -> PromptGroup | None:
        """The group, or None for an entry to leave alone: unreadable, or delivered too often (the
        learner dead-letters those; an actor acknowledges nothing)."""
        frame = (fields or {}).get(b"m", b"")
        try:
            group = self.codec.decode(frame, expect=PromptGroup)
        except WireError as err:
            log.warning("rejected prompt entry %s: %s", entry_id.decode(), err)
            return None
        if deliveries > self.cfg.max_deliveries:
            log.warning(
                "prompt group %s delivered %d times (> broker.redis.max_deliveries %d): left to the "
                "learner's dead letters",
                group.group_id,
                deliveries,
                self.cfg.max_deliveries,
            )
            return None
        return group

    async def send_rollout(self, group: RolloutGroup) -> None:
        """The prompt stays pending at this actor (claim renewed by heartbeats) until the learner acknowledges it."""
        await self._outbox.send(self.codec.encode(group))

    async def _write_rollouts(self, frames: list[bytes]) -> None:
        async def write():
            async with self.r.pipeline(transaction=False) as pipe:
                for frame in frames:
                    pipe.xadd(self.keys.rollouts, {"m": frame})
                await pipe.execute()

        await self.link.acall(write)

    async def next_announcement(self) -> WeightUpdate | Shutdown:
        if self._weights_cursor is None:
            current = await self._current_weights()
            if current is not None:
                return current
        while True:
            reply = await self.link.acall(
                self.r.xread, {self.keys.weights: self._weights_cursor}, count=WEIGHTS_KEPT, block=self.cfg.block_ms
            )
            if not reply:
                continue
            entries = reply[0][1]
            self._weights_cursor = entries[-1][0]
            for _, fields in reversed(entries):  # the newest wins
                try:
                    return self.codec.decode(fields.get(b"m", b""), expect=(WeightUpdate, Shutdown))
                except WireError as err:
                    log.warning("rejected a frame on the weight stream: %s", err)

    async def _current_weights(self) -> WeightUpdate | None:
        """The newest weights in the stream (a Shutdown left by an earlier learner process is history)."""
        entries = await self.link.acall(self.r.xrevrange, self.keys.weights, "+", "-", count=WEIGHTS_KEPT)
        self._weights_cursor = entries[0][0] if entries else b"0"
        for _, fields in entries:
            try:
                return self.codec.decode(fields.get(b"m", b""), expect=WeightUpdate)
            except WireError:
                continue
        return None

    async def heartbeat(self, beat: Heartbeat) -> None:
        await self.link.acall(
            self.r.xadd, self.keys.heartbeats, {"m": self.codec.encode(beat)}, maxlen=HEARTBEATS_KEPT, approximate=True
        )
        held = list(self._entries.values())  # in the works, or sent and not yet acknowledged by the learner
        if held:  # renew the claim: resets the idle time others use to decide we are gone
            try:
                still = await self.link.acall(
                    self.r.xclaim, self.keys.prompts, ACTORS, self.actor_id, 0, held, justid=True
                )
            except ResponseError as err:
                if not is_nogroup(err):
                    raise
                return
            kept = {e if isinstance(e, bytes) else e.encode() for e in still}
            # acknowledged by the learner: no longer ours to renew
            self._entries = {gid: e for gid, e in self._entries.items() if e in kept or gid in beat.outstanding}

    def close(self) -> None:
        try:
            asyncio.get_running_loop().create_task(self.r.aclose())
        except RuntimeError:
            pass
