"""Staleness enforcement and the per-step metrics, on hand-made rollout groups with per-token
version spans, through the learner's real admission and `step_metrics`."""

import time
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import sample
from tidal.broker.inproc import InprocBroker
from tidal.broker.schema import RolloutGroup, SamplingParams, WireCodec, int32s
from tidal.config import CurriculumConfig, EvalConfig, LearnerConfig, LossConfig, OnViolation, StalenessConfig
from tidal.learner.every_rank.trainer import _StepStats
from tidal.learner.rank0.admission import Admission, StepBatch, staleness_masks
from tidal.learner.rank0.coordinator import Coordinator, DispatchPlan
from tidal.learner.rank0.groups import GroupBook
from tidal.learner.rank0.ledger import Ledger, read_ledger
from tidal.learner.rank0.loop import Learner, LearnerParts
from tidal.tasks import Prompt

VERSION = 10  # the learner's version: step 10 is about to be trained
MAX_LAG = 2


def group(samples, gid="g", prompt_id=1):
    return RolloutGroup.pack(
        samples, group_id=gid, prompt_id=prompt_id, actor_id="actor-0", prompt_tokens=int32s([2, 3, 4])
    )


# lags at version 10: sample 0 -> [1, 1, 0] (fresh enough); sample 1 -> [3, 3, 2, 2] (two tokens too old)
MIXED = [sample([(9, 2), (10, 1)], 1.0), sample([(7, 2), (8, 2)], 0.0)]
ALL_STALE = [sample([(7, 3)], 1.0), sample([(6, 1), (7, 1)], 0.0)]


def build_learner(tmp_path, on_violation, max_lag=MAX_LAG, curriculum=None):
    """The real learner parts that admission and the step metrics touch, over the in-process broker."""
    plan = DispatchPlan(
        run_id="r",
        task="arithmetic",
        n=2,
        sampling=SamplingParams(),
        eval_n=1,
        eval_sampling=SamplingParams(),
        groups_per_step=1,
        max_lag=max_lag,
        seed=0,
    )
    train = [Prompt(prompt_id=i, text="1+1=", payload={"answer": "02"}) for i in range(3)]
    transport = InprocBroker(WireCodec(1 << 20)).learner()
    book = GroupBook(Ledger(tmp_path / "ledger.jsonl"))
    coordinator = Coordinator(plan, train, [], lambda text: [1], transport, book, curriculum)
    staleness = StalenessConfig(max_lag=max_lag, on_violation=on_violation)
    parts = LearnerParts(
        trainer=SimpleNamespace(num_params=1000),
        coordinator=coordinator,
        book=book,
        admission=Admission(staleness, True, book, coordinator.on_rewards),
        transport=transport,
        publisher=None,
        tracker=None,
        checkpointer=SimpleNamespace(periodic=False),
    )
    learner = Learner(LearnerConfig(), EvalConfig(), parts)
    learner.version = VERSION
    return learner


def admit_all(learner, groups) -> StepBatch:
    batch = StepBatch()
    for g in groups:
        learner.parts.admission.add(g, batch, learner.version)
    return batch


def discarded(tmp_path):
    return [(e["id"], e["reason"]) for e in read_ledger(tmp_path / "ledger.jsonl") if e["event"] == "discarded"]


# ---- the pure check ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(OnViolation))
def test_fresh_groups_train_every_token_whatever_the_policy(policy):
    masks, num_stale = staleness_masks([np.array([0, 1, 2]), np.array([2])], 2, policy)
    assert num_stale == 0
    assert [m.tolist() for m in masks] == [[True, True, True], [True]]


def test_lag_equal_to_max_lag_is_allowed_and_one_more_is_not():
    masks, num_stale = staleness_masks([np.array([2, 3])], 2, OnViolation.mask_tokens)
    assert num_stale == 1 and masks[0].tolist() == [True, False]
    assert staleness_masks([np.array([1, 0])], 0, OnViolation.drop_group) == (None, 1)  # synchronous: k = 0


def test_each_policy_on_a_group_with_stale_tokens():
    lags = [np.array([1, 1, 0]), np.array([3, 3, 2, 2])]
    assert staleness_masks(lags, 2, OnViolation.drop_group) == (None, 2)
    masks, num_stale = staleness_masks(lags, 2, OnViolation.mask_tokens)
    assert num_stale == 2 and [m.tolist() for m in masks] == [[True] * 3, [False, False, True, True]]
    masks, num_stale = staleness_masks(lags, 2, OnViolation.keep)
    assert num_stale == 2 and [m.tolist() for m in masks] == [[True] * 3, [True] * 4]


def test_mask_tokens_drops_a_group_with_no_token_left():
    assert staleness_masks([np.array([3, 4]), np.array([5])], 2, OnViolation.mask_tokens) == (None, 3)


def test_injected_tokens_are_neither_stale_nor_trainable():
    lags = [np.array([3, 3, 1, 1])]  # tokens 0-1 stale; token 2 injected by the actor
    generated = [np.array([True, True, False, True])]
    masks, num_stale = staleness_masks(lags, 2, OnViolation.mask_tokens, generated)
    assert num_stale == 2 and masks[0].tolist() == [False, False, True, True]
    # stale injected tokens do not count, and a group whose only unmasked tokens are injected is dropped
    assert staleness_masks([np.array([3, 3])], 2, OnViolation.drop_group, [np.array([False, False])])[1] == 0
    assert staleness_masks([np.array([3, 1])], 2, OnViolation.mask_tokens, [np.array([True, False])]) == (None, 1)


# ---- through the learner's admission --------------------------------------------------------------


def test_drop_group_discards_the_whole_group_and_counts_it(tmp_path):
    learner = build_learner(tmp_path, OnViolation.drop_group)
    batch = admit_all(learner, [group(MIXED, "stale"), group([sample([(9, 2)], 1.0), sample([(10, 3)], 0.0)], "ok")])
    assert [g.group_id for g in batch.groups] == ["ok"]
    assert [m.tolist() for m in batch.token_masks[0]] == [[True, True], [True, True, True]]
    assert (batch.stats["dropped_stale"], batch.stats["stale_tokens"], batch.stats["masked_stale_tokens"]) == (1, 2, 0)
    assert discarded(tmp_path) == [("stale", "stale")]
    assert learner.book.counts["discarded/stale"] == 1


def test_mask_tokens_trains_the_fresh_tokens_only(tmp_path):
    learner = build_learner(tmp_path, OnViolation.mask_tokens)
    batch = admit_all(learner, [group(MIXED)])
    assert [g.group_id for g in batch.groups] == ["g"]
    assert [m.tolist() for m in batch.token_masks[0]] == [[True, True, True], [False, False, True, True]]
    assert (batch.stats["dropped_stale"], batch.stats["stale_tokens"], batch.stats["masked_stale_tokens"]) == (0, 2, 2)
    assert discarded(tmp_path) == []


def test_mask_tokens_never_sends_a_fully_masked_group_to_the_trainer(tmp_path):
    learner = build_learner(tmp_path, OnViolation.mask_tokens)
    batch = admit_all(learner, [group(ALL_STALE, "old")])
    assert batch.groups == [] and batch.token_masks == []
    assert (batch.stats["dropped_stale"], batch.stats["stale_tokens"], batch.stats["masked_stale_tokens"]) == (1, 5, 0)
    assert discarded(tmp_path) == [("old", "stale")]


def test_keep_trains_stale_tokens_but_counts_them(tmp_path):
    learner = build_learner(tmp_path, OnViolation.keep)
    batch = admit_all(learner, [group(MIXED), group(ALL_STALE, "old")])
    assert [g.group_id for g in batch.groups] == ["g", "old"]
    assert all(m.all() for masks in batch.token_masks for m in masks)
    assert (batch.stats["dropped_stale"], batch.stats["stale_tokens"], batch.stats["masked_stale_tokens"]) == (0, 7, 0)


def test_staleness_is_checked_before_the_zero_variance_filter(tmp_path):
    learner = build_learner(tmp_path, OnViolation.drop_group)
    same = [sample([(7, 2)], 1.0), sample([(10, 2)], 1.0)]  # stale and zero-variance: counted as stale
    fresh_same = [sample([(10, 2)], 0.0), sample([(10, 2)], 0.0)]
    batch = admit_all(learner, [group(same, "a"), group(fresh_same, "b")])
    assert batch.groups == []
    assert (batch.stats["dropped_stale"], batch.stats["zero_variance"]) == (1, 1)
    assert discarded(tmp_path) == [("a", "stale"), ("b", "zero_variance")]


def test_an_interrupted_group_with_only_its_injected_tokens_left_is_dropped(tmp_path):
    learner = build_learner(tmp_path, OnViolation.mask_tokens)
    # each sample: 2 stale generated tokens, 1 injected token, then nothing generated after it
    interrupted = [sample([(7, 2), (10, 1)], r, "interrupted", injected_spans=[(2, 3)]) for r in (1.0, 0.0)]
    batch = admit_all(learner, [group(interrupted, "cut")])
    assert batch.groups == []
    assert (batch.stats["dropped_stale"], batch.stats["stale_tokens"]) == (1, 4)


def test_pass_rates_use_the_task_reward_not_the_shaped_one(tmp_path):
    learner = build_learner(tmp_path, OnViolation.drop_group, curriculum=CurriculumConfig(min_samples=2))
    # correct but overlong: the shaped reward is negative, the task still counts it as a pass
    overlong = [sample([(10, 2)], -0.25, "length", raw_reward=1.0), sample([(10, 2)], 1.0)]
    batch = admit_all(learner, [group(overlong, "a", prompt_id=0)])
    assert batch.stats["passed"] == 2 and batch.stats["reward_sum"] == 0.75
    assert learner.coordinator.curriculum.retired == {0}


def test_discarded_groups_still_feed_the_curriculum(tmp_path):
    learner = build_learner(tmp_path, OnViolation.drop_group, curriculum=CurriculumConfig(min_samples=2))
    stale_solved = [sample([(7, 2)], 1.0), sample([(10, 2)], 1.0)]
    zero_variance_solved = [sample([(10, 2)], 1.0), sample([(10, 2)], 1.0)]
    admit_all(
        learner,
        [
            group(stale_solved, "a", prompt_id=0),
            group(zero_variance_solved, "b", prompt_id=1),
            group(MIXED, "c", prompt_id=2),
        ],
    )
    assert learner.coordinator.curriculum.retired == {0, 1}


# ---- the step's metrics --------------------------------------------------------------------------

# The quantities a step must log, item by item, and the metric that carries it.
STEP_METRICS = {
    "reward": ["rollout/reward"],
    "pass rate": ["rollout/pass_rate"],
    "advantage std": ["learner/advantage_std"],
    "rho mean/max": ["offpolicy/rho_mean", "offpolicy/rho_max"],
    "clipped fraction": ["offpolicy/clipped_frac"],
    "effective sample size": ["offpolicy/ess"],
    "lag mean/max": ["offpolicy/lag_mean", "offpolicy/lag_max"],
    "dropped-for-staleness count": [
        "offpolicy/dropped_stale_groups",
        "offpolicy/stale_tokens",
        "offpolicy/masked_stale_tokens",
    ],
    "mismatch KL": ["offpolicy/mismatch_kl"],
    "entropy": ["learner/entropy"],
    "grad norm": ["learner/grad_norm"],
    "lengths": ["rollout/completion_len_mean", "rollout/prompt_len_mean"],
    "truncation rate": ["rollout/truncation_rate"],
    "zero-variance fraction": ["rollout/zero_variance_frac"],
    "retired prompts": ["curriculum/retired_prompts"],
    "tokens/s": ["rollout/gen_tokens_per_s", "learner/tokens_per_s"],
    "weight-push time": ["timing/weight_push_s"],
}


def trainer_metrics() -> dict[str, float]:
    """What Trainer.step returns for an empty batch, and the weight-push time `Learner.run` adds."""
    identity = lambda values: np.asarray(values, dtype=np.float64)  # noqa: E731 (one rank: no reduction)
    metrics = _StepStats(VERSION, LossConfig()).summary(identity, identity, 1)
    return metrics | {
        "learner/grad_norm": 0.5,
        "optim/lr": 1e-3,
        "learner/num_updates": 1.0,
        "timing/train_step_s": 1.0,
        "learner/tokens_per_s": 7.0,
        "timing/weight_push_s": 0.01,
    }


def test_step_metrics_cover_the_list_with_the_batch_numbers(tmp_path):
    learner = build_learner(tmp_path, OnViolation.mask_tokens, curriculum=CurriculumConfig(min_samples=2))
    solved = [sample([(10, 2)], 1.0), sample([(10, 4)], 1.0, "length")]  # zero variance, retires prompt 0
    batch = admit_all(learner, [group(MIXED, "a", prompt_id=2), group(solved, "b", prompt_id=0)])
    learner.accounting.gen_rate.add(time.monotonic() - 1.0, 0)  # a step before: throughput is a recent rate
    metrics = learner.step_metrics(batch, trainer_metrics())
    missing = {item: [k for k in keys if k not in metrics] for item, keys in STEP_METRICS.items()}
    assert {item: keys for item, keys in missing.items() if keys} == {}
    # 4 samples: rewards 1, 0, 1, 1; one truncated; 3 + 4 + 2 + 4 = 13 completion tokens; prompts of 3 tokens
    assert metrics["rollout/reward"] == pytest.approx(0.75)
    assert metrics["rollout/pass_rate"] == pytest.approx(0.75)
    assert metrics["rollout/truncation_rate"] == pytest.approx(0.25)
    assert metrics["rollout/completion_len_mean"] == pytest.approx(13 / 4)
    assert metrics["rollout/prompt_len_mean"] == pytest.approx(3.0)
    assert metrics["rollout/zero_variance_frac"] == pytest.approx(0.5)
    assert (metrics["offpolicy/stale_tokens"], metrics["offpolicy/masked_stale_tokens"]) == (2.0, 2.0)
    assert metrics["offpolicy/dropped_stale_groups"] == 0.0
    assert metrics["curriculum/retired_prompts"] == 1.0
    assert all(type(v) is float for v in metrics.values())
