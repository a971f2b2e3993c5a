"""On a GPU with flash-attn: packed micro-batches (variable-length attention, no padding) give the
logprobs padded ones do, in bf16, within 1e-3."""

import importlib.util

import pytest
import torch

from conftest import ALPHABET, TINY, step_batch
from tidal.learner.every_rank.batch import build_rows, collate
from tidal.learner.every_rank.trainer import PolicyLogprobs
from tidal.tiny import build_tiny_model

needs_flash_attn = pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed"
)


@needs_flash_attn
def test_packed_flash_attention_matches_padded_sdpa_in_bf16():
    import numpy as np

    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    groups, masks = step_batch(8)
    rows = build_rows(
        groups,
        masks,
        [np.zeros(len(g.samples)) for g in groups],
        [[np.ones(s.num_tokens) for s in g.samples] for g in groups],
    )
    results = {}
    for attention, layout in (("sdpa", "padded"), ("flash_attention_2", "packed")):
        model.config._attn_implementation = attention
        module = PolicyLogprobs(model.to("cuda", torch.bfloat16), temperature=1.0, backend="triton").eval()
        mb = collate(rows, layout).to("cuda")
        with torch.no_grad():
            results[layout] = module(mb.input_ids, mb.attention_mask, mb.predict_at, mb.targets, mb.position_ids)
    torch.testing.assert_close(results["packed"][0], results["padded"][0], atol=1e-3, rtol=0)
