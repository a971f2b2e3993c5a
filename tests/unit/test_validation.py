"""Poison that decodes cleanly never reaches the loss: rollouts are checked against what was
released (ids, prompt, sample count, versions) and for sense (token ids, logprobs, rewards); a bad
one is rejected and counted, and the run goes on."""
import json
from types import SimpleNamespace

import pytest

from tidal.broker.inproc import InprocBroker
from tidal.broker.schema import RolloutGroup, SampleArrays, SamplingParams, WireCodec, int32s
from tidal.config import EvalConfig, LearnerConfig, StalenessConfig
from tidal.learner.admission import Admission, StepBatch
from tidal.learner.coordinator import Coordinator, DispatchPlan, release_of
from tidal.learner.groups import GroupBook, Release
from tidal.learner.ledger import Ledger, read_ledger
from tidal.learner.loop import Learner, LearnerParts
from tidal.learner.validation import Validator
from tidal.tasks import Prompt

VOCAB, VERSION = 14, 5


@pytest.fixture
def learner(tmp_path):
    """A learner whose coordinator has released one window of groups at version VERSION - 1."""
    plan = DispatchPlan(run_id="r", task="arithmetic", n=2, sampling=SamplingParams(max_tokens=6), eval_n=2,
                        eval_sampling=SamplingParams(max_tokens=6), groups_per_step=2, max_lag=1, seed=0)
    train = [Prompt(prompt_id=i, text="1+1=", payload={"answer": "02"}) for i in range(4)]
    val = [Prompt(prompt_id=100, text="2+2=", payload={"answer": "04"})]
    transport = InprocBroker(WireCodec(1 << 20)).learner()
    book = GroupBook(Ledger(tmp_path / "ledger.jsonl"))
    coordinator = Coordinator(plan, train, val, lambda prompt: [2, 3, 4], transport, book)
    coordinator.version = VERSION - 1
    with book.cond:
        groups = [coordinator._next_train_group() for _ in range(2)]
        book.release({g.group_id: release_of(g, index) for g, index in groups})
    parts = LearnerParts(trainer=SimpleNamespace(num_params=10), coordinator=coordinator, book=book,
                         admission=Admission(StalenessConfig(max_lag=1), False, book, coordinator.on_rewards),
                         transport=transport, publisher=None, tracker=None,
                         checkpointer=SimpleNamespace(periodic=False), validator=Validator(VOCAB, 6, (-1.0, 1.0)))
    learner = Learner(LearnerConfig(), EvalConfig(), parts)
    learner.version = VERSION
    return learner


def rollout(group_id="r-0", tokens=(5, 6, 1), logprobs=(-0.5, -1.0, -0.1), version=VERSION - 1, rewards=(1.0, 0.0),
            prompt=(2, 3, 4), n=2, eval_version=None) -> RolloutGroup:
    samples = [SampleArrays.of(tokens, logprobs, version_spans=[(version, 0, len(tokens))], reward=r,
                               finish_reason="stop") for r in rewards[:n]]
    return RolloutGroup.pack(samples, group_id=group_id, prompt_id=0, actor_id="actor-0", prompt_tokens=int32s(prompt),
                             eval_version=eval_version)


def take(learner, group) -> StepBatch:
    batch = StepBatch()
    learner.on_training_group(group, batch)
    return batch


def test_a_rollout_that_means_what_was_sent_out_is_admitted(learner):
    assert len(take(learner, rollout()).groups) == 1


@pytest.mark.parametrize("bad, reason", [
    (dict(tokens=(5, 14, 1)), "token_id"),  # beyond the vocabulary
    (dict(tokens=(5, -3, 1)), "token_id"),
    (dict(tokens=(5,) * 7, logprobs=(-0.1,) * 7), "length"),  # longer than max_tokens
    (dict(logprobs=(-0.5, 0.3, -0.1)), "logprob"),  # a probability above 1
    (dict(logprobs=(-0.5, -1e30, -0.1)), "logprob"),  # rho = inf, ESS NaN downstream
    (dict(version=VERSION + 1), "version"),  # from the future: never stale otherwise
    (dict(version=VERSION - 2), "version"),  # older than the group's min_version
    (dict(rewards=(1e30, 0.0)), "reward"),  # would shrink every other group's advantage to nothing
    (dict(prompt=(2, 3, 9)), "prompt"),  # a prompt that was never sent
    (dict(n=1), "sample_count"),
])
def test_poison_is_rejected_by_reason_and_frees_the_slot(learner, tmp_path, bad, reason):
    batch = take(learner, rollout(**bad))
    assert batch.groups == []
    assert learner.parts.validator.rejected == {reason: 1}
    assert learner.book.counts[f"discarded/invalid/{reason}"] == 1 and "r-0" not in learner.book.outstanding
    assert ("r-0", f"invalid/{reason}") in [(e["id"], e["reason"]) for e in read_ledger(tmp_path / "ledger.jsonl")
                                            if e["event"] == "discarded"]


def test_ids_never_released_are_rejected_and_copies_are_duplicates(learner):
    assert take(learner, rollout(group_id="r-999")).groups == []  # forged: never released
    assert learner.book.counts["rejected/unreleased"] == 1
    assert len(take(learner, rollout()).groups) == 1
    assert take(learner, rollout()).stats["duplicates"] == 1  # the same id again
    assert "r-999" not in learner.book.outstanding


def test_forged_eval_groups_change_no_evaluation(learner):
    learner.evaluator.start(VERSION)
    [eval_id] = learner.evals.expected[VERSION]
    learner.evaluator.on_group(rollout(group_id=eval_id, eval_version=VERSION + 3, rewards=(1.0, 1.0)), VERSION)
    learner.evaluator.on_group(rollout(group_id="r-eval-forged", eval_version=VERSION, rewards=(1.0, 1.0)), VERSION)
    assert learner.evals.results == {} and learner.evaluator.waiting()
    learner.evaluator.on_group(rollout(group_id=eval_id, eval_version=VERSION, logprobs=(0.5, 0.5, 0.5),
                                       version=VERSION, prompt=(2, 3, 4)), VERSION)
    assert learner.parts.validator.rejected["logprob"] == 1
    assert learner.evals.results == {} and not learner.evaluator.waiting()  # done, and no pass rate from poison


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
