"""One optimizer step on a step batch: micro-batches -> fused logprobs -> loss -> AdamW.

Logprobs come from `tidal.kernels.logprobs` on the final hidden states and the LM-head
weight (fp32 accumulation), so [tokens x vocab] logits are never materialized.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from tidal.broker.schema import RolloutGroup
from tidal.config import LearnerConfig
from tidal.kernels import logprobs as fused_logprobs
from tidal.learner.batch import MicroBatch, build_rows, collate, micro_batches
from tidal.learner.loss import LossInputs, policy_loss


def load_policy(model_path: str, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype), attn_implementation="sdpa")


def token_logprobs(model, mb: MicroBatch, temperature: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob [tokens], entropy [tokens]) of each completion token under `model`."""
    hidden = model.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state  # [B, L, D]
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.predict_at)  # [tokens, D]
    return fused_logprobs(hidden, model.lm_head.weight, mb.targets, temperature, backend=backend)


class Trainer:
    def __init__(self, cfg: LearnerConfig, model, accelerator, temperature: float):
        self.cfg = cfg
        self.accelerator = accelerator
        self.temperature = temperature
        optim = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
        warmup = max(cfg.optim.warmup_steps, 0)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        self.model, self.optimizer, self.scheduler = accelerator.prepare(model, optim, sched)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.policy.parameters())

    @property
    def policy(self):
        return self.accelerator.unwrap_model(self.model)

    def step(self, groups: list[RolloutGroup], token_masks: list[list[np.ndarray]], version: int) -> dict[str, float]:
        """One optimizer step; the metrics describe the batch as seen at step start (version `version`)."""
        start = time.perf_counter()
        rows = build_rows(groups, token_masks, self.cfg.advantage_norm, self.cfg.loss.aggregation)
        self.model.train()
        stats = _StepStats(version)
        for rows_mb in micro_batches(rows, self.cfg.micro_batch_tokens):
            mb = collate(rows_mb)
            logp, entropy = token_logprobs(self.policy, mb, self.temperature, self.cfg.kernel_backend)
            inputs = LossInputs(logp, mb.behavior_logprobs, mb.advantages, mb.weights.float())
            loss, extra = policy_loss(inputs, self.cfg.loss)
            self.accelerator.backward(loss)
            stats.add(mb, logp.detach(), entropy.detach(), loss.detach(), extra)
        grad_norm = self._optimizer_step()
        elapsed = time.perf_counter() - start
        return stats.summary() | {
            "learner/grad_norm": grad_norm, "learner/lr": self.scheduler.get_last_lr()[0],
            "learner/advantage_std": float(np.std([r.advantage for r in rows])),
            "timing/train_step_s": elapsed, "learner/tokens_per_s": stats.num_computed_tokens / elapsed,
            "learner/computed_tokens": float(stats.num_computed_tokens),
        }

    def _optimizer_step(self) -> float:
        max_norm = self.cfg.optim.max_grad_norm
        if max_norm > 0:
            grad_norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm))
        else:
            grad_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in self.model.parameters() if p.grad is not None))
        if not math.isfinite(grad_norm):
            raise FloatingPointError(f"gradient norm is {grad_norm}: refusing to step (check learner.optim.lr)")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm


class _StepStats:
    """Accumulates per-token statistics across micro-batches into DESIGN §6 metrics."""

    def __init__(self, version: int):
        self.version = version
        self.parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("logp", "blogp", "entropy", "clipped", "lag", "fresh")}
        self.loss = 0.0
        self.num_computed_tokens = 0
        self.num_real_tokens = 0

    def add(self, mb: MicroBatch, logp, entropy, loss, extra) -> None:
        keep = mb.token_mask
        self.parts["logp"].append(logp[keep])
        self.parts["blogp"].append(mb.behavior_logprobs[keep])
        self.parts["entropy"].append(entropy[keep])
        self.parts["clipped"].append(extra["clipped"][keep])
        self.parts["lag"].append((self.version - mb.versions)[keep].float())
        # Tokens of samples produced entirely at the current version: learner and actor ran the
        # same weights over the whole sequence, so their logprobs must agree.
        fresh = _fresh_samples(mb, self.version)
        self.parts["fresh"].append((logp - mb.behavior_logprobs).abs()[fresh])
        self.loss += float(loss)
        self.num_computed_tokens += mb.input_ids.numel()
        self.num_real_tokens += mb.num_real_tokens

    def summary(self) -> dict[str, float]:
        cat = {k: torch.cat(v) if v else torch.zeros(0) for k, v in self.parts.items()}
        log_rho = cat["logp"] - cat["blogp"]
        rho = log_rho.exp()
        out = {
            "learner/loss": self.loss,
            "learner/entropy": float(cat["entropy"].mean()),
            "learner/num_tokens": float(rho.numel()),
            "learner/packing_efficiency": self.num_real_tokens / max(self.num_computed_tokens, 1),
            "offpolicy/rho_mean": float(rho.mean()), "offpolicy/rho_max": float(rho.max()),
            "offpolicy/clipped_frac": float(cat["clipped"].mean()),
            "offpolicy/ess": float(rho.sum() ** 2 / (rho.numel() * (rho ** 2).sum())),
            # k3 estimator of KL(behavior || learner) under behavior samples: E[rho - 1 - log rho]
            "offpolicy/mismatch_kl": float((rho - 1 - log_rho).mean()),
            "offpolicy/lag_mean": float(cat["lag"].mean()), "offpolicy/lag_max": float(cat["lag"].max()),
        }
        if cat["fresh"].numel():
            out["offpolicy/fresh_logprob_max_abs_diff"] = float(cat["fresh"].max())
            out["offpolicy/fresh_tokens"] = float(cat["fresh"].numel())
        return out


def _fresh_samples(mb: MicroBatch, version: int) -> torch.Tensor:
    """bool [tokens]: tokens of samples whose every token was produced at `version`."""
    stale = torch.zeros(int(mb.sample_index.max()) + 1, dtype=torch.bool)
    stale.index_put_((mb.sample_index,), mb.versions != version, accumulate=True)
    return ~stale[mb.sample_index]
