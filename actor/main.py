"""`tidal actor --config FILE [key=value ...]`: one vLLM engine serving one learner."""
from __future__ import annotations

import asyncio
import logging
import signal

from tidal.config import RunConfig

log = logging.getLogger("tidal.actor")


async def serve(cfg: RunConfig) -> str:
    from tidal.actor.engine import Engine
    from tidal.actor.loop import Actor
    from tidal.broker.factory import actor_transport
    from tidal.tasks import get_reward
    from tidal.tiny import resolve_model_path

    cfg.model.path = resolve_model_path(cfg.model, cfg.task)
    index = int(cfg.actor.id.rsplit("-", 1)[-1]) if cfg.actor.id.rsplit("-", 1)[-1].isdigit() else 0
    transport = actor_transport(cfg.broker, cfg.actor.id, cfg.name)
    engine = Engine(cfg.actor, cfg.model.path, cfg.model.dtype, seed=cfg.actor.seed + index)
    await engine.set_version(0)
    actor = Actor(cfg.actor, engine, transport, {cfg.task.name: get_reward(cfg.task.name)})
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (setattr(actor, "stop_reason", f"signal {s.name}"), actor.stop.set()))
    try:
        reason = await actor.run()
    finally:
        engine.shutdown()
        transport.close()
    log.info("actor %s stopped: %s (%d groups, %d tokens, %d weight updates)", cfg.actor.id, reason,
             actor.stats["groups"], actor.stats["tokens"], actor.stats["weight_updates"])
    return reason


def main(cfg: RunConfig) -> int:
    if not cfg.actor.id:
        cfg.actor.id = "actor-0"
    asyncio.run(serve(cfg))
    return 0
