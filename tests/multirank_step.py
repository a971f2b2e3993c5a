"""One training step of the tiny model on a fixed step batch, for the multi-rank and
gradient-accumulation tests.

Run it under `torchrun --nproc-per-node N` (gloo on CPU) or import it: rank 0 writes the
parameters after each case's step (`<case>.pt`) and the metrics (`<case>.json`) to OUT_DIR;
every rank that refuses a step batch too small to share writes `too_few_groups_rank<r>.txt`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from tidal.broker.schema import RolloutGroup, Sample, float32s, int32s
from tidal.config import Aggregation, LearnerConfig, LossConfig, LossType, OptimConfig, TinyModelConfig

STEP_VERSION = 2  # the learner's version during the step; samples carry versions 1 and 2
ALPHABET = "0123456789+="
TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=1, num_kv_heads=1, intermediate_size=64)

# name -> (loss, aggregation, micro_batch_tokens, mini-batches per step)
CASES = {
    "cispo_prompt_mean": (LossType.cispo, Aggregation.prompt_mean, 24, 1),
    "ppo_token_mean_2updates": (LossType.ppo, Aggregation.token_mean, 24, 2),
    "gspo_sample_mean": (LossType.gspo, Aggregation.sample_mean, 10_000, 1),
}


def step_batch(num_groups: int = 6, seed: int = 0) -> tuple[list[RolloutGroup], list[list[np.ndarray]]]:
    """Groups of 2-3 samples with uneven lengths, mixed versions and one masked (too old) token."""
    rng = np.random.default_rng(seed)
    groups, masks = [], []
    for g in range(num_groups):
        samples = []
        for i in range(2 + g % 2):
            n = int(rng.integers(1, 7))
            version = STEP_VERSION - int(rng.integers(0, 2))
            behavior = float32s(-2.4 + 0.3 * rng.standard_normal(n))
            samples.append(Sample(tokens=int32s(rng.integers(2, 14, n)), logprobs=behavior,
                                  version_spans=[(version, 0, n)], reward=float((g + i) % 2), finish_reason="stop"))
        prompt = int32s(rng.integers(2, 14, 2 + g % 3))
        groups.append(RolloutGroup(group_id=f"g{g}", prompt_id=g, actor_id="a", prompt_tokens=prompt, samples=samples))
        masks.append([np.ones(s.num_tokens, dtype=bool) for s in samples])
    masks[-1][0][0] = False  # a token the staleness rule masked out
    return groups, masks


def learner_config(loss: LossType, aggregation: Aggregation, micro_batch_tokens: int, minibatches: int,
                   num_groups: int = 6) -> LearnerConfig:
    # AdamW's first update is lr * g / (|g| + eps): with eps = 1 and lr = 1 it follows the gradient
    # almost linearly, so parameters after the step differ when the gradients do (Adam's usual
    # g / |g| would hide a wrong gradient scale).
    optim = OptimConfig(lr=1.0, eps=1.0, max_grad_norm=0.0)
    # narrow clip ranges, so that the second ppo update and gspo's sequence ratios do clip
    loss_cfg = LossConfig(type=loss, aggregation=aggregation, minibatches_per_step=minibatches, clip_eps=0.05,
                          gspo_clip_low=0.05, gspo_clip_high=0.05)
    return LearnerConfig(groups_per_step=num_groups, micro_batch_tokens=micro_batch_tokens, kernel_backend="torch",
                         optim=optim, loss=loss_cfg)


def run_step(cfg: LearnerConfig, accelerator, groups=None, masks=None) -> tuple[dict[str, torch.Tensor], dict]:
    """Parameters after one step from the same initial tiny model, and the step's metrics."""
    from tidal.learner.trainer import Trainer
    from tidal.tiny import build_tiny_model

    if groups is None:
        groups, masks = step_batch(cfg.groups_per_step)
    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    trainer = Trainer(cfg, model, accelerator, temperature=1.0)
    metrics = trainer.step(groups, masks, STEP_VERSION)
    params = {k: v.detach().cpu().clone() for k, v in trainer.policy.state_dict().items()}
    return params, metrics


def main() -> None:
    from accelerate import Accelerator

    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    for name, case in CASES.items():
        params, metrics = run_step(learner_config(*case), accelerator)
        if accelerator.is_main_process:
            torch.save(params, args.out_dir / f"{name}.pt")
            (args.out_dir / f"{name}.json").write_text(json.dumps(metrics | {"world_size": accelerator.num_processes}))
    # one group cannot be shared by two ranks: every rank must raise (none may wait in a collective)
    try:
        run_step(learner_config(LossType.cispo, Aggregation.prompt_mean, 10_000, 1, num_groups=1), accelerator)
    except ValueError as err:
        (args.out_dir / f"too_few_groups_rank{accelerator.process_index}.txt").write_text(str(err))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
