"""From rollout groups to training tensors: advantages, aggregation weights, micro-batches.

Every token gets its final loss weight before any micro-batching, from counts over the whole
update batch on every rank, so the loss is a plain weighted sum over tokens: gradient
accumulation over micro-batches and ranks equals one big batch.

A micro-batch has one of three layouts (`learner.packing`):
- padded: one row per sample, each padded only to the longest row of its own micro-batch (rows
  sorted by length);
- packed: every sample end to end in one sequence with position ids restarting at each sample and
  no padding at all, which flash-attn runs as variable-length attention (and the other attention
  implementations as a block-diagonal mask);
- shared: one row per prompt group, its prompt once and then every sample's completion, with a
  mask that lets each completion see the prompt and itself only, and position ids that continue
  from the prompt in every completion. The prompt is computed once instead of once per sample,
  which pays where prompts are long against completions.
`learner/packing_efficiency` is the share of computed positions that hold a real token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tidal.broker.schema import RolloutGroup
from tidal.config import AdvantageNorm, Aggregation

Reduce = Callable[[np.ndarray], np.ndarray]  # sums a float64 vector over all ranks (identity on one rank)


def _one_rank(values: np.ndarray) -> np.ndarray:
    return values


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
    prox_logprobs: np.ndarray | None = None  # float32 [completion_len]; policy at step start (ppo, several updates)
    group: int = 0  # its prompt group among the rows built together: rows of one group share the prompt

    @property
    def shared_len(self) -> int:
        """Positions this row adds to its group's sequence in the shared layout: the completion less its
        last token, which predicts nothing."""
        return max(len(self.input_ids) - self.num_prompt_tokens - 1, 0)


def group_advantages(groups: list[RolloutGroup], norm: AdvantageNorm, all_sum: Reduce = _one_rank) -> list[np.ndarray]:
    """A_i = r_i - mean_j r_j per group, then scaled by the std of every A in the step batch (all
    ranks), by the group's std, or not at all."""
    centred = [np.array([s.reward for s in g.samples], dtype=np.float64) for g in groups]
    centred = [r - r.mean() for r in centred]
    if norm is AdvantageNorm.batch:
        flat = np.concatenate(centred) if centred else np.zeros(0)
        count, total, total_sq = all_sum(np.array([flat.size, flat.sum(), np.square(flat).sum()]))
        mean = total / max(count, 1)
        std = np.sqrt(max(total_sq / max(count, 1) - mean**2, 0.0))
        return [a / (std + 1e-6) for a in centred]
    if norm is AdvantageNorm.group:
        return [a / (a.std() + 1e-6) for a in centred]
    return centred


def aggregation_weights(
    masks: list[list[np.ndarray]], how: Aggregation, all_sum: Reduce = _one_rank
) -> list[list[np.ndarray]]:
    """Per-token weights (masks[group][sample] -> weights) so that sum(w * loss_t) over every rank is
    the aggregate. Samples and prompts without a trainable token do not count."""
    tokens = [[int(m.sum()) for m in g] for g in masks]
    local = np.array(
        [sum(map(sum, tokens)), sum(n > 0 for g in tokens for n in g), sum(sum(g) > 0 for g in tokens)],
        dtype=np.float64,
    )
    num_tokens, num_samples, num_groups = (max(float(x), 1.0) for x in all_sum(local))
    if how is Aggregation.token_mean:
        return [[m / num_tokens for m in g] for g in masks]
    if how is Aggregation.sample_mean:  # each sample's token average, then mean over samples
        return [[m / (max(n, 1) * num_samples) for m, n in zip(g, ns)] for g, ns in zip(masks, tokens)]
    # prompt_mean: each prompt's token average over all its samples, then mean over prompts
    return [[m / (max(sum(ns), 1) * num_groups) for m in g] for g, ns in zip(masks, tokens)]


def build_rows(
    groups: list[RolloutGroup],
    token_masks: list[list[np.ndarray]],
    advantages: list[np.ndarray],
    weights: list[list[np.ndarray]],
) -> list[Row]:
    """One Row per sample; advantages[group][sample], weights[group][sample] -> [completion_len]."""
    rows = []
    for index, (g, adv, masks, ws) in enumerate(zip(groups, advantages, token_masks, weights, strict=True)):
        prompt = g.prompt_tokens.numpy("i4", "prompt_tokens").astype(np.int64)
        for (s, tokens, logprobs), a, m, w in zip(g.unpack(), adv, masks, ws, strict=True):
            # tokens the actor injected (forced interruptions) are read as context, never trained on
            keep = np.asarray(m, dtype=bool) & ~s.injected_mask()
            rows.append(
                Row(
                    np.concatenate([prompt, tokens.astype(np.int64)]),
                    len(prompt),
                    logprobs,
                    s.versions(),
                    keep,
                    float(a),
                    np.where(keep, w, 0.0).astype(np.float64),
                    group=index,
                )
            )
    return rows


def assign_groups(groups: list[RolloutGroup], num_minibatches: int, world_size: int, rank: int) -> list[list[int]]:
    """Indices of the groups `rank` trains in each mini-batch (one optimizer update each).

    The step batch is cut into contiguous mini-batches first, so an update sees the same groups
    whatever the number of ranks; inside a mini-batch, groups go to the least-loaded rank (by
    tokens, longest first), the same answer on every rank.
    """
    tokens = [sum(g.num_prompt_tokens + s.num_tokens for s in g.samples) for g in groups]
    plan = []
    for part in np.array_split(np.arange(len(groups)), num_minibatches):
        load, mine = [0] * world_size, []
        for i in sorted(part.tolist(), key=lambda i: (-tokens[i], i)):
            owner = min(range(world_size), key=lambda r: (load[r], r))
            load[owner] += tokens[i]
            if owner == rank:
                mine.append(i)
        plan.append(sorted(mine))
    return plan


def micro_batches(rows: list[Row], token_budget: int, layout: str = "padded") -> list[list[Row]]:
    """Length-bucketed micro-batches of at most `token_budget` computed positions. Each sequence of the
    layout (a sample; a prompt group, shared) is kept whole; sequences are sorted by length and cost,
    padded or shared, their count x the longest, packed, their sum. A longer one gets a micro-batch of its own."""
    sequences = _sequences(rows, layout)
    batches, current, lengths = [], [], []
    for length, seq in sorted(sequences, key=lambda item: item[0]):
        cost = sum(lengths) + length if layout == "packed" else max(lengths + [length]) * (len(lengths) + 1)
        if current and cost > token_budget:
            batches.append(current)
            current, lengths = [], []
        current.extend(seq)
        lengths.append(length)
    if current:
        batches.append(current)
    return batches


def computed_positions(rows: list[Row], token_budget: int, layout: str) -> int:
    """Positions the forward pass computes for `rows` cut into micro-batches of `layout`, padding included."""
    total = 0
    for batch in micro_batches(rows, token_budget, layout):
        lengths = [length for length, _ in _sequences(batch, layout)]
        total += sum(lengths) if layout == "packed" else max(lengths) * len(lengths)
    return total


def _sequences(rows: list[Row], layout: str) -> list[tuple[int, list[Row]]]:
    """(length, rows) of each sequence a micro-batch of `layout` holds, in the rows' order."""
    if layout != "shared":
        return [(len(r.input_ids), [r]) for r in rows]
    groups: dict[int, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.group, []).append(r)
    return [(members[0].num_prompt_tokens + sum(r.shared_len for r in members), members) for members in groups.values()]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # int64 [rows, max_len] padded; [1, total_len] packed; [groups, max_len] shared
    # int64 [rows, max_len] padded; None packed (the position ids say it); bool [groups, 1, max_len, max_len]
    # shared: True where a query position (dim 2) may attend to a key position (dim 3)
    attention_mask: torch.Tensor | None
    predict_at: torch.Tensor  # int64 [tokens]; flat index into input_ids of the position predicting each token
    targets: torch.Tensor  # int64 [tokens]
    behavior_logprobs: torch.Tensor  # float32 [tokens]
    advantages: torch.Tensor  # float32 [tokens]
    weights: torch.Tensor  # float64 [tokens]
    versions: torch.Tensor  # int64 [tokens]
    token_mask: torch.Tensor  # bool [tokens]
    sample_index: torch.Tensor  # int64 [tokens]; which row of this micro-batch
    num_real_tokens: int
    prox_logprobs: torch.Tensor | None = None  # float32 [tokens]; policy at step start, when computed
    # int64 [1, total_len] packed: restarting at 0 at every row; [groups, max_len] shared: continuing from the
    # prompt in every completion
    position_ids: torch.Tensor | None = None

    def to(self, device) -> MicroBatch:
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        return MicroBatch(**moved)


def collate(rows: list[Row], layout: str = "padded") -> MicroBatch:
    """Rows as tensors in `layout`: padded to the longest row, packed end to end into one sequence, or
    shared, one sequence per prompt group."""
    if layout == "shared":
        return _collate_shared(rows)
    lengths = [len(r.input_ids) for r in rows]
    packed = layout == "packed"
    # where each row starts in input_ids, flattened
    starts = np.cumsum([0, *lengths[:-1]]) if packed else np.arange(len(rows)) * max(lengths)
    if packed:
        ids = np.concatenate([r.input_ids for r in rows])[None]  # [1, total_len]
        attn = None
        positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])[None])
    else:
        ids = np.zeros((len(rows), max(lengths)), dtype=np.int64)
        attn = np.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : lengths[i]], attn[i, : lengths[i]] = r.input_ids, 1
        positions = None
    # t-1 predicts t
    predict_at = [start + np.arange(r.num_prompt_tokens, len(r.input_ids)) - 1 for start, r in zip(starts, rows)]
    return _micro_batch(
        rows, ids, None if attn is None else torch.from_numpy(attn), positions, predict_at, sum(lengths)
    )


def _collate_shared(rows: list[Row]) -> MicroBatch:
    """One sequence per prompt group: the prompt, then each completion but its last token. Segment ids
    say whose a position is (0 the prompt, k the group's k-th row, -1 padding); a query sees the prompt
    and its own segment up to itself, and padding sees only itself, so no softmax row is empty."""
    sequences = _sequences(rows, "shared")
    width = max(length for length, _ in sequences)
    ids = np.zeros((len(sequences), width), dtype=np.int64)
    segment = np.full((len(sequences), width), -1, dtype=np.int64)
    positions = np.zeros((len(sequences), width), dtype=np.int64)
    predict_at, ordered = [], []
    for b, (_, members) in enumerate(sequences):
        prompt_len = members[0].num_prompt_tokens
        ids[b, :prompt_len], segment[b, :prompt_len] = members[0].input_ids[:prompt_len], 0
        positions[b, :prompt_len] = np.arange(prompt_len)
        start = prompt_len
        for k, r in enumerate(members, start=1):
            end = start + r.shared_len
            ids[b, start:end], segment[b, start:end] = r.input_ids[prompt_len:-1], k
            positions[b, start:end] = np.arange(prompt_len, prompt_len + r.shared_len)
            # the first completion token is predicted by the prompt's last position, each later one by its own
            # segment's position before it
            steps = np.concatenate([[prompt_len - 1], np.arange(start, end)])[: len(r.input_ids) - prompt_len]
            predict_at.append(b * width + steps)
            start = end
            ordered.append(r)
    seg = torch.from_numpy(segment)
    query, key = seg[:, :, None], seg[:, None, :]
    index = torch.arange(width)
    causal = index[None, :] <= index[:, None]  # [query, key]
    mask = ((key == 0) | (key == query)) & causal & (query != -1)
    mask |= torch.eye(width, dtype=torch.bool)  # padding attends to itself
    place = {id(r): i for i, r in enumerate(rows)}
    return _micro_batch(
        ordered,
        ids,
        mask[:, None],
        torch.from_numpy(positions),
        predict_at,
        sum(length for length, _ in sequences),
        [place[id(r)] for r in ordered],
    )


def _micro_batch(
    rows: list[Row],
    ids: np.ndarray,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    predict_at: list[np.ndarray],
    num_real_tokens: int,
    index: list[int] | None = None,
) -> MicroBatch:
    """The per-token tensors of `rows` (in this order), beside the layout's inputs; `index`: each row's
    place in the caller's list (sample_index counts in that list), when the layout reordered them."""
    cat = np.concatenate
    completions = [r.input_ids[r.num_prompt_tokens :] for r in rows]
    index = range(len(rows)) if index is None else index
    return MicroBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=attention_mask,
        position_ids=position_ids,
        predict_at=torch.from_numpy(cat(predict_at).astype(np.int64)),
        targets=torch.from_numpy(cat(completions)),
        behavior_logprobs=torch.from_numpy(cat([r.behavior_logprobs for r in rows]).astype(np.float32)),
        advantages=torch.from_numpy(
            cat([np.full(len(r.behavior_logprobs), r.advantage, dtype=np.float32) for r in rows])
        ),
        weights=torch.from_numpy(cat([r.token_weight for r in rows])),
        versions=torch.from_numpy(cat([r.versions for r in rows])),
        token_mask=torch.from_numpy(cat([r.token_mask for r in rows])),
        sample_index=torch.from_numpy(cat([np.full(len(c), i, dtype=np.int64) for i, c in zip(index, completions)])),
        num_real_tokens=num_real_tokens,
        prox_logprobs=None
        if any(r.prox_logprobs is None for r in rows)
        else torch.from_numpy(cat([r.prox_logprobs for r in rows]).astype(np.float32)),
    )
