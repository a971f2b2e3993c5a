"""An actor's Prometheus metrics (tidal/prometheus.py): where its time goes, what it made, which weights
it runs. Read at each scrape from the actor's own state; the weight histograms are observed as loads end."""

from __future__ import annotations

import logging

from tidal.actor.loop import IDLE, WAITING_FOR_WEIGHTS, Actor
from tidal.config import TrackingConfig
from tidal.prometheus import COUNTER, GAUGE, MetricsEndpoint, Spec

log = logging.getLogger(__name__)

SPECS = (
    Spec("tidal_actor_weight_version", GAUGE, "the policy version the actor's engine runs"),
    Spec(
        "tidal_actor_work_wait_seconds_total",
        COUNTER,
        "seconds the actor held no prompt group: idle for lack of work (more actors than the learner can use)",
    ),
    Spec(
        "tidal_actor_weights_wait_seconds_total",
        COUNTER,
        "seconds every group the actor held waited for newer weights (its min_version): idle for the learner",
    ),
    Spec("tidal_actor_generated_tokens_total", COUNTER, "completion tokens the actor generated (not injected ones)"),
    Spec("tidal_actor_groups_total", COUNTER, "prompt groups the actor finished and sent"),
    Spec("tidal_actor_weight_updates_total", COUNTER, "weight versions the actor loaded"),
    Spec("tidal_actor_weight_load_failures_total", COUNTER, "weight loads that failed"),
    Spec(
        "tidal_actor_weight_received_bytes_total",
        COUNTER,
        "bytes of weights the actor took in (tcp, file), by kind: whole ranges, or deltas (weights.delta)",
        "kind",
    ),
    Spec("tidal_actor_inflight_samples", GAUGE, "samples the actor holds now (generating or waiting for weights)"),
)


def values(actor: Actor) -> dict[str, float]:
    seconds = actor.clock.seconds()
    return {
        "tidal_actor_weight_version": actor.engine.version,
        "tidal_actor_work_wait_seconds_total": seconds[IDLE],
        "tidal_actor_weights_wait_seconds_total": seconds[WAITING_FOR_WEIGHTS],
        "tidal_actor_generated_tokens_total": actor.stats["tokens"],
        "tidal_actor_groups_total": actor.stats["groups"],
        "tidal_actor_weight_updates_total": actor.stats["weight_updates"],
        "tidal_actor_weight_load_failures_total": actor.stats["weight_load_failures"],
        "tidal_actor_inflight_samples": actor.inflight_samples,
    } | received(actor)


def received(actor: Actor) -> dict:
    """The weight channel's byte counts, where it keeps them (the collective channels do not)."""
    counts = getattr(actor.receiver, "received", None)
    if counts is None:
        return {}
    return {"tidal_actor_weight_received_bytes_total": {"whole": counts.whole, "delta": counts.delta}}


def serve_metrics(actor: Actor, cfg: TrackingConfig, run: str) -> MetricsEndpoint | None:
    """The actor's /metrics on tracking.metrics_port; None where that is 0."""
    if not cfg.metrics_port:
        return None
    endpoint = MetricsEndpoint({"run": run, "actor": actor.cfg.id})
    endpoint.describe(SPECS, lambda: values(actor))
    pull = endpoint.histogram(
        "tidal_actor_weight_pull_seconds", "seconds per weight update, from taking it up to loaded (pause included)"
    )
    pause = endpoint.histogram("tidal_actor_weight_pause_seconds", "seconds the engine was paused per weight update")

    def loaded(pull_s: float, paused_s: float) -> None:
        pull.observe(pull_s)
        pause.observe(paused_s)

    actor.on_weights_loaded = loaded
    port = endpoint.serve(cfg.metrics_host, cfg.metrics_port)
    log.info("actor %s: Prometheus metrics on http://%s:%d/metrics", actor.cfg.id, cfg.metrics_host, port)
    return endpoint
