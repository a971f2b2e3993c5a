"""`tidal actor CONFIG [key=value ...]`: one vLLM engine serving one learner."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

from tidal.config import RunConfig

log = logging.getLogger("tidal.actor")


async def serve(cfg: RunConfig) -> str:
    """`cfg` is resolved (tidal.config.resolve): model path, actor id and index are set."""
    from tidal.actor.engine import Engine
    from tidal.actor.episode import Episodes
    from tidal.actor.loop import Actor
    from tidal.actor.metrics import serve_metrics
    from tidal.broker.factory import actor_transport
    from tidal.broker.weights import build_receiver

    transport = actor_transport(cfg.broker, cfg.actor.id, cfg.name)
    receiver = build_receiver(cfg.weights)
    engine = Engine(cfg.actor, cfg.model.path, cfg.model.dtype, adapter_rank=cfg.learner.lora.rank)
    await engine.set_version(0)
    if cfg.learner.lora.enabled:
        log.info(
            "actor %s: engine up, serving a LoRA adapter of rank %d over its base; each weight update "
            "replaces the adapter",
            cfg.actor.id,
            cfg.learner.lora.rank,
        )
    else:
        log.info("actor %s: engine up; weight updates enter it by %s", cfg.actor.id, await engine.weight_layout())
    # what start-up left (torch, vLLM, the tokenizer: ~600k objects) is kept out of the collector's full
    # passes: in a demo run one came every ~7 s of training and took ~0.4 s with this event loop (every
    # request's intake and output) stopped; without those objects a pass takes ~2 ms. Collected first, so
    # that no garbage is frozen with them; unfrozen at the end, so that Engine.shutdown can collect the engine
    gc.collect()
    gc.freeze()
    episodes = Episodes.of(cfg.task, cfg.env, engine.tokenizer)
    actor = Actor(cfg.actor, engine, transport, receiver, episodes)
    metrics = serve_metrics(actor, cfg.tracking, cfg.name)
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        actor.stop_reason = f"signal {sig.name}"
        actor.stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        reason = await actor.run()
    finally:
        gc.unfreeze()
        episodes.close()
        engine.shutdown()
        transport.close()
        if metrics is not None:
            metrics.close()
    log.info(
        "actor %s stopped: %s (%d groups, %d tokens, %d weight updates)",
        cfg.actor.id,
        reason,
        actor.stats["groups"],
        actor.stats["tokens"],
        actor.stats["weight_updates"],
    )
    return reason


def main(cfg: RunConfig) -> int:
    from tidal.config import resolve
    from tidal.models import resolve_model_path

    cfg = resolve(cfg, model_path=resolve_model_path(cfg.model, cfg.task), actor=True)  # actors never build
    asyncio.run(serve(cfg))
    return 0
