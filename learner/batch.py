"""From rollout groups to training tensors: advantages, aggregation weights, micro-batches.

Every token gets its final loss weight before any micro-batching, so the loss is a plain
weighted sum over tokens and gradient accumulation over micro-batches equals one big batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tidal.broker.schema import RolloutGroup
from tidal.config import AdvantageNorm, Aggregation


@dataclass
class Row:
    """One sample as a training row."""

    input_ids: np.ndarray  # int64 [prompt_len + completion_len]
    num_prompt_tokens: int
    behavior_logprobs: np.ndarray  # float32 [completion_len]
    versions: np.ndarray  # int64 [completion_len]
    token_mask: np.ndarray  # bool [completion_len]; False = excluded from the loss
    advantage: float
    token_weight: np.ndarray  # float64 [completion_len]; aggregation weight (0 where masked)


def group_advantages(groups: list[RolloutGroup], norm: AdvantageNorm) -> list[np.ndarray]:
    """A_i = r_i - mean_j r_j per group, then scaled by the batch std, the group std, or not at all."""
    centred = [np.array([s.reward for s in g.samples], dtype=np.float64) for g in groups]
    centred = [r - r.mean() for r in centred]
    if norm is AdvantageNorm.batch:
        std = np.concatenate(centred).std()
        return [a / (std + 1e-6) for a in centred]
    if norm is AdvantageNorm.group:
        return [a / (a.std() + 1e-6) for a in centred]
    return centred


def aggregation_weights(masks: list[list[np.ndarray]], how: Aggregation) -> list[list[np.ndarray]]:
    """Per-token weights (masks[group][sample] -> weights) so that sum(w * loss_t) is the aggregate."""
    if how is Aggregation.token_mean:
        total = max(sum(int(m.sum()) for g in masks for m in g), 1)
        return [[m / total for m in g] for g in masks]
    if how is Aggregation.sample_mean:
        num_samples = sum(len(g) for g in masks)
        return [[m / (max(int(m.sum()), 1) * num_samples) for m in g] for g in masks]
    num_groups = len(masks)  # prompt_mean: each prompt's tokens average, then mean over prompts
    return [[m / (max(sum(int(x.sum()) for x in g), 1) * num_groups) for m in g] for g in masks]


def build_rows(groups: list[RolloutGroup], token_masks: list[list[np.ndarray]], norm: AdvantageNorm,
               how: Aggregation) -> list[Row]:
    advantages = group_advantages(groups, norm)
    weights = aggregation_weights(token_masks, how)
    rows = []
    for g, adv, masks, ws in zip(groups, advantages, token_masks, weights):
        prompt = g.prompt_tokens.numpy("i4", "prompt_tokens").astype(np.int64)
        for s, a, m, w in zip(g.samples, adv, masks, ws):
            completion = s.tokens.numpy("i4", "tokens").astype(np.int64)
            rows.append(Row(np.concatenate([prompt, completion]), len(prompt), s.logprobs.numpy("f4", "logprobs"),
                            s.versions(), m, float(a), w.astype(np.float64)))
    return rows


def micro_batches(rows: list[Row], token_budget: int) -> list[list[Row]]:
    """Length-bucketed micro-batches: sorted by length, each padded only to its own longest row."""
    order = sorted(rows, key=lambda r: len(r.input_ids))
    batches, current = [], []
    for row in order:
        longest = max(len(row.input_ids), *(len(r.input_ids) for r in current)) if current else len(row.input_ids)
        if current and longest * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append(row)
    if current:
        batches.append(current)
    return batches


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # int64 [rows, max_len]
    attention_mask: torch.Tensor  # int64 [rows, max_len]
    predict_at: torch.Tensor  # int64 [tokens]; flat index into [rows * max_len] of the position predicting each token
    targets: torch.Tensor  # int64 [tokens]
    behavior_logprobs: torch.Tensor  # float32 [tokens]
    advantages: torch.Tensor  # float32 [tokens]
    weights: torch.Tensor  # float64 [tokens]
    versions: torch.Tensor  # int64 [tokens]
    token_mask: torch.Tensor  # bool [tokens]
    sample_index: torch.Tensor  # int64 [tokens]; which row of this micro-batch
    num_real_tokens: int


def collate(rows: list[Row]) -> MicroBatch:
    max_len = max(len(r.input_ids) for r in rows)
    ids = np.zeros((len(rows), max_len), dtype=np.int64)
    attn = np.zeros((len(rows), max_len), dtype=np.int64)
    predict_at, sample_index = [], []
    for i, r in enumerate(rows):
        ids[i, :len(r.input_ids)] = r.input_ids
        attn[i, :len(r.input_ids)] = 1
        completion = np.arange(r.num_prompt_tokens, len(r.input_ids))
        predict_at.append(i * max_len + completion - 1)  # position t-1 predicts token t
        sample_index.append(np.full(len(completion), i))
    cat = np.concatenate
    return MicroBatch(
        input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(attn),
        predict_at=torch.from_numpy(cat(predict_at)),
        targets=torch.from_numpy(cat([r.input_ids[r.num_prompt_tokens:] for r in rows])),
        behavior_logprobs=torch.from_numpy(cat([r.behavior_logprobs for r in rows]).astype(np.float32)),
        advantages=torch.from_numpy(cat([np.full(len(r.behavior_logprobs), r.advantage, dtype=np.float32)
                                         for r in rows])),
        weights=torch.from_numpy(cat([r.token_weight for r in rows])),
        versions=torch.from_numpy(cat([r.versions for r in rows])),
        token_mask=torch.from_numpy(cat([r.token_mask for r in rows])),
        sample_index=torch.from_numpy(cat(sample_index)),
        num_real_tokens=int(attn.sum()),
    )
