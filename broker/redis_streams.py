"""What a run's Redis streams hold, by training group id: a read-only look for `tidal ledger check --redis`.

    prompts   undelivered (after the actors' read position) · pending at an actor · acknowledged
    rollouts  undelivered (after the learner's read position) · pending at the learner · acknowledged
    dead      the group ids of the dead letters, each with the stream it was moved from

An acknowledged entry is one the learner committed after a checkpoint (or a prompt read with NOACK,
which the learner sends again); trimming drops acknowledged entries only, never one undelivered or
pending, so those two states are complete while the acknowledged ones are what is left until the next
trim. Evaluation groups and frames without a group id are left out. Nothing is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import redis
from redis.exceptions import NoPermissionError, ResponseError

from tidal.broker.redis_transport import (
    ACTORS,
    LEARNER,
    BrokerAuthError,
    BrokerUnavailable,
    StreamKeys,
    client_kwargs,
    entry_key,
    shown_url,
)
from tidal.config import RedisConfig

PAGE_ENTRIES = {"prompts": 1000, "rollouts": 100}  # per XRANGE: rollouts carry every sample's tokens


class NoRunStreams(LookupError):
    """The Redis answered but holds none of the run's streams."""


@dataclass
class StreamGroups:
    """The training group ids of one stream's entries, by where each entry stands in its consumer group
    (a group sent again, or sent twice, may have entries in more than one state)."""

    undelivered: set[str] = field(default_factory=set)
    pending: set[str] = field(default_factory=set)  # delivered, not acknowledged
    acknowledged: set[str] = field(default_factory=set)  # delivered and acknowledged, not trimmed yet

    @property
    def unacknowledged(self) -> set[str]:
        return self.undelivered | self.pending

    @property
    def all(self) -> set[str]:
        return self.unacknowledged | self.acknowledged


@dataclass
class RunStreams:
    where: str  # the keys and the Redis they were read from, password redacted
    prompts: StreamGroups = field(default_factory=StreamGroups)
    rollouts: StreamGroups = field(default_factory=StreamGroups)
    dead: dict[str, str] = field(default_factory=dict)  # group id -> "prompts" or "rollouts"


class _GroupOf(msgspec.Struct):
    """The two fields of a prompt or rollout frame this look needs; the rest is skipped unread."""

    group_id: str = ""
    eval_version: int | None = None


def training_group_id(frame: bytes) -> str:
    """The frame's group id; '' for an evaluation group or a frame that is not a tidal message."""
    try:
        found = msgspec.msgpack.decode(frame, type=_GroupOf)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""
    return found.group_id if found.eval_version is None else ""


def read_run_streams(cfg: RedisConfig, run: str) -> RunStreams:
    """The run's streams as they are now; raises BrokerUnavailable / BrokerAuthError naming the URL when
    Redis cannot be read, NoRunStreams when it holds none of the run's keys."""
    keys, url = StreamKeys(cfg.prefix, run), shown_url(cfg.url)
    r = redis.Redis.from_url(cfg.url, **client_kwargs(cfg, block_ms=0))
    try:
        if not r.exists(*keys.all()):
            raise NoRunStreams(
                f"Redis at {url} holds none of run {run!r}'s streams ({keys.prompts}, {keys.rollouts}, ...): "
                "a wrong URL, database or broker.redis.prefix, or a Redis that lost its data"
            )
        return RunStreams(
            where=f"{cfg.prefix}:{run}:* at {url}",
            prompts=_stream_groups(r, keys.prompts, ACTORS, "prompts"),
            rollouts=_stream_groups(r, keys.rollouts, LEARNER, "rollouts"),
            dead=_dead_letters(r, keys.dead),
        )
    except (NoPermissionError, redis.AuthenticationError) as err:
        who = f"user {cfg.username or '(from the URL or default)'}, password from ${cfg.password_env}"
        raise BrokerAuthError(
            f"Redis at {url} refused to let the check read run {run!r}'s streams ({who}): {err}"
        ) from err
    except (redis.ConnectionError, redis.TimeoutError) as err:
        raise BrokerUnavailable(f"Redis at {url} unreachable: {err}") from err
    except redis.RedisError as err:
        raise BrokerUnavailable(f"Redis at {url} could not be read: {err}") from err
    finally:
        r.close()


def _stream_groups(r, key: str, group: str, stream: str) -> StreamGroups:
    """Read position and pending entries first, then the entries: one delivered or acknowledged in
    between still counts as undelivered or pending, never as gone."""
    delivered, pending = _read_position(r, key, group), _pending_entries(r, key, group)
    out = StreamGroups()
    for entry_id, fields in _entries(r, key, PAGE_ENTRIES[stream]):
        group_id = training_group_id(fields.get(b"m", b""))
        if not group_id:
            continue
        if entry_key(entry_id) > delivered:
            out.undelivered.add(group_id)
        elif entry_id in pending:
            out.pending.add(group_id)
        else:
            out.acknowledged.add(group_id)
    return out


def _read_position(r, key: str, group: str) -> tuple[int, int]:
    """The consumer group's last delivered entry ((0, 0): no group, so nothing was delivered)."""
    try:
        groups = r.xinfo_groups(key)
    except ResponseError as err:
        if "no such key" in str(err):
            return (0, 0)
        raise
    ours = [g for g in groups if g["name"].decode() == group]
    return entry_key(ours[0]["last-delivered-id"]) if ours else (0, 0)


def _pending_entries(r, key: str, group: str, page: int = 1000) -> set[bytes]:
    found: set[bytes] = set()
    low = "-"
    while True:
        try:
            info = r.xpending_range(key, group, min=low, max="+", count=page)
        except ResponseError as err:
            if str(err).startswith("NOGROUP"):
                return found
            raise
        found.update(p["message_id"] for p in info)
        if len(info) < page:
            return found
        low = b"(" + info[-1]["message_id"]


def _entries(r, key: str, page: int):
    low = "-"
    while True:
        entries = r.xrange(key, low, "+", count=page)
        yield from entries
        if len(entries) < page:
            return
        low = b"(" + entries[-1][0]


def _dead_letters(r, key: str) -> dict[str, str]:
    """Group id -> the stream its dead letter came from; "prompts" wins where a group has both."""
    dead: dict[str, str] = {}
    for _, fields in _entries(r, key, PAGE_ENTRIES["prompts"]):
        group_id = fields.get(b"group_id", b"").decode(errors="replace")
        if group_id and dead.get(group_id) != "prompts":
            dead[group_id] = fields.get(b"stream", b"").decode(errors="replace")
    return dead
