"""Policy-gradient losses as small plugins: `LossInputs` -> (loss, metrics).

Each loss is a weighted sum of per-token terms, with the weights set by the aggregation rule
over the whole update batch (learner.batch), so micro-batches and ranks simply add up.
Sequence-level losses (gspo) give every token of a sample the sample's term.

The behaviour ratio rho = pi_theta / pi_behaviour is formed in one place, `behaviour_ratios`, at
two levels: each token's own, and each sample's (the product of its token ratios, and their
geometric mean). From it come, for every loss alike:
- the masks (learner.loss.token_mask, IcePop, by each token's ratio; learner.loss.sequence_mask by
  each sample's geometric mean), which leave a token's term out of the loss: it keeps its place in
  the aggregation's denominator, as a token whose ratio is 0 would;
- the weight cispo, tis and ppo put on a term (`behaviour_weight`): the token's or the sample's ratio
  (learner.loss.ratio_level), cut to the loss's cap (truncate: TIS) or dropped above it (mask: MIS).
The masks read the step-start policy (the proximal logprobs where a step makes several updates), so
one step drops the same tokens in every update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.config import LossConfig, LossType, RatioLevel, RatioMode


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # float32 [tokens], learner logprobs (differentiable)
    behavior_logprobs: torch.Tensor  # float32 [tokens], from the actor at sampling time
    advantages: torch.Tensor  # float32 [tokens], the sample's advantage on each of its tokens
    weights: torch.Tensor  # float32 [tokens], aggregation weights; 0 for masked tokens
    prox_logprobs: torch.Tensor | None = None  # float32 [tokens], the policy at step start (ppo)
    sample_index: torch.Tensor | None = None  # int64 [tokens], which sample each token belongs to; None: one sample
    token_mask: torch.Tensor | None = None  # bool [tokens], False = left out of the loss and of sequence ratios


# e^20 (about 5e8) is far outside any clip range or cap; exp overflows float32 past 88, and a token's log
# ratio reaches about 116 at the logprob floor
MAX_LOG_RATIO = 20.0
GSPO_MAX_LOG_RATIO = MAX_LOG_RATIO

Metrics = dict[str, torch.Tensor]  # name -> float [tokens]; "clipped" is 1 where the loss clipped the token


@dataclass
class Ratios:
    """The behaviour ratio of every token of a micro-batch, at each level, and what the masks keep."""

    log_token: torch.Tensor  # float32 [tokens], log rho_t (no gradient)
    log_sequence: torch.Tensor  # float32 [tokens], its sample's sum of log rho_t: the log of the product
    log_geometric: torch.Tensor  # float32 [tokens], its sample's mean log rho_t: the log of the geometric mean
    token_kept: torch.Tensor  # bool [tokens], inside learner.loss.token_mask
    sequence_kept: torch.Tensor  # bool [tokens], its sample's geometric mean inside learner.loss.sequence_mask

    @property
    def kept(self) -> torch.Tensor:
        return self.token_kept & self.sequence_kept


def behaviour_ratios(policy_logprobs: torch.Tensor, inputs: LossInputs, cfg: LossConfig) -> Ratios:
    """The ratios of `policy_logprobs` [tokens] to the behaviour's, and the masks' verdicts; a sample's
    sums and means run over its trained tokens (token_mask) alone."""
    return ratios_of(policy_logprobs, inputs.behavior_logprobs, inputs.sample_index, inputs.token_mask, cfg)


def ratios_of(
    policy_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    sample_index: torch.Tensor | None,
    token_mask: torch.Tensor | None,
    cfg: LossConfig,
) -> Ratios:
    """`behaviour_ratios` from its parts (the step's statistics form the same ratios)."""
    log_token = (policy_logprobs.detach() - behavior_logprobs).float()
    index = sample_index if sample_index is not None else torch.zeros_like(log_token, dtype=torch.long)
    trained = token_mask if token_mask is not None else torch.ones_like(log_token, dtype=torch.bool)
    trained = trained.to(log_token.dtype)
    num_samples = int(index.max()) + 1 if index.numel() else 0
    sums = log_token.new_zeros(num_samples).index_add(0, index, log_token * trained)  # [samples]
    counts = trained.new_zeros(num_samples).index_add(0, index, trained).clamp(min=1)  # [samples]
    log_sequence, log_geometric = sums[index], (sums / counts)[index]
    return Ratios(
        log_token,
        log_sequence,
        log_geometric,
        _inside(log_token, cfg.token_mask),
        _inside(log_geometric, cfg.sequence_mask),
    )


def _inside(log_ratio: torch.Tensor, band: tuple[float, float]) -> torch.Tensor:
    low, high = band
    ratio = torch.exp(log_ratio.double())  # float64: e^116 at the logprob floor overflows float32
    return (ratio >= low) & (ratio <= high)


def behaviour_weight(
    log_token: torch.Tensor, log_sequence: torch.Tensor, cap: float, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, over the cap) [tokens]: the ratio at learner.loss.ratio_level, truncated to `cap` or
    masked above it by learner.loss.ratio_mode; finite at any log ratio."""
    log_ratio = log_token if cfg.ratio_level is RatioLevel.token else log_sequence
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))
    over = ratio > cap
    if cfg.ratio_mode is RatioMode.truncate:
        return ratio.clamp(max=cap), over
    return torch.where(over, 0.0, ratio), over


def _reinforce(inputs: LossInputs, cfg: LossConfig, cap: float) -> tuple[torch.Tensor, Metrics]:
    """-w * A * logp_theta, w the behaviour weight capped at `cap` (no gradient); with a token-level
    truncated ratio, cispo's and tis' own -sg(min(rho, cap)) * A * logp_theta."""
    ratios = behaviour_ratios(inputs.logprobs, inputs, cfg)
    weight, over = behaviour_weight(ratios.log_token, ratios.log_sequence, cap, cfg)
    per_token = -weight * inputs.advantages * inputs.logprobs
    return _weighted_sum(inputs, per_token, _step_start_ratios(inputs, cfg, ratios)), {"clipped": over.float()}


def _step_start_ratios(inputs: LossInputs, cfg: LossConfig, current: Ratios) -> Ratios:
    """The ratios the masks read: the step-start policy's where a step makes several updates."""
    return current if inputs.prox_logprobs is None else behaviour_ratios(inputs.prox_logprobs, inputs, cfg)


def _weighted_sum(inputs: LossInputs, per_token: torch.Tensor, ratios: Ratios) -> torch.Tensor:
    """sum w_t * term_t over the tokens the masks keep; a dropped term gives neither value nor gradient."""
    return (inputs.weights * torch.where(ratios.kept, per_token, 0.0)).sum()


def cispo(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """CISPO: the importance ratio is capped at eps_max and stops gradients; every token keeps its gradient."""
    return _reinforce(inputs, cfg, cfg.eps_max)


def tis(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """Truncated-IS REINFORCE: -sg(clamp(rho, 0, c)) * A * logp_theta."""
    return _reinforce(inputs, cfg, cfg.tis_cap)


def ppo(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """Decoupled PPO-clip: the trust region is around the proximal policy (the step-start weights),
    and the off-policy correction pi_prox / pi_behavior is a capped, gradient-free weight."""
    assert inputs.prox_logprobs is not None, "ppo needs the proximal (step-start) logprobs"
    ratio = torch.exp(inputs.logprobs - inputs.prox_logprobs)
    clipped_ratio = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps)
    adv = inputs.advantages
    surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
    prox = behaviour_ratios(inputs.prox_logprobs, inputs, cfg)
    behavior_weight, _ = behaviour_weight(prox.log_token, prox.log_sequence, cfg.prox_cap, cfg)
    per_token = -behavior_weight * surrogate
    # the clipped branch is the one taken (it carries no gradient) when it is strictly smaller
    clipped = (clipped_ratio * adv < ratio * adv).detach().float()
    return _weighted_sum(inputs, per_token, prox), {"clipped": clipped}


def gspo(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """GSPO: one ratio per sample, the geometric mean of its token ratios (to the behavior policy),
    clipped PPO-style at [1 - low, 1 + high]; each token carries its sample's term."""
    assert inputs.sample_index is not None and inputs.token_mask is not None, "gspo needs sample_index and token_mask"
    index, keep = inputs.sample_index, inputs.token_mask.to(inputs.logprobs.dtype)
    num_samples = int(index.max()) + 1 if index.numel() else 0
    log_ratio = (inputs.logprobs - inputs.behavior_logprobs) * keep  # masked tokens stay out of the mean
    sums = log_ratio.new_zeros(num_samples).index_add(0, index, log_ratio)  # [samples]
    counts = keep.new_zeros(num_samples).index_add(0, index, keep).clamp(min=1)  # [samples]
    # [tokens], the sample's ratio on each token; capped where exp would overflow float32 (and its product
    # with an advantage turn into inf or NaN): so far off-policy, the sample's gradient is dropped
    seq_ratio = torch.exp((sums / counts).clamp(max=GSPO_MAX_LOG_RATIO))[index]
    clipped_ratio = seq_ratio.clamp(1 - cfg.gspo_clip_low, 1 + cfg.gspo_clip_high)
    adv = inputs.advantages
    per_token = -torch.minimum(seq_ratio * adv, clipped_ratio * adv)
    clipped = (clipped_ratio * adv < seq_ratio * adv).detach().float()
    ratios = _step_start_ratios(inputs, cfg, behaviour_ratios(inputs.logprobs, inputs, cfg))
    return _weighted_sum(inputs, per_token, ratios), {"clipped": clipped}


LOSSES = {LossType.cispo: cispo, LossType.tis: tis, LossType.ppo: ppo, LossType.gspo: gspo}


def policy_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    return LOSSES[cfg.type](inputs, cfg)
