"""Whatever the validator admits, `Trainer.step` trains on without raising and with finite metrics.

Seeded random cases, boundary values weighted in (one token, the longest completion, equal rewards,
rewards at the range's ends, logprobs at the floor, 0 and a hair above, injected spans over all but
the first token, every token stale, interruptions, episodes), go through release, claim, validation
and admission as in the learner's loop, then through a real step of the tiny model under a random
loss, aggregation, packing and staleness rule. A share of the cases is poisoned (empty completions,
logprobs below the floor, another prompt's id) and must be refused instead.
"""

import copy
import dataclasses
import math
import random

import numpy as np
import pytest

from conftest import ALPHABET, TINY
from tidal.broker.schema import (
    Episode,
    InterruptParams,
    PromptGroup,
    RolloutGroup,
    SampleArrays,
    SamplingParams,
    int32s,
)
from tidal.config import (
    AdvantageNorm,
    Aggregation,
    LearnerConfig,
    LossConfig,
    LossType,
    OnViolation,
    OptimConfig,
    StalenessConfig,
)
from tidal.learner.every_rank.trainer import Trainer
from tidal.learner.rank0.admission import Admission, StepBatch
from tidal.learner.rank0.coordinator import release_of
from tidal.learner.rank0.groups import NEW, GroupBook
from tidal.learner.rank0.ledger import Ledger
from tidal.learner.rank0.validation import LOGPROB_SLACK, Validator, logprob_floor
from tidal.tiny import build_tiny_model

VERSION = 5  # the learner's version during every step
REWARD_RANGE = (-1.0, 1.0)
NUM_CASES, CASES_PER_TEST = 80, 20
POISON_SHARE = 0.15  # of the groups: each poisoned one must be refused


@pytest.fixture(scope="module")
def tiny_model():
    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    return model


def float32_inside(bound: float) -> float:
    """The float32 value nearest `bound` on its side of 0 (as an actor's logprob travels)."""
    value = np.float32(bound)
    return float(value if abs(float(value)) <= abs(bound) else np.nextafter(value, np.float32(0)))


def lowest_logprob(vocab_size: int) -> float:
    """The lowest logprob at or above the validator's floor that an actor could send."""
    return float32_inside(logprob_floor(vocab_size))


# ---- random cases --------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    learner: LearnerConfig
    staleness: StalenessConfig
    zero_variance_filter: bool
    temperature: float
    max_tokens: int  # the validator's budget (sampling.max_tokens)
    groups: list[tuple[PromptGroup, RolloutGroup, bool]]  # (released, its rollout, poisoned)


def random_case(rng: random.Random, vocab_size: int) -> Case:
    max_tokens = rng.choice([1, 2, 5, 16])
    interrupt = None
    if max_tokens >= 5 and rng.random() < 0.4:
        interrupt = InterruptParams((rng.randrange(vocab_size),) * rng.randint(1, 2), "==", 1, 2, 1)
    sampling = SamplingParams(temperature=rng.choice([0.5, 1.0, 2.0]), max_tokens=max_tokens, interrupt=interrupt)
    loss = LossConfig(
        type=rng.choice(list(LossType)),
        aggregation=rng.choice(list(Aggregation)),
        minibatches_per_step=rng.randint(1, 2),
        epochs_per_step=rng.randint(1, 2),
    )
    learner = LearnerConfig(
        groups_per_step=4,
        micro_batch_tokens=rng.choice([4, 16, 64, 8192]),
        advantage_norm=rng.choice(list(AdvantageNorm)),
        kernel_backend="torch",
        packing=rng.choice(["auto", "padded", "shared", "packed"]),
        loss=loss,
        optim=OptimConfig(lr=1e-2, max_grad_norm=rng.choice([0.0, 1.0])),
    )
    staleness = StalenessConfig(max_lag=rng.randint(0, 2), on_violation=rng.choice(list(OnViolation)))
    groups = []
    for g in range(rng.randint(1, 4)):
        released = PromptGroup(
            run_id="r",
            group_id=f"r-{g}",
            prompt_id=100 + g,
            task="arithmetic",
            payload={},
            prompt_tokens=int32s([rng.randrange(vocab_size) for _ in range(rng.randint(1, 6))]),
            n=rng.randint(1, 4),
            sampling=sampling,
            min_version=VERSION - rng.randint(0, 4),
        )
        poisoned = rng.random() < POISON_SHARE
        groups.append((released, random_rollout(rng, released, vocab_size, poisoned), poisoned))
    return Case(learner, staleness, rng.random() < 0.5, sampling.temperature, max_tokens, groups)


def random_rollout(rng: random.Random, released: PromptGroup, vocab_size: int, poisoned: bool) -> RolloutGroup:
    equal = rng.choice([None, None, 0.0, 1.0, -1.0])  # all-equal rewards: no advantage at all
    gen_seconds = rng.choice([0.0, 0.5])
    episode = rng.choice([None, None, Episode(turns=2, tool_calls=1, env_seconds=gen_seconds)])
    samples = [random_sample(rng, released, vocab_size, equal, episode) for _ in range(released.n)]
    prompt_id = poison(rng, samples, released) if poisoned else released.prompt_id
    return RolloutGroup.pack(
        samples,
        group_id=released.group_id,
        prompt_id=prompt_id,
        actor_id="actor-0",
        prompt_tokens=released.prompt_tokens,
        gen_seconds=gen_seconds,
        queue_seconds=rng.choice([0.0, 0.25]),
    )


def random_sample(
    rng: random.Random, released: PromptGroup, vocab_size: int, equal: float | None, episode: Episode | None
) -> SampleArrays:
    budget, interrupt = released.sampling.max_tokens, released.sampling.interrupt
    length = rng.choice([1, budget, rng.randint(1, budget)])
    finish = rng.choice(["stop", "length"] + (["interrupted"] * 2 if interrupt else []))
    injected: list[tuple[int, int]] = []
    if finish == "interrupted":
        longest = interrupt.max_think_tokens + len(interrupt.tokens) + interrupt.answer_tokens
        length = rng.randint(3, longest)  # thinking, the interruption, an answer token
        injected = [(1, 2)] if length == 3 else [(rng.randint(1, length - 2), length - 1)]
    elif length >= 2 and rng.random() < 0.4:
        # injected text after the first token, up to the end where the sample ran out of budget there
        end = length if finish == "length" else length - 1
        if end > 1:
            start = 1 if rng.random() < 0.5 else rng.randint(1, end - 1)
            injected = [(start, end)]
    tokens = [rng.randrange(vocab_size) for _ in range(length)]
    lowest = lowest_logprob(vocab_size)
    choices = [lowest, 0.0, float32_inside(LOGPROB_SLACK), -1e-8, None]  # None: anything in between
    logprobs = [c if (c := rng.choice(choices)) is not None else rng.uniform(lowest, 0.0) for _ in range(length)]
    for start, end in injected:
        logprobs[start:end] = [0.0] * (end - start)  # what an actor sends for injected tokens
    cut = rng.randint(0, length)  # a weight update may land mid-sample
    old = rng.randint(released.min_version, VERSION)
    spans = [(v, a, b) for v, a, b in ((old, 0, cut), (rng.randint(old, VERSION), cut, length)) if b > a]
    reward = equal if equal is not None else rng.choice([-1.0, 0.0, 1.0, rng.uniform(*REWARD_RANGE)])
    raw = rng.choice([None, reward, rng.choice(REWARD_RANGE)])
    return SampleArrays.of(
        tokens,
        logprobs,
        version_spans=spans,
        reward=reward,
        finish_reason=finish,
        injected_spans=injected,
        raw_reward=raw,
        episode=episode,
    )


def poison(rng: random.Random, samples: list[SampleArrays], released: PromptGroup) -> int:
    """Spoil one sample (or the group's prompt id) in place; returns the prompt id the rollout will name."""
    kind = rng.choice(["empty", "minus_999", "below_floor", "prompt_id"])
    i = rng.randrange(len(samples))
    s = samples[i]
    if kind == "empty":
        samples[i] = SampleArrays.of([], [], version_spans=[], reward=s.sample.reward, finish_reason="length")
    elif kind in ("minus_999", "below_floor"):
        logprobs = s.logprobs.copy()
        logprobs[rng.randrange(len(logprobs))] = -999.0 if kind == "minus_999" else logprob_floor(10**9)
        samples[i] = s._replace(logprobs=logprobs)
    else:
        return released.prompt_id + 1
    return released.prompt_id


# ---- through the learner's pipeline ----------------------------------------------------------------


def admit(case: Case, vocab_size: int, ledger_path) -> tuple[StepBatch, list[tuple[str, str | None]]]:
    """Release, claim, validate and admit each group as the learner's loop does; returns the batch and
    each poisoned group's (id, rejection reason), and fails on an honest group refused."""
    book = GroupBook(Ledger(ledger_path))
    validator = Validator(vocab_size, case.max_tokens, REWARD_RANGE)
    admission = Admission(case.staleness, case.zero_variance_filter, book, on_rewards=lambda *_: None)
    with book.cond:
        book.release({released.group_id: release_of(released, i) for i, (released, _, _) in enumerate(case.groups)})
    batch, poisoned = StepBatch(), []
    for _, group, is_poisoned in case.groups:
        assert book.claim(group.group_id) == NEW
        reason = validator.check(group, book.outstanding[group.group_id], VERSION)
        if is_poisoned:
            poisoned.append((group.group_id, reason))
        else:
            assert reason is None, f"an honest group refused as {reason}: {group}"
        if reason is None:
            admission.add(group, batch, VERSION)
        else:
            book.discard(group.group_id, f"invalid/{reason}")
    return batch, poisoned


def train(case: Case, batch: StepBatch, model, accelerator) -> dict[str, float]:
    """One step of a fresh copy of `model` on the admitted batch (a mini-batch needs a group)."""
    minibatches = min(case.learner.loss.minibatches_per_step, len(batch.groups))
    cfg = dataclasses.replace(
        case.learner, loss=dataclasses.replace(case.learner.loss, minibatches_per_step=minibatches)
    )
    trainer = Trainer(cfg, copy.deepcopy(model), accelerator, temperature=case.temperature)
    return trainer.step(batch.groups, batch.token_masks, VERSION)


@pytest.mark.parametrize("first_seed", range(0, NUM_CASES, CASES_PER_TEST))
def test_every_admitted_batch_trains_with_finite_metrics(first_seed, tiny_model, accelerator, tmp_path):
    vocab_size = tiny_model.config.vocab_size
    failures, num_steps, num_poisoned = [], 0, 0
    for seed in range(first_seed, first_seed + CASES_PER_TEST):
        case = random_case(random.Random(seed), vocab_size)
        batch, poisoned = admit(case, vocab_size, tmp_path / f"ledger-{seed}.jsonl")
        num_poisoned += len(poisoned)
        assert all(reason is not None for _, reason in poisoned), (seed, poisoned)
        if not batch.groups:
            continue
        try:
            metrics = train(case, batch, tiny_model, accelerator)
        except Exception as err:  # noqa: BLE001 (any exception is the failure this test looks for)
            failures.append((seed, f"{type(err).__name__}: {err}"[:300]))
            continue
        num_steps += 1
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        if bad:
            failures.append((seed, bad))
    assert failures == [], failures
    assert num_steps >= CASES_PER_TEST // 2 and num_poisoned > 0  # the cases reach the trainer, and poison is tried


# ---- the two rollouts that used to pass and break a step ----------------------------------------------


def one_group(tokens_per_sample: list[int], logprob: float, rewards=(1.0, 0.0)) -> tuple[PromptGroup, RolloutGroup]:
    released = PromptGroup(
        run_id="r",
        group_id="r-0",
        prompt_id=3,
        prompt_tokens=int32s([2, 3]),
        task="arithmetic",
        payload={},
        n=len(tokens_per_sample),
        sampling=SamplingParams(max_tokens=8),
        min_version=VERSION,
    )
    samples = [
        SampleArrays.of(
            [4] * n, [logprob] * n, version_spans=[(VERSION, 0, n)] if n else [], reward=r, finish_reason="length"
        )
        for n, r in zip(tokens_per_sample, rewards)
    ]
    return released, RolloutGroup.pack(
        samples, group_id="r-0", prompt_id=3, actor_id="actor-0", prompt_tokens=released.prompt_tokens
    )


def step_on(group: RolloutGroup, loss: LossType, model, accelerator) -> dict[str, float]:
    cfg = LearnerConfig(
        groups_per_step=1, micro_batch_tokens=4, kernel_backend="torch", packing="padded", loss=LossConfig(type=loss)
    )
    masks = [[np.ones(s.num_tokens, dtype=bool) for s in group.samples]]
    return Trainer(cfg, copy.deepcopy(model), accelerator, temperature=1.0).step([group], masks, VERSION)


def test_a_completion_without_tokens_is_refused_and_a_step_survives_one(tiny_model, accelerator):
    released, group = one_group([0, 3], logprob=-1.0)
    assert (
        Validator(tiny_model.config.vocab_size, 8, REWARD_RANGE).check(group, release_of(released, 0), VERSION)
        == "empty_completion"
    )
    # unvalidated, it makes a micro-batch of no token (rows sorted by length): the step still runs
    metrics = step_on(group, LossType.cispo, tiny_model, accelerator)
    assert metrics["learner/num_samples"] == 2 and metrics["learner/num_tokens"] == 3
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("loss", list(LossType))
def test_minus_999_is_refused_and_logprobs_at_the_floor_keep_every_metric_finite(loss, tiny_model, accelerator):
    vocab_size = tiny_model.config.vocab_size
    validator = Validator(vocab_size, 8, REWARD_RANGE)
    released, poisoned = one_group([2, 3], logprob=-999.0)
    assert validator.check(poisoned, release_of(released, 0), VERSION) == "logprob"
    released, lowest = one_group([2, 3], logprob=lowest_logprob(vocab_size))
    assert validator.check(lowest, release_of(released, 0), VERSION) is None
    metrics = step_on(lowest, loss, tiny_model, accelerator)
    assert {k: v for k, v in metrics.items() if not math.isfinite(v)} == {}
    assert metrics["offpolicy/rho_max"] > 1e40  # the learner's logprobs are far above the floor
