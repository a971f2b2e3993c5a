"""Picks the transport named by `broker.type`; the only place that knows the implementations."""

from __future__ import annotations

from tidal.broker.base import ActorTransport, LearnerTransport
from tidal.broker.schema import WireCodec
from tidal.config import BrokerConfig, BrokerType


def learner_transport(cfg: BrokerConfig, run: str, fresh: bool) -> LearnerTransport:
    """`run` names the Redis streams; `fresh` clears what an earlier run of that name left there."""
    codec = WireCodec(cfg.max_message_bytes)
    if cfg.type is BrokerType.redis:
        from tidal.broker.redis_transport import RedisLearnerTransport

        return RedisLearnerTransport(
            cfg.redis, codec, run, cfg.actor_timeout_s, fresh, cfg.max_actors, cfg.grant_timeout_s
        )
    from tidal.broker.zmq_transport import ZmqLearnerTransport

    return ZmqLearnerTransport(cfg, codec)


def actor_transport(cfg: BrokerConfig, actor_id: str, run: str) -> ActorTransport:
    codec = WireCodec(cfg.max_message_bytes)
    if cfg.type is BrokerType.redis:
        from tidal.broker.redis_transport import RedisActorTransport

        return RedisActorTransport(cfg.redis, codec, actor_id, run)
    from tidal.broker.zmq_transport import ZmqActorTransport

    return ZmqActorTransport(cfg, codec, actor_id)
