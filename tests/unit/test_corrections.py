"""The off-policy corrections (learner.loss.token_mask, sequence_mask, ratio_level, ratio_mode) on every loss,
against a reference written from scratch: one loop per sample, in float64, the definitions as docs/corrections.md
states them. Loss and gradient agree under every aggregation and micro-batch layout, and both stay finite where
the logprobs sit at the floor and the ratios overflow float32."""

import math

import numpy as np
import pytest
import torch

from conftest import step_batch
from tidal.config import (
    AdvantageNorm,
    Aggregation,
    ConfigError,
    LossConfig,
    LossType,
    RatioLevel,
    RatioMode,
    load_config,
)
from tidal.learner.every_rank.batch import aggregation_weights, build_rows, collate, group_advantages
from tidal.learner.every_rank.loss import LossInputs, policy_loss
from tidal.learner.rank0.validation import logprob_floor

INF = float("inf")
CORRECTIONS = {
    "plain": {},
    "icepop": {"token_mask": (0.5, 2.0)},
    "geo_mask": {"sequence_mask": (0.8, 1.25)},
    "seq_tis": {"ratio_level": RatioLevel.sequence},
    "token_mis": {"ratio_mode": RatioMode.mask},
    "seq_mis_and_masks": {
        "ratio_level": RatioLevel.sequence,
        "ratio_mode": RatioMode.mask,
        "token_mask": (0.3, 3.0),
        "sequence_mask": (0.7, 1.4),
    },
}
CAPS = {LossType.cispo: "eps_max", LossType.tis: "tis_cap", LossType.ppo: "prox_cap"}


def _config(loss: LossType, how: Aggregation, correction: str) -> LossConfig:
    return LossConfig(
        type=loss,
        aggregation=how,
        eps_max=1.5,
        tis_cap=1.3,
        prox_cap=1.4,
        clip_eps=0.1,
        gspo_clip_low=0.05,
        gspo_clip_high=0.05,
        **CORRECTIONS[correction],
    )


def _batch(how: Aggregation, layout: str, seed: int = 0, spread: float = 0.6):
    """LossInputs of step_batch's groups in `layout`, the learner's logprobs (the leaf) near the behaviour's
    so that ratios fall on both sides of every band and cap, and the proximal ones a step away."""
    groups, masks = step_batch(6, seed)
    rows = build_rows(groups, masks, group_advantages(groups, AdvantageNorm.none), aggregation_weights(masks, how))
    mb = collate(rows, layout)
    rng = np.random.default_rng(seed + 1)
    num_tokens = len(mb.targets)
    logp = (mb.behavior_logprobs.double() + spread * torch.from_numpy(rng.standard_normal(num_tokens))).clamp(max=-1e-3)
    prox = (logp + 0.2 * torch.from_numpy(rng.standard_normal(num_tokens))).clamp(max=-1e-3)
    return LossInputs(
        logp.float().requires_grad_(),
        mb.behavior_logprobs,
        mb.advantages,
        mb.weights.float(),
        prox_logprobs=prox.float(),
        sample_index=mb.sample_index,
        token_mask=mb.token_mask,
    )


def _inside(ratio: float, band: tuple[float, float]) -> bool:
    return band[0] <= ratio <= band[1]


def _weight(ratio: float, cap: float, mode: RatioMode) -> float:
    if mode is RatioMode.truncate:
        return min(ratio, cap)
    return 0.0 if ratio > cap else ratio


def reference(inputs: LossInputs, cfg: LossConfig) -> tuple[float, np.ndarray]:
    """(loss, d loss / d logp [tokens]) by loops over samples and tokens, in float64."""
    logp = inputs.logprobs.detach().double().numpy()
    behavior = inputs.behavior_logprobs.double().numpy()
    prox = inputs.prox_logprobs.double().numpy()
    adv, w = inputs.advantages.double().numpy(), inputs.weights.double().numpy()
    sample, trained = inputs.sample_index.numpy(), inputs.token_mask.numpy()
    loss, grad = 0.0, np.zeros(len(logp))
    for i in np.unique(sample):
        tokens = [t for t in np.flatnonzero(sample == i) if trained[t]]
        if not tokens:
            continue
        # the masks read the step-start (proximal) policy
        start = {t: prox[t] - behavior[t] for t in tokens}
        geometric = math.exp(sum(start.values()) / len(tokens))
        now = {t: logp[t] - behavior[t] for t in tokens}
        for t in tokens:
            if not (_inside(math.exp(start[t]), cfg.token_mask) and _inside(geometric, cfg.sequence_mask)):
                continue
            term, slope = _term(cfg, t, tokens, now, start, logp, prox, adv)
            loss += w[t] * term
            for u, d in slope.items():
                grad[u] += w[t] * d
    return loss, grad


def _term(cfg, t, tokens, now, start, logp, prox, adv):
    """(token t's term, its derivative by each token's logp)."""
    a = adv[t]
    if cfg.type in (LossType.cispo, LossType.tis):
        ratio = math.exp(now[t] if cfg.ratio_level is RatioLevel.token else sum(now.values()))
        weight = _weight(ratio, getattr(cfg, CAPS[cfg.type]), cfg.ratio_mode)
        return -weight * a * logp[t], {t: -weight * a}
    if cfg.type is LossType.ppo:
        ratio = math.exp(start[t] if cfg.ratio_level is RatioLevel.token else sum(start.values()))
        weight = _weight(ratio, cfg.prox_cap, cfg.ratio_mode)
        r = math.exp(logp[t] - prox[t])
        clipped = min(max(r, 1 - cfg.clip_eps), 1 + cfg.clip_eps)
        if clipped * a < r * a:
            return -weight * clipped * a, {}
        return -weight * r * a, {t: -weight * r * a}
    s = math.exp(sum(now.values()) / len(tokens))  # gspo
    clipped = min(max(s, 1 - cfg.gspo_clip_low), 1 + cfg.gspo_clip_high)
    if clipped * a < s * a:
        return -clipped * a, {}
    return -s * a, {u: -a * s / len(tokens) for u in tokens}


AGGREGATIONS = list(Aggregation)
# gspo forms its own sequence ratio: ratio_level and ratio_mode are refused for it at load
PAIRS = [
    pytest.param(loss, correction, id=f"{loss.value}-{correction}")
    for loss in LossType
    for correction in CORRECTIONS
    if loss is not LossType.gspo or not correction.startswith(("seq_tis", "token_mis", "seq_mis"))
]


@pytest.mark.parametrize("loss, correction", PAIRS)
@pytest.mark.parametrize("how", AGGREGATIONS, ids=[a.value for a in AGGREGATIONS])
@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_every_loss_and_correction_matches_the_reference(loss, correction, how, layout):
    cfg = _config(loss, how, correction)
    inputs = _batch(how, layout)
    got, extra = policy_loss(inputs, cfg)
    got.backward()
    want, want_grad = reference(inputs, cfg)
    assert float(got.detach()) == pytest.approx(want, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(inputs.logprobs.grad.double().numpy(), want_grad, rtol=1e-4, atol=1e-7)
    assert extra["clipped"].shape == inputs.logprobs.shape


def test_the_batch_exercises_every_mask_and_cap():
    """The reference comparisons mean something: each band drops tokens and keeps others, each cap bites."""
    inputs = _batch(Aggregation.token_mean, "padded")
    keep = inputs.token_mask
    rho = torch.exp(inputs.prox_logprobs - inputs.behavior_logprobs)[keep]
    assert 0 < int(((rho < 0.5) | (rho > 2.0)).sum()) < int(keep.sum())
    now = torch.exp(inputs.logprobs.detach() - inputs.behavior_logprobs)[keep]
    assert (now > 1.5).any() and (now < 1.3).any()


def test_masked_tokens_stay_in_the_denominator():
    """A dropped token adds nothing, and the others' weights do not grow: as if its ratio were 0."""
    cfg = _config(LossType.cispo, Aggregation.token_mean, "icepop")
    inputs = _batch(Aggregation.token_mean, "padded")
    loss, _ = policy_loss(inputs, cfg)
    loss.backward()
    rho = torch.exp(inputs.prox_logprobs - inputs.behavior_logprobs)
    dropped = inputs.token_mask & ((rho < 0.5) | (rho > 2.0))
    assert dropped.any() and (inputs.logprobs.grad[dropped] == 0).all()
    kept = inputs.token_mask & ~dropped
    plain = _batch(Aggregation.token_mean, "padded")
    policy_loss(plain, _config(LossType.cispo, Aggregation.token_mean, "plain"))[0].backward()
    torch.testing.assert_close(inputs.logprobs.grad[kept], plain.logprobs.grad[kept])


@pytest.mark.parametrize("loss, correction", PAIRS)
def test_finite_at_the_logprob_floor(loss, correction):
    """Behaviour logprobs at the floor against learner logprobs near 0 (log ratios of about 116, whose
    exp overflows float32), and the reverse: loss and gradient finite."""
    inputs = _batch(Aggregation.prompt_mean, "packed")
    floor = logprob_floor(151_936)
    n = len(inputs.behavior_logprobs)
    behavior = torch.where(torch.arange(n) % 2 == 0, torch.tensor(floor), torch.tensor(-1e-3))
    logp = torch.where(torch.arange(n) % 2 == 0, torch.tensor(-1e-3), torch.tensor(floor)).requires_grad_()
    extreme = LossInputs(
        logp,
        behavior,
        inputs.advantages,
        inputs.weights,
        prox_logprobs=logp.detach().clone(),
        sample_index=inputs.sample_index,
        token_mask=inputs.token_mask,
    )
    loss_value, extra = policy_loss(extreme, _config(loss, Aggregation.prompt_mean, correction))
    loss_value.backward()
    assert torch.isfinite(loss_value) and torch.isfinite(logp.grad).all() and torch.isfinite(extra["clipped"]).all()


def test_bands_and_gspo_are_checked_at_load():
    for override, key in (
        ("learner.loss.token_mask=[1.5,2]", "token_mask"),
        ("learner.loss.sequence_mask=[0.5,0.9]", "sequence_mask"),
        ("learner.loss.sequence_mask=[-1,2]", "sequence_mask"),
    ):
        with pytest.raises(ConfigError, match=key):
            load_config("tiny", [override])
    with pytest.raises(ConfigError, match="gspo forms its own"):
        load_config("tiny", ["learner.loss.type=gspo", "learner.loss.ratio_level=sequence"])
    cfg = load_config("tiny", ["learner.loss.token_mask=[0.5,2]", "learner.loss.sequence_mask=[0.9,1.1]"])
    assert cfg.learner.loss.token_mask == (0.5, 2.0) and cfg.learner.loss.sequence_mask == (0.9, 1.1)
    assert load_config("tiny").learner.loss.token_mask == (0.0, INF)
