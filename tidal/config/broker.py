"""broker.* and weights.*: the transport between the learner and the actors (ZeroMQ or Redis
Streams), and the weight channel that carries each new policy version to them, with the rules
that read these sections (curve_on, default_weights_dir)."""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from tidal.config.base import Section, _require, choices, opt
from tidal.config.redact import redact_uri


class BrokerType(enum.Enum):
    zmq = "zmq"
    redis = "redis"


# StrEnum: code outside the config reads it as its word (why: tidal/config/base.py)
class Curve(enum.StrEnum):
    auto = "auto"
    on = "on"
    off = "off"


class WeightTransport(enum.StrEnum):
    """The weight channels, in the order tidal.broker.weights registers them (one module each)."""

    file = "file"
    tcp = "tcp"
    gloo = "gloo"
    nccl = "nccl"


@dataclass(frozen=True)
class ZmqConfig(Section):
    """ZeroMQ endpoints; ports 0 are chosen free by the launcher."""

    host: str = opt("127.0.0.1", "address the learner binds and actors connect to")
    control_port: int = opt(0, "ROUTER: hello, heartbeats, work requests, prompt grants")
    rollout_port: int = opt(0, "PULL: rollout groups from actors")
    weights_port: int = opt(0, "PUB: weight announcements")
    rollout_hwm: int = opt(
        64, "rollouts the learner holds unread per actor connection (messages); beyond it they wait in the actor"
    )
    rollout_buffer_bytes: int = opt(
        512 * 1024 * 1024,
        "rollout_hwm in bytes: fewer rollouts are held when rollout_hwm "
        "frames of broker.max_message_bytes would be more than this "
        "(the socket counts frames, so its mark is this / "
        "broker.max_message_bytes, at least 2)",
    )
    control_hwm: int = opt(
        16,
        "control messages (hellos, heartbeats, work requests; each at most "
        "broker.max_control_bytes) the learner holds unread per connection; its I/O thread "
        "reads them as they come",
    )
    max_connections: int = opt(
        0,
        "TCP connections each learner socket (control, rollout, weights) keeps open, "
        "strangers' before their handshake included; newer ones are shut down at once. "
        "Bounds the learner's buffers in total (zmq_transport.buffer_bound_bytes). "
        "0 = twice broker.max_actors",
    )
    curve: Curve = opt(
        Curve.auto,
        "CURVE encryption and authentication (each actor's id bound to its key). `tidal "
        "run` always turns it on (with keys of its own in run_dir/keys when keys_dir is "
        "empty) and refuses off. A role started on its own: auto = on, with keys_dir's keys, or "
        "on loopback without keys_dir the run's own (the learner makes them in run_dir/keys; an "
        "actor given the same run_dir takes its own from there); off = anyone who reaches the "
        "ports is trusted as any actor (tests, and one-machine setups that accept that)",
    )
    keys_dir: str = opt(
        "", "CURVE keys, made by `tidal keys DIR --actors ...`; a role started alone with CURVE on needs it"
    )

    def check(self) -> None:
        # keys_dir is not required here: `tidal run` makes keys of its own, and a role started alone with CURVE on
        # and no keys fails before it builds anything (tidal.ops.cli), naming broker.zmq.keys_dir
        for key in ("rollout_hwm", "control_hwm"):  # a CURVE socket with a mark of 1 receives nothing
            _require(
                getattr(self, key) >= 2,
                f"broker.zmq.{key}",
                getattr(self, key),
                "must be >= 2 (0 would mean no bound; with CURVE on, 1 lets no message through)",
            )
        _require(
            self.max_connections >= 0,
            "broker.zmq.max_connections",
            self.max_connections,
            "must be >= 0 (0: twice broker.max_actors)",
        )


@dataclass(frozen=True)
class RedisConfig(Section):
    """Redis Streams: durable, at-least-once, multi-node. Secrets never live in the config:
    the password comes from the environment variable named by `password_env`."""

    url: str = opt("redis://127.0.0.1:6379/0", "redis:// or rediss:// (TLS); may carry a user name")
    username: str = opt("", "ACL user (overrides the URL's); e.g. one for actors, one for the learner")
    password_env: str = opt("TIDAL_REDIS_PASSWORD", "environment variable holding the password (unset = none)")
    ca_file: str = opt("", "TLS: CA bundle to verify the server (rediss:// URLs)")
    prefix: str = opt("tidal", "stream keys are <prefix>:<run name>:{prompts,rollouts,weights,heartbeats,dead}")
    claim_idle_ms: int = opt(60_000, "a prompt pending this long at a silent actor is taken over by another")
    max_deliveries: int = opt(3, "entries delivered more often go to the dead-letter stream")
    block_ms: int = opt(250, "longest blocking read")
    reconnect_timeout_s: float = opt(120.0, "give up (fail loudly) when Redis stays away this long")
    embedded: bool = opt(False, "`tidal run` starts a local redis-server (AOF on) in the run directory")
    embedded_port: int = opt(0, "port of the embedded server; 0 = a free one")

    def check(self) -> None:
        _require(
            self.url.startswith(("redis://", "rediss://", "unix://")),
            "broker.redis.url",
            redact_uri(self.url),
            "expected redis://, rediss:// (TLS) or unix://",
        )
        _require(
            not self.ca_file or self.url.startswith("rediss://"),
            "broker.redis.ca_file",
            self.ca_file,
            "a CA bundle verifies TLS: use a rediss:// URL",
        )
        _require(self.max_deliveries >= 1, "broker.redis.max_deliveries", self.max_deliveries, "must be >= 1")
        _require(self.claim_idle_ms >= 1, "broker.redis.claim_idle_ms", self.claim_idle_ms, "must be >= 1")


@dataclass(frozen=True)
class BrokerConfig(Section):
    """Transport between the learner and the actors."""

    type: BrokerType = opt(BrokerType.zmq, "zmq (embedded, no server) | redis (durable, multi-node)")
    max_message_bytes: int = opt(64 * 1024 * 1024, "frames above this are rejected and counted")
    max_control_bytes: int = opt(4 * 1024 * 1024, "hellos, heartbeats and work requests above this are refused")
    max_actors: int = opt(1024, "live actor ids at once; hellos beyond are refused")
    actor_timeout_s: float = opt(10.0, "an actor silent this long counts as gone (zmq: its groups are re-dispatched)")
    grant_timeout_s: float = opt(
        600.0,
        "a group granted this long ago and not returned is offered to the other actors "
        "too (zmq: the first rollout in counts; redis: sent again as a new entry, the one "
        "taken after it counts); raise it above the longest a group takes to generate; 0: never",
    )
    zmq: ZmqConfig = field(default_factory=ZmqConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)

    def check(self) -> None:
        """Both transports' keys, whichever broker.type picks: a bad broker.redis.url fails a zmq run too,
        as it always has (a preset switched to redis must not start failing)."""
        for key in ("max_message_bytes", "max_control_bytes", "max_actors"):
            _require(getattr(self, key) >= 1, f"broker.{key}", getattr(self, key), "must be >= 1")
        _require(self.grant_timeout_s >= 0, "broker.grant_timeout_s", self.grant_timeout_s, "must be >= 0 (0: never)")
        self.zmq.check()
        frame = self.max_message_bytes
        _require(
            self.zmq.rollout_buffer_bytes >= 2 * frame,
            "broker.zmq.rollout_buffer_bytes",
            self.zmq.rollout_buffer_bytes,
            f"must hold two frames of broker.max_message_bytes = {frame} (a "
            "mark of one frame lets no rollout through with CURVE on)",
        )
        _require(
            self.zmq.max_connections == 0 or self.zmq.max_connections >= self.max_actors,
            "broker.zmq.max_connections",
            self.zmq.max_connections,
            f"must be 0 or at least broker.max_actors = {self.max_actors} (an actor holds a connection to each "
            "socket; lower broker.max_actors too)",
        )
        self.redis.check()


@dataclass(frozen=True)
class WeightsConfig(Section):
    """The weight channel: how each new policy version reaches the actors."""

    dir: str = opt("", "where weight files are written; empty = a folder of this run's own in /dev/shm")
    keep: int = opt(
        3,
        "versions kept (files, or the network channels' buffers); older ones are deleted (fewer than 2 "
        "count as 2: an actor may still be reading the previous one)",
    )
    transport: WeightTransport = opt(
        WeightTransport.file,
        "file: a safetensors file per version in weights.dir; tcp: each actor pulls every version from the learner's "
        "memory; nccl (GPU) | gloo (CPU): each vLLM worker receives every version by broadcast",
    )
    tcp_host: str = opt(
        "127.0.0.1",
        "the network channels (tcp, nccl, gloo): the interface the learner serves weights "
        "on (0.0.0.0: every interface)",
    )
    tcp_port: int = opt(0, "the learner's port for weights (control, for nccl/gloo); 0 = any free port (announced)")
    tcp_advertise: str = opt("", "the host actors dial; empty = tcp_host (this machine's name when it is 0.0.0.0)")
    bucket_mib: int = opt(64, "a version is checked (and over the network sent) in byte ranges of this size")
    tcp_timeout_s: float = opt(30.0, "an actor gives up on a learner that sends nothing for this long")
    delta: bool = opt(
        False,
        "tcp, file: send each version as what changed since one the actor holds (per bucket, the XOR of the two "
        "zstd-compressed; a bucket that does not shrink goes whole), the result checked by the same sha256s; pays "
        "where weights travel in bf16 or fp16 at small learning rates",
    )
    tcp_prefetch: bool = opt(
        True,
        "tcp: fetch a version before pausing the engine, not in it (nccl, gloo: every "
        "version is received in the pause, each piece loaded as it lands)",
    )
    max_sends: int = opt(
        2,
        "nccl, gloo: versions the learner sends at once (to that many actors); nccl holds 2 GPU "
        "buffers of a bucket plus the largest tensor for each",
    )
    max_connections: int = opt(
        256,
        "connections the learner's weight port serves at once, a thread each (tcp: fetches "
        "in flight; gloo, nccl: one per joined actor for the whole run, plus its workers' "
        "brief rendezvous ones); more are told to retry",
    )

    def check(self) -> None:
        """The transport selects the keys that matter: the network channels' (tcp_*, max_*) only for tcp, gloo
        and nccl. tidal.broker.weights checks again as it builds a channel from a config made in code."""
        _require(
            self.transport in choices(WeightTransport),
            "weights.transport",
            self.transport,
            f"expected one of {', '.join(choices(WeightTransport))}",
        )
        _require(self.keep >= 1, "weights.keep", self.keep, "must be >= 1 (fewer than 2 count as 2)")
        _require(self.bucket_mib >= 1, "weights.bucket_mib", self.bucket_mib, "must be >= 1")  # every channel's ranges
        _require(
            not self.delta or self.transport in (WeightTransport.file, WeightTransport.tcp),
            "weights.delta",
            self.delta,
            f"applies to the tcp and file channels; {self.transport} broadcasts every version whole",
        )
        if self.transport == WeightTransport.file:
            return
        _require(self.tcp_timeout_s > 0, "weights.tcp_timeout_s", self.tcp_timeout_s, "must be > 0")
        _require(
            0 <= self.tcp_port < 65536, "weights.tcp_port", self.tcp_port, "must be in 0..65535 (0: any free port)"
        )
        _require(self.max_sends >= 1, "weights.max_sends", self.max_sends, "must be >= 1")
        _require(self.max_connections >= 1, "weights.max_connections", self.max_connections, "must be >= 1")


def default_weights_dir(run_name: str, run_dir: str | Path) -> str:
    """weights.dir when it is empty: a folder in /dev/shm of this run's own, so two runs never share (or
    prune) each other's files. The weight channel owns (and at the end removes) exactly this folder."""
    run_dir = Path(run_dir)
    run_key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return f"/dev/shm/tidal-{run_name}-{run_dir.name}-{run_key}"


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def curve_on(cfg: ZmqConfig) -> bool:
    """CURVE is on when asked, and by default whenever keys are named or the learner binds beyond
    loopback (`tidal run` writes curve=on for its children)."""
    beyond_loopback = cfg.host not in LOOPBACK and not cfg.host.startswith("127.")
    return cfg.curve == Curve.on or (cfg.curve == Curve.auto and (bool(cfg.keys_dir) or beyond_loopback))
