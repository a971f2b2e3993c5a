"""Whether the learner and the actors score alike, watched step by step (rank 0).

Tokens of samples made entirely at the learner's current version were sampled with the very weights
the learner holds: their ratio pi_learner / pi_behaviour must be 1 (`offpolicy/fresh_ratio`, the
geometric mean over them). When it strays from 1 for several steps in a row, every correction the
loss makes is biased by it, so the run says so once, in the learner's log, naming the settings that
can cause it; MLflow carries the figure as `offpolicy/fresh_ratio`.
"""

from __future__ import annotations

import math

from tidal.config import RunConfig
from tidal.learner.rank0.notices import notice

# |log fresh_ratio| above this is drift: fp32 actors and learner agree to about 1e-5 per token (a few
# parts in a million over a step), an actor serving bf16 weights to an fp32 learner to a few percent
FRESH_RATIO_TOLERANCE = 0.01
DRIFT_STEPS = 3  # in a row: one step's few fresh tokens may stray by chance


def likely_causes(cfg: RunConfig) -> list[str]:
    """The settings of `cfg` that make the actors score otherwise than the learner, most likely first."""
    causes = []
    if cfg.learner.mixed_precision != "no":
        causes.append(
            f"learner.mixed_precision={cfg.learner.mixed_precision}: the learner's forward pass runs in "
            f"half precision while the actors serve {cfg.model.dtype}"
        )
    if cfg.model.dtype != "float32" and cfg.model.head == "fp32":
        causes.append(
            f"model.dtype={cfg.model.dtype} with model.head=fp32: the actors serve rounded weights and the "
            "learner scores its fp32 master weights; model.head=served scores what they serve"
        )
    causes.append(
        "the engines compute otherwise than the learner (actor.vllm.* settings, a quantized or half-"
        "precision engine, other attention kernels), or an actor serves weights other than the version it "
        "reports (weights.*)"
    )
    return causes


class FreshRatioWatch:
    """Counts the steps in a row whose fresh ratio strays; warns once."""

    def __init__(self, causes: list[str], tolerance: float = FRESH_RATIO_TOLERANCE, steps: int = DRIFT_STEPS):
        self.causes, self.tolerance, self.steps = causes, tolerance, steps
        self.in_a_row, self.warned = 0, False

    def observe(self, metrics: dict[str, float], version: int) -> None:
        ratio = metrics.get("offpolicy/fresh_ratio")
        if ratio is None:  # no fresh token this step: nothing to compare
            return
        strays = ratio <= 0 or abs(math.log(ratio)) > self.tolerance
        self.in_a_row = self.in_a_row + 1 if strays else 0
        if self.in_a_row < self.steps or self.warned:
            return
        self.warned = True
        notice.warning(
            "the learner and the actors score the same weights differently: at version %d the fresh tokens' "
            "ratio (offpolicy/fresh_ratio, lag 0) was %.4f, off 1 by more than %.0f%% for %d steps in a row, "
            "so every off-policy correction is biased by it. Likely: %s. See docs/corrections.md",
            version,
            ratio,
            100 * self.tolerance,
            self.in_a_row,
            "; or ".join(self.causes),
        )
