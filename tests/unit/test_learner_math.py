"""Advantages, aggregation weights and the CISPO loss against numbers worked out by hand."""

import numpy as np
import pytest
import torch

from conftest import step_batch
from tidal.broker.schema import RolloutGroup, SampleArrays, int32s
from tidal.config import AdvantageNorm, Aggregation, LossConfig
from tidal.learner.every_rank.batch import (
    aggregation_weights,
    assign_groups,
    build_rows,
    collate,
    group_advantages,
    micro_batches,
)
from tidal.learner.every_rank.loss import LossInputs, policy_loss


def group(rewards, lengths, gid="g"):
    return RolloutGroup.pack(
        [
            SampleArrays.of([4] * n, [-1.0] * n, version_spans=[(0, 0, n)], reward=r, finish_reason="stop")
            for r, n in zip(rewards, lengths)
        ],
        group_id=gid,
        prompt_id=0,
        actor_id="a",
        prompt_tokens=int32s([2, 3]),
    )


# Prompt A: rewards [1, 0], lengths [2, 3]. Prompt B: rewards [1, 1, 0], lengths [1, 1, 2].
GROUPS = [group([1, 0], [2, 3], "a"), group([1, 1, 0], [1, 1, 2], "b")]
MASKS = [[np.ones(n, bool) for n in (2, 3)], [np.ones(n, bool) for n in (1, 1, 2)]]


def test_batch_normalized_advantages():
    # centred: A -> [0.5, -0.5]; B -> [1/3, 1/3, -2/3]; batch std = sqrt((0.25+0.25+1/9+1/9+4/9)/5) = 0.483046
    adv = group_advantages(GROUPS, AdvantageNorm.batch)
    np.testing.assert_allclose(adv[0], [0.5 / 0.483046, -0.5 / 0.483046], rtol=1e-5)
    np.testing.assert_allclose(adv[1], [1 / 3 / 0.483046, 1 / 3 / 0.483046, -2 / 3 / 0.483046], rtol=1e-5)
    np.testing.assert_allclose(group_advantages(GROUPS, AdvantageNorm.none)[1], [1 / 3, 1 / 3, -2 / 3])
    # group std: A std 0.5 -> [1, -1]
    np.testing.assert_allclose(group_advantages(GROUPS, AdvantageNorm.group)[0], [1, -1], rtol=1e-5)


@pytest.mark.parametrize(
    "how, expected",
    [
        # prompt_mean: A has 5 tokens, B has 4; two prompts -> 1/(2*5) and 1/(2*4)
        (Aggregation.prompt_mean, [[0.1, 0.1], [0.125]]),
        # token_mean: 9 tokens in all
        (Aggregation.token_mean, [[1 / 9, 1 / 9], [1 / 9]]),
        # sample_mean: 5 samples; a sample of length n gives each token 1/(5n)
        (Aggregation.sample_mean, [[1 / 10, 1 / 15], [1 / 5]]),
    ],
)
def test_aggregation_weights(how, expected):
    w = aggregation_weights(MASKS, how)
    assert w[0][0][0] == pytest.approx(expected[0][0])
    assert w[0][1][0] == pytest.approx(expected[0][1])
    assert w[1][0][0] == pytest.approx(expected[1][0])
    assert sum(x.sum() for g in w for x in g) == pytest.approx(1.0)


def test_cispo_value_and_gradient_by_hand():
    # two tokens: logp = [-1, -2], behavior = [-1.5, -0.5] -> rho = [e^0.5, e^-1.5] = [1.6487, 0.2231]
    # eps_max = 1.5 caps the first at 1.5. A = [2, -1], w = [0.5, 0.5]
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    inputs = LossInputs(logp, torch.tensor([-1.5, -0.5]), torch.tensor([2.0, -1.0]), torch.tensor([0.5, 0.5]))
    loss, extra = policy_loss(inputs, LossConfig(eps_max=1.5))
    # loss = -(0.5*1.5*2*(-1) + 0.5*0.2231*(-1)*(-2)) = -(-1.5 + 0.22313) = 1.27687
    assert float(loss.detach()) == pytest.approx(1.5 - 0.5 * np.exp(-1.5) * 2, rel=1e-5)
    loss.backward()
    # d loss / d logp = -w * min(rho, eps) * A = [-0.5*1.5*2, -0.5*0.22313*(-1)]
    np.testing.assert_allclose(logp.grad.numpy(), [-1.5, 0.5 * np.exp(-1.5)], rtol=1e-5)
    assert extra["clipped"].tolist() == [1.0, 0.0]


def test_micro_batches_respect_the_budget_and_cover_every_token():
    rows = build_rows(
        GROUPS,
        MASKS,
        group_advantages(GROUPS, AdvantageNorm.batch),
        aggregation_weights(MASKS, Aggregation.prompt_mean),
    )
    batches = micro_batches(rows, token_budget=10)
    assert sum(len(b) for b in batches) == 5
    for b in batches:
        mb = collate(b)
        assert mb.input_ids.numel() <= 10
        # each target is the token right after the position that predicts it
        flat = mb.input_ids.reshape(-1)
        assert torch.equal(flat[mb.predict_at + 1], mb.targets)
    assert sum(float(collate(b).weights.sum()) for b in batches) == pytest.approx(1.0)


def test_groups_are_split_into_minibatches_then_balanced_over_ranks():
    groups, _ = step_batch(6)
    # tokens per group (prompt + completion, per sample), from step_batch's fixed seed
    tokens = [sum(g.num_prompt_tokens + s.num_tokens for s in g.samples) for g in groups]
    one_rank = assign_groups(groups, 2, world_size=1, rank=0)
    assert one_rank == [[0, 1, 2], [3, 4, 5]]  # contiguous mini-batches, whatever the number of ranks
    plans = [assign_groups(groups, 2, world_size=2, rank=r) for r in (0, 1)]
    for k, part in enumerate(one_rank):
        shares = [plans[r][k] for r in (0, 1)]
        assert sorted(shares[0] + shares[1]) == part and all(shares)
        # longest first to the least-loaded rank: no rank carries more than the other plus its longest group
        loads = [sum(tokens[i] for i in share) for share in shares]
        assert abs(loads[0] - loads[1]) <= max(tokens[i] for i in part)
