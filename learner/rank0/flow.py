"""Flow metrics: where the run's time and tokens go. Rank 0 logs them with each step (`flow/*` in MLflow)
and serves them to Prometheus (`serve_metrics`), from the same state:

- the learner's time by phase (the step runner's clock): waiting for rollouts, training, pushing weights;
- how old a sample is when it trains, from its generation's end (the actor's clock, bounded by the
  learner's own release and arrival times, so a skewed or lying clock cannot age a group past them);
- tokens thrown away, by cause: `stale` (older than staleness.max_lag), `filtered` (zero-variance groups),
  `refused` (groups the learner refused as invalid);
- the actors' version lag behind the learner, and the queue (groups released and not taken, granted and
  not returned), from the step's broker metrics.

The actors' shares of time (waiting for work, for weights, paused) come with their heartbeats and reach
the step's metrics through the transport (`flow/actor_*_share`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping

from tidal.broker.base import ActorInfo
from tidal.broker.schema import RolloutGroup
from tidal.config import TrackingConfig
from tidal.learner.rank0.accounting import RecentRate
from tidal.learner.steps import PUSH, ROLLOUTS, TRAIN
from tidal.prometheus import COUNTER, GAUGE, MetricsEndpoint, Spec, StateClock

log = logging.getLogger(__name__)

DISCARDED = "discarded_tokens/"  # stats keys of tokens thrown away: discarded_tokens/<cause>
CAUSES = ("stale", "filtered", "refused")


class LearnerFlow:
    def __init__(self, clock: StateClock):
        self.clock = clock  # the step runner's
        self.generation_end: dict[str, float] = {}  # group id -> when its generation ended (time.time())
        self.last_ages: list[float] = []  # the ages of the last step's samples
        self.on_age = None  # Prometheus' histogram observer, when metrics are served
        self.since_step = clock.seconds()
        self.trained_rate = RecentRate()
        self.actor_lags: dict[str, float] = {}
        self.rollout_versions: dict[str, tuple[float, int]] = {}  # actor id -> (when, its engine's version then)
        self.step: Mapping[str, float] = {}  # the last step's metrics, which scrapes read between steps

    def received(self, group: RolloutGroup) -> None:
        """Any rollout says which version its actor ran at its end: fresher than a heartbeat (one a second),
        which between several steps a second would show a lag the actor never had."""
        newest = max((v for s in group.samples for v, _, _ in s.version_spans), default=None)
        if newest is not None:
            self.rollout_versions[group.actor_id] = (time.monotonic(), newest)

    def actor_versions(self, actors: Mapping[str, ActorInfo]) -> dict[str, int]:
        """Each live actor's engine version as last heard, from its heartbeat or its rollouts."""
        out = {}
        for actor_id, info in actors.items():
            when, version = self.rollout_versions.get(actor_id, (-math.inf, 0))
            out[actor_id] = version if when > info.beat_at else info.version
        for gone in self.rollout_versions.keys() - actors.keys():
            del self.rollout_versions[gone]
        return out

    def arrived(self, group: RolloutGroup, released_at: float) -> None:
        """An admitted training group: when its generation ended, within [its release, now]."""
        now = time.time()
        said = group.finished_at or now
        self.generation_end[group.group_id] = min(max(said, released_at), now)

    def trained(self, groups: Iterable[RolloutGroup]) -> None:
        now, self.last_ages = time.time(), []
        for group in groups:
            end = self.generation_end.pop(group.group_id, None)
            if end is not None:
                self.last_ages += [now - end] * len(group.samples)
        if self.on_age is not None:
            for age in self.last_ages:
                self.on_age(age)

    def forget(self, group_id: str) -> None:
        """A group that will not train (dropped at admission)."""
        self.generation_end.pop(group_id, None)

    def step_metrics(self, totals: Mapping[str, float], actors: Mapping[str, ActorInfo], version: int) -> dict:
        """flow/* for the step that made `version`, from the run's running totals and the live actors."""
        seconds = self.clock.seconds()
        spent = {phase: seconds[phase] - self.since_step[phase] for phase in seconds}
        self.since_step = seconds
        # never below 0: a rollout claiming a version the learner has not made yet is refused, not believed
        self.actor_lags = {a: float(max(version - v, 0)) for a, v in self.actor_versions(actors).items()}
        out = {
            "flow/learner_wait_share": spent[ROLLOUTS] / max(sum(spent.values()), 1e-9),
            **{f"flow/discarded_tokens/{cause}": float(totals.get(DISCARDED + cause, 0)) for cause in CAUSES},
        }
        discarded = sum(totals.get(DISCARDED + cause, 0) for cause in CAUSES)
        out["flow/discarded_token_frac"] = discarded / max(discarded + totals.get("trained_tokens", 0), 1)
        if self.last_ages:
            out["flow/sample_age_s_mean"] = sum(self.last_ages) / len(self.last_ages)
            out["flow/sample_age_s_max"] = max(self.last_ages)
        rate = self.trained_rate.add(time.monotonic(), totals.get("trained_tokens", 0))
        if rate is not None:
            out["flow/trained_tokens_per_s"] = rate
        if self.actor_lags:
            out["flow/actor_version_lag_mean"] = sum(self.actor_lags.values()) / len(self.actor_lags)
            out["flow/actor_version_lag_max"] = max(self.actor_lags.values())
        return out


SPECS = (
    Spec("tidal_learner_version", GAUGE, "the policy version: optimizer steps taken"),
    Spec("tidal_learner_rollout_wait_seconds_total", COUNTER, "seconds the learner waited for and admitted rollouts"),
    Spec("tidal_learner_train_seconds_total", COUNTER, "seconds in the forward, backward and optimizer passes"),
    Spec("tidal_learner_weight_push_seconds_total", COUNTER, "seconds publishing new weights to the actors"),
    Spec("tidal_learner_trained_tokens_total", COUNTER, "completion tokens trained on"),
    Spec("tidal_learner_generated_tokens_total", COUNTER, "completion tokens of the training rollouts received"),
    Spec("tidal_learner_discarded_tokens_total", COUNTER, "completion tokens thrown away, by cause", "cause"),
    Spec("tidal_learner_rejected_groups_total", COUNTER, "rollout groups refused as invalid"),
    Spec("tidal_learner_actor_version_lag", GAUGE, "learner version minus the version an actor's engine runs", "actor"),
    Spec("tidal_broker_pending_groups", GAUGE, "prompt groups released that no actor has taken"),
    Spec("tidal_broker_unreturned_groups", GAUGE, "prompt groups granted to actors and not yet returned"),
    Spec("tidal_broker_live_actors", GAUGE, "actors heard from recently"),
    Spec("tidal_broker_rejected_frames_total", COUNTER, "frames refused at the wire"),
)
# the step's broker metrics behind the queue gauges (Redis: the prompt stream's undelivered and pending)
FROM_STEP = {
    "tidal_broker_pending_groups": ("broker/pending_prompt_groups", "broker/prompt_lag"),
    "tidal_broker_unreturned_groups": ("broker/unreturned_groups", "broker/prompt_pending"),
    "tidal_broker_live_actors": ("broker/live_actors",),
    "tidal_broker_rejected_frames_total": ("broker/rejected_frames",),
    "tidal_learner_rejected_groups_total": ("learner/rejected_groups",),
}


def values(flow: LearnerFlow, totals: Mapping[str, float], version: int) -> dict:
    seconds = flow.clock.seconds()
    out = {
        "tidal_learner_version": version,
        "tidal_learner_rollout_wait_seconds_total": seconds[ROLLOUTS],
        "tidal_learner_train_seconds_total": seconds[TRAIN],
        "tidal_learner_weight_push_seconds_total": seconds[PUSH],
        "tidal_learner_trained_tokens_total": totals.get("trained_tokens", 0),
        "tidal_learner_generated_tokens_total": totals.get("gen_tokens", 0),
        "tidal_learner_discarded_tokens_total": {cause: totals.get(DISCARDED + cause, 0) for cause in CAUSES},
        "tidal_learner_actor_version_lag": dict(flow.actor_lags),
    }
    step = flow.step
    for name, keys in FROM_STEP.items():
        found = next((step[key] for key in keys if key in step), None)
        if found is not None:
            out[name] = found
    return out


def serve_metrics(learner, cfg: TrackingConfig, run: str) -> MetricsEndpoint | None:
    """Rank 0's /metrics on tracking.metrics_port; None where that is 0. `learner`: rank0.loop.Learner."""
    if not cfg.metrics_port:
        return None
    endpoint = MetricsEndpoint({"run": run})
    endpoint.describe(SPECS, lambda: values(learner.flow, learner.accounting.totals, learner.version))
    ages = endpoint.histogram(
        "tidal_learner_sample_age_seconds", "age of a sample when it trained, from its generation's end"
    )
    learner.flow.on_age = ages.observe
    port = endpoint.serve(cfg.metrics_host, cfg.metrics_port)
    log.info("learner: Prometheus metrics on http://%s:%d/metrics", cfg.metrics_host, port)
    return endpoint
