"""Policy-gradient losses as small plugins: `LossInputs` -> (loss, metrics).

The loss is a weighted token sum (weights from the aggregation rule), so micro-batches add up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.config import LossConfig, LossType


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # float32 [tokens], learner logprobs (differentiable)
    behavior_logprobs: torch.Tensor  # float32 [tokens], from the actor at sampling time
    advantages: torch.Tensor  # float32 [tokens]
    weights: torch.Tensor  # float32 [tokens], aggregation weights; 0 for masked tokens


def cispo(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-sg(min(rho, eps_max)) * A * logp_theta, rho = pi_theta / pi_behavior per token."""
    rho = torch.exp(inputs.logprobs.detach() - inputs.behavior_logprobs)
    coef = rho.clamp(max=cfg.eps_max)
    per_token = -coef * inputs.advantages * inputs.logprobs
    loss = (inputs.weights * per_token).sum()
    return loss, {"clipped": (rho > cfg.eps_max).float()}


LOSSES = {LossType.cispo: cispo}


def policy_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return LOSSES[cfg.type](inputs, cfg)
