"""Micro-batch layouts. Packed: rows end to end without padding, position ids restarting per row
(on CPU through sdpa with a block-diagonal mask built from the position ids; on a GPU with
flash-attn as variable-length attention, tests/gpu). Shared: one sequence per prompt group, the
prompt once and every completion after it under a mask. The learner must compute the same
logprobs and make the same update in every layout."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import ALPHABET, STEP_VERSION, TINY, learner_config, run_step, step_batch
from tidal.config import Aggregation, LossType
from tidal.learner.every_rank.batch import build_rows, collate, computed_positions, micro_batches
from tidal.learner.every_rank.trainer import PolicyLogprobs, micro_batch_layout
from tidal.tiny import build_tiny_model


def rows_of(groups, masks):
    advantages = [np.linspace(-1, 1, len(g.samples)) for g in groups]
    weights = [[np.ones(s.num_tokens) for s in g.samples] for g in groups]
    return build_rows(groups, masks, advantages, weights)


def test_packed_rows_are_one_sequence_with_restarting_positions():
    groups, masks = step_batch(3)
    rows = rows_of(groups, masks)
    packed, padded = collate(rows, "packed"), collate(rows)
    lengths = [len(r.input_ids) for r in rows]
    assert packed.input_ids.shape == (1, sum(lengths)) and packed.attention_mask is None
    assert packed.position_ids[0].tolist() == [p for n in lengths for p in range(n)]
    assert packed.num_real_tokens == padded.num_real_tokens == sum(lengths) < padded.input_ids.numel()
    # every target is predicted by the position before it, in both layouts
    assert torch.equal(packed.input_ids.flatten()[packed.predict_at + 1], packed.targets)
    assert torch.equal(padded.input_ids.flatten()[padded.predict_at + 1], padded.targets)


def test_a_shared_sequence_holds_the_prompt_once_and_each_completion_sees_only_the_prompt_and_itself():
    groups, masks = step_batch(2)
    rows = rows_of(groups, masks)[:2]  # group 0's two samples
    prompt = rows[0].input_ids[: rows[0].num_prompt_tokens].tolist()
    first, second = (r.input_ids[r.num_prompt_tokens :].tolist() for r in rows)
    mb = collate(rows, "shared")
    p, a = len(prompt), len(first) - 1
    assert mb.input_ids[0].tolist() == prompt + first[:-1] + second[:-1]  # last tokens predict nothing
    assert mb.position_ids[0].tolist() == [*range(p), *range(p, p + a), *range(p, p + len(second) - 1)]
    assert mb.targets.tolist() == first + second
    mask = mb.attention_mask[0, 0]
    second_start = p + a
    assert mask[second_start, :p].all() and not mask[second_start, p:second_start].any()  # not the first sample
    assert mask[second_start, second_start] and not mask[p - 1, p:].any()  # the prompt never sees a completion
    assert mb.num_real_tokens == mb.input_ids.numel()


def test_every_layout_gives_the_same_logprobs():
    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    module = PolicyLogprobs(model, temperature=0.9, backend="torch").eval()
    groups, masks = step_batch(6)
    rows = rows_of(groups, masks)
    got = {}
    with torch.no_grad():
        for layout in ("padded", "packed", "shared"):
            mb = collate(rows, layout)
            got[layout] = module(mb.input_ids, mb.attention_mask, mb.predict_at, mb.targets, mb.position_ids)
    for layout in ("packed", "shared"):
        torch.testing.assert_close(got[layout][0], got["padded"][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[layout][1], got["padded"][1], atol=1e-5, rtol=0)


def test_a_shared_micro_batch_keeps_groups_whole_and_counts_rows_in_the_callers_order():
    groups, masks = step_batch(6)
    rows = rows_of(groups, masks)
    batches = micro_batches(rows, token_budget=20, layout="shared")
    assert sorted(r.group for b in batches for r in b) == sorted(r.group for r in rows)
    size = {g: sum(r.group == g for r in rows) for g in {r.group for r in rows}}
    for batch in batches:
        assert all(sum(r.group == g for r in batch) == size[g] for g in {r.group for r in batch})
    interleaved = rows[::2] + rows[1::2]  # groups split apart: collate regroups them
    mb = collate(interleaved, "shared")
    assert mb.sample_index.unique().tolist() == list(range(len(rows)))
    for i, r in enumerate(interleaved):  # each row's tokens still sit under its own index
        assert mb.targets[mb.sample_index == i].tolist() == r.input_ids[r.num_prompt_tokens :].tolist()


def test_a_packed_budget_counts_real_tokens_only():
    groups, masks = step_batch(6)
    rows = rows_of(groups, masks)
    for batch in micro_batches(rows, token_budget=20, layout="packed"):
        assert sum(len(r.input_ids) for r in batch) <= 20 or len(batch) == 1
    assert computed_positions(rows, 20, "packed") == sum(len(r.input_ids) for r in rows)


@pytest.mark.parametrize("layout", ["packed", "shared"])
def test_a_step_makes_the_same_update_in_every_layout(accelerator, layout):
    cfg = learner_config(LossType.ppo, Aggregation.token_mean, 24, 2)
    padded, padded_metrics = run_step(replace(cfg, packing="padded"), accelerator)
    other, other_metrics = run_step(replace(cfg, packing=layout), accelerator)
    for name, value in padded.items():
        torch.testing.assert_close(other[name], value, atol=1e-5, rtol=0, msg=name)
    # packed computes no padding at all; shared computes each prompt once
    assert other_metrics["learner/computed_tokens"] < padded_metrics["learner/computed_tokens"]
    assert other_metrics["offpolicy/lag_max"] == padded_metrics["offpolicy/lag_max"] <= STEP_VERSION
    assert other_metrics["learner/shared_prompt_layout"] == float(layout == "shared")


def test_auto_shares_prompts_where_that_computes_less():
    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    assert micro_batch_layout("auto", model) == "auto" and micro_batch_layout("padded", model) == "padded"
    model.config._attn_implementation = "flash_attention_2"
    assert micro_batch_layout("auto", model) == "packed"
    with pytest.raises(ValueError, match="learner.packing = shared"):
        micro_batch_layout("shared", model)
    groups, masks = step_batch(6)
    rows = rows_of(groups, masks)
    long_prompt = [
        replace(r, input_ids=np.concatenate([np.full(30, 3), r.input_ids]), num_prompt_tokens=r.num_prompt_tokens + 30)
        for r in rows
    ]
    assert computed_positions(long_prompt, 10_000, "shared") < computed_positions(long_prompt, 10_000, "padded")
