"""Every loss x aggregation against numbers worked out by hand; REINFORCE as the on-policy limit;
gradient accumulation, micro-batch packing and learning-rate scaling on the tiny model."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import ALPHABET, STEP_VERSION, TINY, learner_config, run_step, step_batch
from tidal.broker.schema import RolloutGroup, SampleArrays, int32s
from tidal.config import AdvantageNorm, Aggregation, ConfigError, LossConfig, LossType, load_config
from tidal.learner.every_rank.batch import aggregation_weights, build_rows, collate, group_advantages, micro_batches
from tidal.learner.every_rank.loss import LossInputs, policy_loss

# The hand batch: prompt a with 2 samples (2 and 3 tokens), prompt b with 3 samples (1, 1, 2 tokens).
# Tokens in order: a0 = t0 t1 | a1 = t2 t3 t4 | b0 = t5 | b1 = t6 | b2 = t7 t8.
LENGTHS = [[2, 3], [1, 1, 2]]
REWARDS = [[1.0, 0.0], [1.0, 0.0, 0.0]]
# advantage_norm=none: a -> [1 - 1/2, 0 - 1/2]; b -> [1 - 1/3, 0 - 1/3, 0 - 1/3]
A = [0.5, 0.5, -0.5, -0.5, -0.5, 2 / 3, -1 / 3, -1 / 3, -1 / 3]
LOGP = [-1.0, -0.5, -2.0, -1.5, -0.25, -1.0, -3.0, -0.5, -2.0]  # learner logprobs (the leaf)
WEIGHTS = {
    # each prompt's mean over its tokens (a: 5, b: 4), then the mean over 2 prompts
    Aggregation.prompt_mean: [1 / 10] * 5 + [1 / 8] * 4,
    # 9 tokens in all
    Aggregation.token_mean: [1 / 9] * 9,
    # each sample's mean over its tokens, then the mean over 5 samples: 1 / (5 n)
    Aggregation.sample_mean: [1 / 10] * 2 + [1 / 15] * 3 + [1 / 5, 1 / 5] + [1 / 10] * 2,
}
SAMPLE_OF_TOKEN = [0, 0, 1, 1, 1, 2, 3, 4, 4]
AGGREGATIONS = list(WEIGHTS)


def hand_batch(rho, how, prox_ratio=None):
    """LossInputs for the hand batch: behavior logprobs = LOGP - ln(rho), so pi_theta / pi_behavior = rho."""
    behavior = [lp - math.log(r) for lp, r in zip(LOGP, rho)]
    groups, start = [], 0
    for g, (lengths, rewards) in enumerate(zip(LENGTHS, REWARDS)):
        samples = []
        for n, reward in zip(lengths, rewards):
            samples.append(
                SampleArrays.of(
                    [4] * n, behavior[start : start + n], version_spans=[(0, 0, n)], reward=reward, finish_reason="stop"
                )
            )
            start += n
        groups.append(
            RolloutGroup.pack(samples, group_id=f"g{g}", prompt_id=g, actor_id="a", prompt_tokens=int32s([2, 3]))
        )
    masks = [[np.ones(n, dtype=bool) for n in lengths] for lengths in LENGTHS]
    rows = build_rows(groups, masks, group_advantages(groups, AdvantageNorm.none), aggregation_weights(masks, how))
    mb = collate(rows)
    np.testing.assert_allclose(mb.advantages.numpy(), A, rtol=1e-6)
    np.testing.assert_allclose(mb.weights.numpy(), WEIGHTS[how], rtol=1e-12)
    logp = torch.tensor(LOGP, requires_grad=True)
    prox = None if prox_ratio is None else torch.tensor([lp - math.log(r) for lp, r in zip(LOGP, prox_ratio)])
    return LossInputs(
        logp,
        mb.behavior_logprobs,
        mb.advantages,
        mb.weights.float(),
        prox_logprobs=prox,
        sample_index=mb.sample_index,
        token_mask=mb.token_mask,
    )


def check(inputs, cfg, per_token_loss, per_token_grad, clipped):
    """loss = sum_t w_t * loss_t and d loss / d logp_t = w_t * grad_t, with w from WEIGHTS."""
    loss, extra = policy_loss(inputs, cfg)
    loss.backward()
    w = inputs.weights.double().numpy()
    assert float(loss.detach()) == pytest.approx(float(np.dot(w, per_token_loss)), rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(inputs.logprobs.grad.numpy(), w * np.array(per_token_grad), rtol=1e-5, atol=1e-7)
    assert extra["clipped"].tolist() == clipped


# ---- cispo and tis: -sg(min(rho, cap)) * A * logp ---------------------------------------------------
RHO = [1, 2, 0.5, 8, 1, 3, 1, 0.25, 2]


@pytest.mark.parametrize("how", AGGREGATIONS, ids=[a.value for a in AGGREGATIONS])
def test_cispo_by_hand(how):
    coef = [1, 2, 0.5, 4, 1, 3, 1, 0.25, 2]  # eps_max = 4 caps t3's rho of 8
    loss_t = [-c * a * lp for c, a, lp in zip(coef, A, LOGP)]
    # t0: -1*0.5*(-1) = 0.5, t1: -2*0.5*(-0.5) = 0.5, t2: -0.5*(-0.5)*(-2) = -0.5, t3: -4*(-0.5)*(-1.5) = -3, ...
    assert loss_t[:4] == pytest.approx([0.5, 0.5, -0.5, -3.0])
    grad_t = [-c * a for c, a in zip(coef, A)]  # [-0.5, -1, 0.25, 2, 0.5, -2, 1/3, 1/12, 2/3]
    assert grad_t == pytest.approx([-0.5, -1, 0.25, 2, 0.5, -2, 1 / 3, 1 / 12, 2 / 3])
    check(
        hand_batch(RHO, how), LossConfig(type=LossType.cispo, eps_max=4.0), loss_t, grad_t, [0, 0, 0, 1, 0, 0, 0, 0, 0]
    )


@pytest.mark.parametrize("how", AGGREGATIONS, ids=[a.value for a in AGGREGATIONS])
def test_tis_by_hand(how):
    coef = [1, 2, 0.5, 2.5, 1, 2.5, 1, 0.25, 2]  # c = 2.5 truncates t3 (8) and t5 (3)
    loss_t = [-c * a * lp for c, a, lp in zip(coef, A, LOGP)]
    assert loss_t[3] == pytest.approx(-2.5 * -0.5 * -1.5) and loss_t[5] == pytest.approx(-2.5 * (2 / 3) * -1.0)
    grad_t = [-c * a for c, a in zip(coef, A)]  # [-0.5, -1, 0.25, 1.25, 0.5, -5/3, 1/3, 1/12, 2/3]
    assert grad_t == pytest.approx([-0.5, -1, 0.25, 1.25, 0.5, -5 / 3, 1 / 3, 1 / 12, 2 / 3])
    check(hand_batch(RHO, how), LossConfig(type=LossType.tis, tis_cap=2.5), loss_t, grad_t, [0, 0, 0, 1, 0, 1, 0, 0, 0])


# ---- ppo: -sg(min(pi_prox / pi_behavior, c)) * min(r A, clip(r, 0.8, 1.2) A), r = pi_theta / pi_prox --
R = [0.5, 1.5, 0.5, 1.5, 1.1, 1.5, 0.5, 0.9, 1.0]
PROX_OVER_BEHAVIOR = [1, 3, 0.5, 1, 2, 1, 4, 0.5, 1]  # capped at c = 2: [1, 2, 0.5, 1, 2, 1, 2, 0.5, 1]


@pytest.mark.parametrize("how", AGGREGATIONS, ids=[a.value for a in AGGREGATIONS])
def test_ppo_by_hand(how):
    # t0: r 0.5, A>0: min(0.25, 0.4) = 0.25 unclipped    t1: r 1.5, A>0: min(0.75, 0.6) = 0.6 clipped
    # t2: r 0.5, A<0: min(-0.25, -0.4) = -0.4 clipped    t3: r 1.5, A<0: min(-0.75, -0.6) = -0.75 unclipped
    # t4: r 1.1 inside [0.8, 1.2]: -0.55                 t5: r 1.5, A=2/3: min(1, 0.8) = 0.8 clipped
    # t6: r 0.5, A=-1/3: min(-1/6, -0.8/3) clipped       t7: r 0.9: -0.3      t8: r 1: -1/3
    surrogate = [0.25, 0.6, -0.4, -0.75, -0.55, 0.8, -0.8 / 3, -0.3, -1 / 3]
    iw = [1, 2, 0.5, 1, 2, 1, 2, 0.5, 1]
    loss_t = [-w * s for w, s in zip(iw, surrogate)]  # [-0.25, -1.2, 0.2, 0.75, 1.1, -0.8, 1.6/3, 0.15, 1/3]
    assert loss_t == pytest.approx([-0.25, -1.2, 0.2, 0.75, 1.1, -0.8, 1.6 / 3, 0.15, 1 / 3])
    # unclipped tokens: d/dlogp of -iw * r * A is -iw * A * r; clipped ones have no gradient
    grad_t = [-1 * 0.5 * 0.5, 0, 0, -1 * -0.5 * 1.5, -2 * -0.5 * 1.1, 0, 0, -0.5 * (-1 / 3) * 0.9, -1 * (-1 / 3) * 1.0]
    rho = [r * q for r, q in zip(R, PROX_OVER_BEHAVIOR)]  # pi_theta / pi_behavior
    check(
        hand_batch(rho, how, prox_ratio=R),
        LossConfig(type=LossType.ppo, clip_eps=0.2, prox_cap=2.0),
        loss_t,
        grad_t,
        [0, 1, 1, 0, 0, 1, 1, 0, 0],
    )


# ---- gspo: s_i = geometric mean of sample i's token ratios; -min(s A, clip(s, 0.8, 1.2) A) per sample ---
GSPO_RHO = [2, 2, 2, 4, 1, 0.5, 0.5, 1.1, 1.1]


@pytest.mark.parametrize("how", AGGREGATIONS, ids=[a.value for a in AGGREGATIONS])
def test_gspo_by_hand(how):
    # a0: s = (2*2)^(1/2) = 2,     A=+1/2: min(1, 0.6) = 0.6 clipped         -> loss -0.6, no gradient
    # a1: s = (2*4*1)^(1/3) = 2,   A=-1/2: min(-1, -0.6) = -1 unclipped      -> loss 1.0,  d/ds = 1/2
    # b0: s = 0.5,                 A=+2/3: min(1/3, 0.8*2/3) = 1/3 unclipped -> loss -1/3, d/ds = -2/3
    # b1: s = 0.5,                 A=-1/3: min(-1/6, -0.8/3) clipped         -> loss 0.8/3, no gradient
    # b2: s = (1.1*1.1)^(1/2) = 1.1, A=-1/3: inside the clip range           -> loss 1.1/3, d/ds = 1/3
    sample_loss = [-0.6, 1.0, -1 / 3, 0.8 / 3, 1.1 / 3]
    # d s_i / d logp_t = s_i / n_i for each of its n_i tokens
    sample_grad = [0.0, 0.5 * 2 / 3, (-2 / 3) * 0.5 / 1, 0.0, (1 / 3) * 1.1 / 2]
    # every token carries its sample's loss; the gradient reaching token t gathers the weights of
    # all the tokens of its sample: d loss / d logp_t = W_i * sample_grad_i, W_i = sum of w over sample i
    w = np.array(WEIGHTS[how])
    sample_weight = [w[[t for t in range(9) if SAMPLE_OF_TOKEN[t] == i]].sum() for i in range(5)]
    loss_t = [sample_loss[i] for i in SAMPLE_OF_TOKEN]
    grad_t = [sample_weight[i] * sample_grad[i] / w[t] for t, i in enumerate(SAMPLE_OF_TOKEN)]
    cfg = LossConfig(type=LossType.gspo, gspo_clip_low=0.2, gspo_clip_high=0.2)
    check(hand_batch(GSPO_RHO, how), cfg, loss_t, grad_t, [1, 1, 0, 0, 0, 0, 1, 0, 0])


def test_gspo_sequence_ratio_leaves_masked_tokens_out():
    # one sample of 3 tokens, the last masked: s = sqrt(2 * 2) = 2, not (2*2*8)^(1/3)
    logp = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    inputs = LossInputs(
        logp,
        logp.detach() - math.log(2) * torch.tensor([1.0, 1.0, 3.0]),
        torch.full((3,), -1.0),
        torch.tensor([0.5, 0.5, 0.0]),
        sample_index=torch.zeros(3, dtype=torch.long),
        token_mask=torch.tensor([True, True, False]),
    )
    loss, _ = policy_loss(inputs, LossConfig(type=LossType.gspo, gspo_clip_low=0.5, gspo_clip_high=2.0))
    assert float(loss.detach()) == pytest.approx(2.0)  # -(2 * -1), weights sum to 1
    loss.backward()
    # d/dlogp_t = W * (-A) * s / n = 1 * 1 * 2 / 2 on the two kept tokens, nothing on the masked one
    np.testing.assert_allclose(logp.grad.numpy(), [1.0, 1.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize("loss_type", list(LossType))
@pytest.mark.parametrize("advantage", [1.0, 0.0, -1.0])
def test_far_off_policy_tokens_give_a_finite_loss_and_gradient(loss_type, advantage):
    # behaviour logprobs near the validator's floor, the learner's near 0: log rho ~ 110, past float32's exp
    logp = torch.tensor([-0.5, -1.0], requires_grad=True)
    behavior = torch.tensor([-110.0, -105.0])
    inputs = LossInputs(
        logp,
        behavior,
        torch.full((2,), advantage),
        torch.tensor([0.5, 0.5]),
        prox_logprobs=logp.detach(),
        sample_index=torch.zeros(2, dtype=torch.long),
        token_mask=torch.ones(2, dtype=torch.bool),
    )
    loss, _ = policy_loss(inputs, LossConfig(type=loss_type))
    loss.backward()
    assert math.isfinite(float(loss.detach())) and torch.isfinite(logp.grad).all()


# ---- counts over every rank -------------------------------------------------------------------------


def test_aggregation_counts_come_from_every_rank_and_skip_masked_tokens():
    # this rank holds prompt a, with a1's first token masked (4 trainable tokens, 2 samples); the other
    # rank holds prompt b: all_sum adds its [tokens, samples, prompts] = [4, 3, 1]
    masks = [[np.ones(2, dtype=bool), np.array([False, True, True])]]

    def all_sum(local):
        return local + np.array([4.0, 3.0, 1.0])

    prompt = aggregation_weights(masks, Aggregation.prompt_mean, all_sum)
    assert prompt[0][0].tolist() == [1 / 8, 1 / 8] and prompt[0][1].tolist() == [0, 1 / 8, 1 / 8]  # 1 / (2 prompts * 4)
    token = aggregation_weights(masks, Aggregation.token_mean, all_sum)
    assert token[0][1].tolist() == [0, 1 / 8, 1 / 8]  # 1 / (4 + 4 tokens)
    sample = aggregation_weights(masks, Aggregation.sample_mean, all_sum)
    assert sample[0][1].tolist() == [0, 1 / 10, 1 / 10]  # 1 / (5 samples * 2 trainable tokens)


def test_batch_advantage_std_comes_from_every_rank():
    # this rank: rewards [1, 0] -> centred [0.5, -0.5]; the other: [1, 1, 0] -> [1/3, 1/3, -2/3], whose
    # [count, sum, sum of squares] = [3, 0, 6/9]; std = sqrt((0.5 + 6/9) / 5) = 0.483046
    group = RolloutGroup.pack(
        [SampleArrays.of([4], [-1.0], version_spans=[(0, 0, 1)], reward=r, finish_reason="stop") for r in (1.0, 0.0)],
        group_id="a",
        prompt_id=0,
        actor_id="a",
        prompt_tokens=int32s([2]),
    )

    def all_sum(local):
        return local + np.array([3.0, 0.0, 6 / 9])

    adv = group_advantages([group], AdvantageNorm.batch, all_sum)
    np.testing.assert_allclose(adv[0], [0.5 / 0.483046, -0.5 / 0.483046], rtol=1e-5)


# ---- rho = 1: cispo, tis and ppo (one update) are REINFORCE ------------------------------------------


@pytest.mark.parametrize("how", AGGREGATIONS, ids=[a.value for a in AGGREGATIONS])
@pytest.mark.parametrize("loss_type", [LossType.cispo, LossType.tis, LossType.ppo])
def test_on_policy_losses_reduce_to_reinforce(loss_type, how):
    inputs = hand_batch([1.0] * 9, how)
    if loss_type is LossType.ppo:
        inputs.prox_logprobs = inputs.logprobs.detach()  # one update: the proximal policy is the current one
    loss, _ = policy_loss(inputs, LossConfig(type=loss_type))
    loss.backward()
    # REINFORCE: loss = -sum_t w_t A_t logp_t, so d loss / d logp_t = -w_t A_t
    np.testing.assert_allclose(inputs.logprobs.grad.numpy(), -np.array(WEIGHTS[how]) * np.array(A), rtol=1e-6)


# ---- the trainer on the tiny model -----------------------------------------------------------------


def with_behavior(groups, logprobs):
    """The same groups with behavior logprobs replaced (logprobs[group][sample] -> float32 [tokens])."""
    return [
        RolloutGroup.pack(
            [SampleArrays(s, tokens, np.asarray(lp, dtype=np.float32)) for (s, tokens, _), lp in zip(g.unpack(), lps)],
            group_id=g.group_id,
            prompt_id=g.prompt_id,
            actor_id=g.actor_id,
            prompt_tokens=g.prompt_tokens,
        )
        for g, lps in zip(groups, logprobs)
    ]


@pytest.mark.parametrize("loss_type", [LossType.cispo, LossType.tis, LossType.ppo])
def test_trainer_step_is_reinforce_when_behavior_is_the_current_policy(loss_type, accelerator):
    from tidal.tiny import build_tiny_model

    groups, masks = step_batch(4)
    masks = [[np.ones_like(m) for m in g] for g in masks]
    # Reference, independent of the fused kernel and of the batching code: full-vocab log_softmax,
    # prompt_mean weights and group-centred advantages written out here, autograd, and AdamW's
    # first update p - lr * g / (|g| + eps) (bias corrections cancel at step 1).
    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    loss, behavior = 0.0, []
    for g in groups:
        prompt = g.prompt_tokens.numpy("i4", "p").tolist()
        rewards = [s.reward for s in g.samples]
        group_tokens = sum(s.num_tokens for s in g.samples)
        behavior.append([])
        for s, tokens, _ in g.unpack():
            completion = tokens.tolist()
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [completion, vocab]
            logp = logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
            behavior[-1].append(logp.detach().numpy())
            advantage = s.reward - sum(rewards) / len(rewards)
            loss = loss - advantage * logp.sum() / (group_tokens * len(groups))
    loss.backward()
    expected = {k: (p - p.grad / (p.grad.abs() + 1.0)).detach() for k, p in model.named_parameters()}

    cfg = replace(
        learner_config(loss_type, Aggregation.prompt_mean, 10_000, 1, num_groups=4), advantage_norm=AdvantageNorm.none
    )
    params, metrics = run_step(cfg, accelerator, with_behavior(groups, behavior), masks)
    assert metrics["offpolicy/rho_max"] == pytest.approx(1.0, abs=1e-5)
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize(
    "loss_type, how, minibatches",
    [
        (LossType.cispo, Aggregation.prompt_mean, 1),
        (LossType.tis, Aggregation.token_mean, 1),
        (LossType.ppo, Aggregation.sample_mean, 2),
        (LossType.gspo, Aggregation.prompt_mean, 1),
    ],
)
def test_gradient_accumulation_equals_one_big_micro_batch(loss_type, how, minibatches, accelerator):
    groups, masks = step_batch(6)
    rows = build_rows(groups, masks, group_advantages(groups, AdvantageNorm.none), aggregation_weights(masks, how))
    assert len(micro_batches(rows, 16)) >= 4  # the small budget really splits the step
    small, small_metrics = run_step(learner_config(loss_type, how, 16, minibatches), accelerator)
    big, big_metrics = run_step(learner_config(loss_type, how, 10_000, minibatches), accelerator)
    initial = run_step_initial()
    assert max(float((big[k] - initial[k]).abs().max()) for k in big) > 1e-2  # the step moved the weights
    for name in big:
        torch.testing.assert_close(small[name], big[name], atol=1e-5, rtol=0, msg=name)
    assert small_metrics["learner/loss"] == pytest.approx(big_metrics["learner/loss"], abs=1e-6)
    assert small_metrics["learner/packing_efficiency"] > big_metrics["learner/packing_efficiency"]


def run_step_initial():
    from tidal.tiny import build_tiny_model

    return build_tiny_model(TINY, ALPHABET, seed=0)[0].state_dict()


def test_micro_batches_pad_within_themselves_and_report_packing(accelerator):
    # hand batch rows (prompt 2 + completion): a0 4, a1 5, b0 3, b1 3, b2 4 -> sorted 3 3 4 4 5, 19 real tokens.
    # Budget 12: [3 3 4] pads to 3 x 4 = 12, [4 5] to 2 x 5 = 10 -> 22 computed (one batch would be 5 x 5 = 25).
    groups = hand_groups()
    masks = [[np.ones(n, dtype=bool) for n in lengths] for lengths in LENGTHS]
    rows = build_rows(
        groups, masks, group_advantages(groups, AdvantageNorm.none), aggregation_weights(masks, Aggregation.prompt_mean)
    )
    assert [[len(r.input_ids) for r in b] for b in micro_batches(rows, 12)] == [[3, 3, 4], [4, 5]]
    cfg = replace(learner_config(LossType.cispo, Aggregation.prompt_mean, 12, 1, num_groups=2), packing="padded")
    _, metrics = run_step(cfg, accelerator, groups, masks)
    assert metrics["learner/computed_tokens"] == 22
    assert metrics["learner/packing_efficiency"] == pytest.approx(19 / 22)
    assert metrics["learner/num_tokens"] == 9


def hand_groups():
    groups = []
    for g, (lengths, rewards) in enumerate(zip(LENGTHS, REWARDS)):
        samples = [
            SampleArrays.of([4] * n, [-2.0] * n, version_spans=[(STEP_VERSION, 0, n)], reward=r, finish_reason="stop")
            for n, r in zip(lengths, rewards)
        ]
        groups.append(
            RolloutGroup.pack(samples, group_id=f"g{g}", prompt_id=g, actor_id="a", prompt_tokens=int32s([2, 3]))
        )
    return groups


@pytest.mark.parametrize("scaling, ref, expected", [("none", 0, 0.01), ("sqrt", 16, 0.01 * 0.5), ("sqrt", 1, 0.01 * 2)])
def test_lr_scaling_sets_the_effective_lr(scaling, ref, expected, accelerator):
    from tidal.config import LrScaling

    cfg = learner_config(LossType.cispo, Aggregation.prompt_mean, 10_000, 1, num_groups=4)
    cfg = replace(cfg, optim=replace(cfg.optim, lr=0.01, lr_scaling=LrScaling(scaling), ref_groups_per_step=ref))
    # B = 4 groups per step: sqrt(4 / 16) = 0.5, sqrt(4 / 1) = 2
    _, metrics = run_step(cfg, accelerator)
    assert metrics["optim/lr"] == pytest.approx(expected)


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_lr_schedule_warms_up_then_holds_or_decays_to_its_floor(schedule):
    from tidal.config import LearnerConfig, LrSchedule, OptimConfig
    from tidal.learner.every_rank.trainer import lr_factor

    cfg = LearnerConfig(
        max_steps=110, optim=OptimConfig(warmup_steps=10, schedule=LrSchedule(schedule), min_lr_ratio=0.1)
    )
    factors = [lr_factor(cfg, s) for s in range(130)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[10] == 1.0
    after = factors[10:]
    if schedule == "constant":
        assert set(after) == {1.0}
        return
    assert all(a >= b for a, b in zip(after, after[1:])) and factors[110] == factors[129] == pytest.approx(0.1)
    assert factors[60] == pytest.approx(0.55)  # halfway through the decay both are halfway to the floor
    assert factors[35] == pytest.approx(
        0.1 + 0.9 * (0.5 * (1 + math.cos(math.pi / 4)) if schedule == "cosine" else 0.75)
    )


def test_step_metrics_are_floats_and_describe_the_batch(accelerator):
    _, metrics = run_step(learner_config(LossType.cispo, Aggregation.prompt_mean, 10_000, 1), accelerator)
    assert all(type(v) is float for v in metrics.values())
    groups, masks = step_batch(6)
    # lags: samples carry versions STEP_VERSION - 1 or STEP_VERSION; one token is masked
    lags = [STEP_VERSION - s.versions() for g in groups for s in g.samples]
    kept = np.concatenate([lag[m] for lag, m in zip(lags, [m for g in masks for m in g])])
    assert metrics["learner/num_tokens"] == kept.size
    assert metrics["offpolicy/lag_mean"] == pytest.approx(kept.mean())
    assert metrics["offpolicy/lag_max"] == kept.max()
    assert metrics["learner/advantage_std"] == pytest.approx(1.0, abs=1e-5)  # batch-normalised advantages
    assert 0 < metrics["learner/entropy"] <= math.log(len(ALPHABET) + 2)
    assert metrics["offpolicy/ess"] <= 1.0 and metrics["offpolicy/rho_max"] >= metrics["offpolicy/rho_mean"]


@pytest.mark.parametrize(
    "override, key",
    [
        ("learner.loss.type=reinforce", "learner.loss.type"),
        ("learner.loss.clip_eps=1.5", "learner.loss.clip_eps"),
        ("learner.loss.tis_cap=0", "learner.loss.tis_cap"),
        ("learner.loss.minibatches_per_step=99", "learner.loss.minibatches_per_step"),
        ("learner.optim.lr_scaling=sqrt", "learner.optim.ref_groups_per_step"),
        ("learner.micro_batch_tokens=0", "learner.micro_batch_tokens"),
    ],
)
def test_bad_learner_keys_are_named(override, key):
    from pathlib import Path

    preset = Path(__file__).parents[2] / "configs" / "tiny.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(preset, [override])
    assert key in str(err.value) and "\n" not in str(err.value)
