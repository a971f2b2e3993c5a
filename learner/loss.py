"""Policy-gradient losses as small plugins: `LossInputs` -> (loss, metrics).

Each loss is a weighted sum of per-token terms, with the weights set by the aggregation rule
over the whole update batch (learner.batch), so micro-batches and ranks simply add up.
Sequence-level losses (gspo) give every token of a sample the sample's term.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.config import LossConfig, LossType


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # float32 [tokens], learner logprobs (differentiable)
    behavior_logprobs: torch.Tensor  # float32 [tokens], from the actor at sampling time
    advantages: torch.Tensor  # float32 [tokens], the sample's advantage on each of its tokens
    weights: torch.Tensor  # float32 [tokens], aggregation weights; 0 for masked tokens
    prox_logprobs: torch.Tensor | None = None  # float32 [tokens], the policy at step start (ppo)
    sample_index: torch.Tensor | None = None  # int64 [tokens], which sample each token belongs to (gspo)
    token_mask: torch.Tensor | None = None  # bool [tokens], False = left out of the loss (gspo's sequence ratio)


# e^20 (about 5e8) is far outside any clip range; exp overflows float32 past 88
GSPO_MAX_LOG_RATIO = 20.0

Metrics = dict[str, torch.Tensor]  # name -> float [tokens]; "clipped" is 1 where the loss clipped the token


def _capped_reinforce(inputs: LossInputs, cap: float) -> tuple[torch.Tensor, Metrics]:
    """-sg(min(rho, cap)) * A * logp_theta; rho >= 0, so min(rho, cap) equals clamp(rho, 0, cap)."""
    rho = torch.exp(inputs.logprobs.detach() - inputs.behavior_logprobs)
    per_token = -rho.clamp(max=cap) * inputs.advantages * inputs.logprobs
    return (inputs.weights * per_token).sum(), {"clipped": (rho > cap).float()}


def cispo(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """CISPO: the importance ratio is capped at eps_max and stops gradients; every token keeps its gradient."""
    return _capped_reinforce(inputs, cfg.eps_max)


def tis(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """Truncated-IS REINFORCE: -sg(clamp(rho, 0, c)) * A * logp_theta."""
    return _capped_reinforce(inputs, cfg.tis_cap)


def ppo(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """Decoupled PPO-clip: the trust region is around the proximal policy (the step-start weights),
    and the off-policy correction pi_prox / pi_behavior is a capped, gradient-free weight."""
    assert inputs.prox_logprobs is not None, "ppo needs the proximal (step-start) logprobs"
    ratio = torch.exp(inputs.logprobs - inputs.prox_logprobs)
    clipped_ratio = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps)
    adv = inputs.advantages
    surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
    behavior_weight = torch.exp(inputs.prox_logprobs - inputs.behavior_logprobs).clamp(max=cfg.prox_cap)
    per_token = -behavior_weight * surrogate
    # the clipped branch is the one taken (it carries no gradient) when it is strictly smaller
    clipped = (clipped_ratio * adv < ratio * adv).detach().float()
    return (inputs.weights * per_token).sum(), {"clipped": clipped}


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
    return (inputs.weights * per_token).sum(), {"clipped": clipped}


LOSSES = {LossType.cispo: cispo, LossType.tis: tis, LossType.ppo: ppo, LossType.gspo: gspo}


def policy_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    return LOSSES[cfg.type](inputs, cfg)
