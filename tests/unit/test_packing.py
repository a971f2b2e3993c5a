"""Packed micro-batches: rows end to end without padding, position ids restarting per row. The
learner must compute the same logprobs and make the same update as with padded rows. On CPU the
packed rows run through sdpa with a block-diagonal mask built from the position ids; on a GPU with
flash-attn they run as variable-length attention (tests/gpu)."""
from dataclasses import replace

import numpy as np
import torch

from conftest import ALPHABET, STEP_VERSION, TINY, learner_config, run_step, step_batch
from tidal.config import Aggregation, LossType
from tidal.learner.batch import build_rows, collate, micro_batches
from tidal.learner.trainer import PolicyLogprobs
from tidal.tiny import build_tiny_model


def rows_of(groups, masks):
    advantages = [np.linspace(-1, 1, len(g.samples)) for g in groups]
    weights = [[np.ones(s.num_tokens) for s in g.samples] for g in groups]
    return build_rows(groups, masks, advantages, weights)


def test_packed_rows_are_one_sequence_with_restarting_positions():
    groups, masks = step_batch(3)
    rows = rows_of(groups, masks)
    packed, padded = collate(rows, packed=True), collate(rows)
    lengths = [len(r.input_ids) for r in rows]
    assert packed.input_ids.shape == (1, sum(lengths)) and packed.attention_mask is None
    assert packed.position_ids[0].tolist() == [p for n in lengths for p in range(n)]
    assert packed.num_real_tokens == padded.num_real_tokens == sum(lengths) < padded.input_ids.numel()
    # every target is predicted by the position before it, in both layouts
    assert torch.equal(packed.input_ids.flatten()[packed.predict_at + 1], packed.targets)
    assert torch.equal(padded.input_ids.flatten()[padded.predict_at + 1], padded.targets)


def test_packed_and_padded_micro_batches_give_the_same_logprobs():
    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    module = PolicyLogprobs(model, temperature=0.9, backend="torch").eval()
    groups, masks = step_batch(6)
    rows = rows_of(groups, masks)
    with torch.no_grad():
        got = {}
        for packed in (False, True):
            mb = collate(rows, packed)
            logp, entropy = module(mb.input_ids, mb.attention_mask, mb.predict_at, mb.targets, mb.position_ids)
            got[packed] = (logp, entropy)
    torch.testing.assert_close(got[True][0], got[False][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[True][1], got[False][1], atol=1e-5, rtol=0)


def test_a_packed_budget_counts_real_tokens_only():
    groups, masks = step_batch(6)
    rows = rows_of(groups, masks)
    for batch in micro_batches(rows, token_budget=20, packed=True):
        assert sum(len(r.input_ids) for r in batch) <= 20 or len(batch) == 1


def test_a_packed_step_makes_the_same_update_as_a_padded_one(accelerator):
    cfg = learner_config(LossType.ppo, Aggregation.token_mean, 24, 2)
    padded, padded_metrics = run_step(replace(cfg, packing="padded"), accelerator)
    packed, packed_metrics = run_step(replace(cfg, packing="packed"), accelerator)
    for name, value in padded.items():
        torch.testing.assert_close(packed[name], value, atol=1e-5, rtol=0, msg=name)
    assert packed_metrics["learner/packing_efficiency"] == 1.0 > padded_metrics["learner/packing_efficiency"]
    assert packed_metrics["offpolicy/lag_max"] == padded_metrics["offpolicy/lag_max"] <= STEP_VERSION
