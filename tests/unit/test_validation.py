"""Poison that decodes cleanly never reaches the loss: rollouts are checked against what was
released (ids, prompt, sample count, versions, timings) and for sense (empty completions, finish
reasons, token ids, logprobs, rewards); a bad one is rejected and counted, and the run goes on."""

import dataclasses
import json
import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tidal.broker.inproc import InprocBroker
from tidal.broker.schema import (
    Episode,
    InterruptParams,
    PromptGroup,
    RolloutGroup,
    SampleArrays,
    SamplingParams,
    WireCodec,
    int32s,
)
from tidal.config import CurriculumConfig, EvalConfig, LearnerConfig, StalenessConfig
from tidal.learner.rank0.admission import Admission, StepBatch
from tidal.learner.rank0.coordinator import Coordinator, DispatchPlan, release_of
from tidal.learner.rank0.groups import GroupBook, Release
from tidal.learner.rank0.ledger import Ledger, read_ledger
from tidal.learner.rank0.loop import Learner, LearnerParts
from tidal.learner.rank0.validation import FLOAT32_EXP_UNDERFLOW, Validator, logprob_floor
from tidal.tasks import Prompt

VOCAB, VERSION = 14, 5
PROMPT_IDS = (10, 11, 12, 13)  # the training split's ids (the curriculum retires prompts by these)
R0_PROMPT, R1_PROMPT = 12, 10  # what groups r-0 and r-1 go out with (the seed-0 shuffle of epoch 0)


@pytest.fixture
def learner(tmp_path):
    """A learner whose coordinator has released one window of groups at version VERSION - 1; a prompt
    is retired once 2 of its samples all pass."""
    plan = DispatchPlan(
        run_id="r",
        task="arithmetic",
        n=2,
        sampling=SamplingParams(max_tokens=6),
        eval_n=2,
        eval_sampling=SamplingParams(max_tokens=6),
        groups_per_step=2,
        max_lag=1,
        seed=0,
    )
    train = [Prompt(prompt_id=i, text="1+1=", payload={"answer": "02"}) for i in PROMPT_IDS]
    val = [Prompt(prompt_id=100, text="2+2=", payload={"answer": "04"})]
    transport = InprocBroker(WireCodec(1 << 20)).learner()
    book = GroupBook(Ledger(tmp_path / "ledger.jsonl"))
    coordinator = Coordinator(
        plan, train, val, lambda prompt: [2, 3, 4], transport, book, CurriculumConfig(min_samples=2)
    )
    coordinator.version = VERSION - 1
    with book.cond:
        groups = [coordinator._next_train_group() for _ in range(2)]
        book.release({g.group_id: release_of(g, index) for g, index in groups})
    assert [g.prompt_id for g, _ in groups] == [R0_PROMPT, R1_PROMPT]
    parts = LearnerParts(
        trainer=SimpleNamespace(num_params=10),
        coordinator=coordinator,
        book=book,
        admission=Admission(StalenessConfig(max_lag=1), False, book, coordinator.on_rewards),
        transport=transport,
        publisher=None,
        tracker=RecordingTracker(),
        checkpointer=SimpleNamespace(periodic=False),
        validator=Validator(VOCAB, 6, (-1.0, 1.0)),
    )
    learner = Learner(LearnerConfig(), EvalConfig(), parts)
    learner.version = VERSION
    return learner


class RecordingTracker:
    """What the learner logs, kept (no MLflow in this tier)."""

    log_every_steps = 0

    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.logged.append((step, metrics))


def rollout(
    group_id="r-0",
    tokens=(5, 6, 1),
    logprobs=(-0.5, -1.0, -0.1),
    version=VERSION - 1,
    rewards=(1.0, 0.0),
    prompt=(2, 3, 4),
    n=2,
    eval_version=None,
    prompt_id=R0_PROMPT,
    finish_reason="stop",
    injected_spans=(),
    gen_seconds=0.0,
    episode=None,
    components=None,
) -> RolloutGroup:
    samples = [
        SampleArrays.of(
            tokens,
            logprobs,
            version_spans=[(version, 0, len(tokens))],
            reward=r,
            finish_reason=finish_reason,
            injected_spans=list(injected_spans),
            episode=episode,
            reward_components=components or {},
        )
        for r in rewards[:n]
    ]
    return RolloutGroup.pack(
        samples,
        group_id=group_id,
        prompt_id=prompt_id,
        actor_id="actor-0",
        prompt_tokens=int32s(prompt),
        eval_version=eval_version,
        gen_seconds=gen_seconds,
    )


def take(learner, group) -> StepBatch:
    batch = StepBatch()
    learner.on_training_group(group, batch)
    return batch


def test_a_rollout_that_means_what_was_sent_out_is_admitted(learner):
    assert len(take(learner, rollout()).groups) == 1


def test_reward_components_named_as_functions_and_entry_points_are_admitted(learner):
    group = rollout(components={"accuracy": 1.0, "format_v2": 0.0, "my-pkg.length:short": 0.5})
    assert len(take(learner, group).groups) == 1


@pytest.mark.parametrize(
    "bad, reason",
    [
        (dict(tokens=(5, 14, 1)), "token_id"),  # beyond the vocabulary
        (dict(tokens=(5, -3, 1)), "token_id"),
        (dict(tokens=(5,) * 7, logprobs=(-0.1,) * 7), "length"),  # longer than max_tokens
        (dict(logprobs=(-0.5, 0.3, -0.1)), "logprob"),  # a probability above 1
        (dict(logprobs=(-0.5, -1e30, -0.1)), "logprob"),  # rho = inf, ESS NaN downstream
        (dict(version=VERSION + 1), "version"),  # from the future: never stale otherwise
        (dict(version=VERSION - 2), "version"),  # older than the group's min_version
        (dict(rewards=(1e30, 0.0)), "reward"),  # would shrink every other group's advantage to nothing
        (dict(prompt=(2, 3, 9)), "prompt"),  # a prompt that was never sent
        # a component's name is a metric's: one MLflow refuses stopped the learner 2.9 s after one rollout
        (dict(components={"a?b": 1.0}), "reward_component"),
        (dict(components={"accuracy": 1.0, "../../x": 0.0}), "reward_component"),
        (dict(components={"a\nb": 1.0}), "reward_component"),
        (dict(n=1), "sample_count"),
        (dict(tokens=(), logprobs=()), "empty_completion"),  # crashed Trainer.step on an empty tensor
        (dict(logprobs=(-0.5, -999.0, -0.1)), "logprob"),  # passed the old -1e3 floor: offpolicy/* inf and NaN
        (dict(prompt_id=R1_PROMPT), "prompt_id"),  # another released prompt: would be judged by the curriculum
        (dict(prompt_id=99), "prompt_id"),  # a prompt never released
        # a stop is a sampled token: a completion ending in injected text did not stop
        (dict(tokens=(5, 6, 7), logprobs=(-0.5, 0.0, 0.0), injected_spans=[(1, 3)]), "finish_reason"),
        # "interrupted" in a group released without forced interruptions
        (
            dict(tokens=(5, 6, 7), logprobs=(-0.5, 0.0, -0.1), injected_spans=[(1, 2)], finish_reason="interrupted"),
            "finish_reason",
        ),
        # injected text before any sampled token: an injection answers a sampled turn
        (dict(tokens=(5, 6, 7), logprobs=(0.0, -0.5, -0.1), injected_spans=[(0, 1)]), "injected_spans"),
        (dict(gen_seconds=1e6), "timing"),  # 11 days of generation for a group released a moment ago
        # an episode's environment ran longer than its whole group's generation
        (dict(gen_seconds=1.0, episode=Episode(turns=2, env_seconds=3600.0)), "timing"),
    ],
)
def test_poison_is_rejected_by_reason_and_frees_the_slot(learner, tmp_path, bad, reason):
    batch = take(learner, rollout(**bad))
    assert batch.groups == []
    assert learner.parts.validator.rejected == {reason: 1}
    assert learner.book.counts[f"discarded/invalid/{reason}"] == 1 and "r-0" not in learner.book.outstanding
    assert ("r-0", f"invalid/{reason}") in [
        (e["id"], e["reason"]) for e in read_ledger(tmp_path / "ledger.jsonl") if e["event"] == "discarded"
    ]


def test_ids_never_released_are_rejected_and_copies_are_duplicates(learner):
    assert take(learner, rollout(group_id="r-999")).groups == []  # forged: never released
    assert learner.book.counts["rejected/unreleased"] == 1
    assert len(take(learner, rollout()).groups) == 1
    assert take(learner, rollout()).stats["duplicates"] == 1  # the same id again
    assert "r-999" not in learner.book.outstanding


def test_forged_eval_groups_change_no_evaluation(learner):
    learner.evaluator.start(VERSION)
    [eval_id] = learner.evals.expected[VERSION]
    held_out = dict(prompt_id=100, rewards=(1.0, 1.0))
    learner.evaluator.on_group(rollout(group_id=eval_id, eval_version=VERSION + 3, **held_out), VERSION)
    learner.evaluator.on_group(rollout(group_id="r-eval-forged", eval_version=VERSION, **held_out), VERSION)
    assert learner.evals.results == {} and learner.evaluator.waiting()
    learner.evaluator.on_group(
        rollout(group_id=eval_id, eval_version=VERSION, logprobs=(0.5, 0.5, 0.5), version=VERSION, **held_out), VERSION
    )
    assert learner.parts.validator.rejected["logprob"] == 1
    assert learner.evals.results == {} and not learner.evaluator.waiting()  # done, and no pass rate from poison
    assert learner.parts.tracker.logged == [(VERSION, {"eval/refused_groups": 1.0})]  # said instead


def test_an_eval_group_naming_another_prompt_gives_no_pass_rate(learner):
    learner.evaluator.start(VERSION)
    [eval_id] = learner.evals.expected[VERSION]
    learner.evaluator.on_group(
        rollout(group_id=eval_id, eval_version=VERSION, version=VERSION, prompt_id=R0_PROMPT, rewards=(1.0, 1.0)),
        VERSION,
    )  # a training prompt's id
    assert learner.parts.validator.rejected == {"prompt_id": 1}
    assert learner.evals.results == {}


def test_the_book_grows_with_what_is_in_flight_not_with_the_run(tmp_path):
    book, sizes = GroupBook(Ledger(tmp_path / "ledger.jsonl"), remember=100), []
    for step in range(200):
        ids = [f"r-{step}-{i}" for i in range(10)]
        with book.cond:
            book.release({gid: Release(i, step, 2, "d") for i, gid in enumerate(ids)})
        assert all(book.claim(gid) == "new" for gid in ids)
        book.trained(step + 1, ids)
        sizes.append(len(json.dumps(book.state_dict())))
    assert sizes[-1] < 1.2 * sizes[50] and len(list(book.consumed)) == 100  # ids only get a digit longer
    assert book.claim("r-199-0") == "duplicate" and book.claim("r-0-0") == "unreleased"  # remembered, forgotten


# ---- the prompt id: what the curriculum judges -------------------------------------------------


def test_a_rollout_naming_another_prompt_is_refused_and_retires_nothing(learner, tmp_path):
    # all pass, 2 samples: enough to retire whichever prompt the curriculum credits them to
    forged = rollout(prompt_id=R1_PROMPT, rewards=(1.0, 1.0))
    assert take(learner, forged).groups == []
    assert learner.parts.validator.rejected == {"prompt_id": 1}
    assert learner.coordinator.curriculum.retired == set()
    assert not any(e["event"] == "retired" for e in read_ledger(tmp_path / "ledger.jsonl"))
    # the released prompt is judged on its own group's rollout only
    take(learner, rollout(group_id="r-1", prompt_id=R1_PROMPT, rewards=(1.0, 1.0)))
    assert learner.coordinator.curriculum.retired == {R1_PROMPT}


def test_without_a_validator_the_curriculum_still_hears_the_released_prompt(learner):
    learner.parts.validator = None
    take(learner, rollout(prompt_id=R1_PROMPT, rewards=(1.0, 1.0)))  # group r-0 went out with R0_PROMPT
    assert learner.coordinator.curriculum.retired == {R0_PROMPT}


def test_a_resumed_release_from_before_prompt_ids_gets_its_prompt_and_interruption_from_the_plan(learner, tmp_path):
    state = learner.coordinator.state_dict()
    for release in state["outstanding"].values():  # as a checkpoint made before releases carried them
        for key in ("prompt_id", "interrupted_max_tokens", "released_at"):
            del release[key]
    # resumed with forced interruptions on: think up to 2, 1 interruption token, answer up to 2
    plan = dataclasses.replace(
        learner.coordinator.plan, sampling=SamplingParams(max_tokens=6, interrupt=InterruptParams((7,), "=", 1, 2, 2))
    )
    resumed = Coordinator(
        plan,
        learner.coordinator.train,
        [],
        lambda prompt: [2, 3, 4],
        learner.transport,
        GroupBook(Ledger(tmp_path / "resumed.jsonl")),
    )
    resumed.load_state_dict(json.loads(json.dumps(state)))
    releases = resumed.book.outstanding
    assert {gid: r.prompt_id for gid, r in releases.items()} == {"r-0": R0_PROMPT, "r-1": R1_PROMPT}
    assert [r.interrupted_max_tokens for r in releases.values()] == [5, 5]
    assert Validator(VOCAB, 6, (-1.0, 1.0)).check(rollout(), resumed.book.outstanding["r-0"], VERSION) is None


# ---- the logprob floor -------------------------------------------------------------------------


def test_the_floor_is_what_a_float32_softmax_can_give_a_token_it_can_sample():
    vocab = 1000
    floor = logprob_floor(vocab)
    assert floor == pytest.approx(-150 * math.log(2) - math.log(vocab), abs=0.01)
    for gap, sampleable in ((FLOAT32_EXP_UNDERFLOW + 0.05, True), (FLOAT32_EXP_UNDERFLOW - 0.05, False)):
        # the lowest token sits `gap` below every other one: the widest normalizer there is (S ~ V)
        logits = torch.zeros(vocab, dtype=torch.float32)
        logits[0] = gap
        # any sampler needs the token's weight exp(x - max) not to underflow (a normalized softmax even more)
        assert (torch.exp(logits - logits.max())[0] > 0).item() is sampleable
        assert torch.log_softmax(logits, 0)[0].item() >= floor or not sampleable
    for temperature in (0.05, 1.0, 100.0):  # logprobs after temperature: the bound holds at any T
        logits = torch.zeros(vocab, dtype=torch.float32)
        logits[0] = (FLOAT32_EXP_UNDERFLOW + 0.05) * temperature
        scaled = logits / temperature
        assert torch.exp(scaled - scaled.max())[0] > 0
        assert torch.log_softmax(scaled, 0)[0].item() >= floor


def test_logprobs_at_the_floor_pass_and_below_it_are_refused():
    validator, release = Validator(VOCAB, 6, (-1.0, 1.0)), _release()
    at_floor = float(np.float32(validator.logprob_floor + 1e-4))  # as it travels: float32
    assert validator.check(rollout(logprobs=(at_floor, -1.0, -0.1)), release, VERSION) is None
    assert (
        validator.check(rollout(logprobs=(validator.logprob_floor - 0.01, -1.0, -0.1)), release, VERSION) == "logprob"
    )


# ---- finish reasons and timings, against one release --------------------------------------------


def _release(sampling=SamplingParams(max_tokens=6), released_at=None) -> Release:
    group = PromptGroup(
        run_id="r",
        group_id="r-0",
        prompt_id=R0_PROMPT,
        prompt_tokens=int32s([2, 3, 4]),
        task="arithmetic",
        payload={},
        n=2,
        sampling=sampling,
        min_version=VERSION - 1,
    )
    release = release_of(group, 0)
    if released_at is not None:
        release.released_at = released_at
    return release


def test_interrupted_samples_fit_the_interruption_their_group_was_released_with():
    # thinking budget up to 2, 1 interruption token, answer up to 2: at most 5 tokens finish "interrupted"
    interrupt = InterruptParams((7,), "=", 1, 2, 2)
    release, validator = _release(SamplingParams(max_tokens=6, interrupt=interrupt)), Validator(VOCAB, 6, (-1.0, 1.0))

    def interrupted(num_tokens):
        return rollout(
            tokens=(5,) * num_tokens,
            logprobs=(-0.5,) * num_tokens,
            injected_spans=[(2, 3)],
            finish_reason="interrupted",
        )

    assert validator.check(interrupted(5), release, VERSION) is None
    assert validator.check(interrupted(6), release, VERSION) == "finish_reason"
    assert validator.check(interrupted(5), _release(), VERSION) == "finish_reason"  # released without interruptions


def test_a_truncation_shorter_than_the_budget_is_accepted():
    # an episode whose environment's reply does not fit, or an engine's max_model_len, ends there
    truncated = rollout(tokens=(5, 6), logprobs=(-0.5, -0.2), finish_reason="length")
    assert Validator(VOCAB, 6, (-1.0, 1.0)).check(truncated, _release(), VERSION) is None


def test_timings_must_fit_in_the_time_since_the_release():
    now = time.time()
    validator = Validator(VOCAB, 6, (-1.0, 1.0), clock=lambda: now)
    released_an_hour_ago = _release(released_at=now - 3600)
    assert validator.check(rollout(gen_seconds=3500.0), released_an_hour_ago, VERSION) is None
    assert validator.check(rollout(gen_seconds=4000.0), released_an_hour_ago, VERSION) == "timing"
    assert validator.check(rollout(gen_seconds=4000.0), _release(released_at=0.0), VERSION) is None  # unknown
    episode = Episode(turns=3, tool_calls=1, env_seconds=2.0)
    assert validator.check(rollout(gen_seconds=2.5, episode=episode), released_an_hour_ago, VERSION) is None
    # refused at the wire already; and here too, for a group that never crossed it
    for bad in (-1.0, float("nan"), float("inf")):
        assert validator.check(rollout(gen_seconds=bad), released_an_hour_ago, VERSION) == "timing"
