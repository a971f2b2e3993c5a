"""Length control: the overlong penalty and the splicing of forced interruptions, against numbers
worked out by hand; the actor's request sequence on a scripted engine; one real-vLLM check that
the spliced sequence lines up with the model's own logprobs."""

import asyncio

import numpy as np
import pytest

from tidal.actor.engine import Completion
from tidal.actor.length_control import answer_prompt, generate, splice, think_budgets
from tidal.actor.sample import Transcript, overlong_penalty, to_sample
from tidal.broker.schema import InterruptParams, PromptGroup, RolloutGroup, SamplingParams, WireCodec, int32s
from tidal.config import Aggregation, ConfigError, load_config
from tidal.learner.every_rank.batch import aggregation_weights, build_rows

INTERRUPT = InterruptParams(tokens=(50, 51), text="<stop>", min_think_tokens=3, max_think_tokens=6, answer_tokens=4)
EOS = 1


def completion(tokens, logprobs, spans, text="", finish="stop") -> Completion:
    return Completion(np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32), list(spans), text, finish)


# ---- overlong penalty ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, expected",
    [
        # L_max = 16, L_cache = 4: free up to 16 - 4 = 12 tokens, then (12 - L) / 4
        (0, 0.0),
        (12, 0.0),
        (13, -0.25),
        (14, -0.5),
        (15, -0.75),
        (16, -1.0),
        (20, -1.0),
    ],
)
def test_overlong_penalty_by_hand(length, expected):
    assert overlong_penalty(length, max_tokens=16, buffer_tokens=4) == pytest.approx(expected)


def test_overlong_penalty_off_and_uneven_buffer():
    assert overlong_penalty(16, max_tokens=16, buffer_tokens=0) == 0.0
    # L_max = 10, L_cache = 3: free up to 7; L = 8 -> (7 - 8) / 3 = -1/3, L = 9 -> -2/3
    assert overlong_penalty(8, 10, 3) == pytest.approx(-1 / 3)
    assert overlong_penalty(9, 10, 3) == pytest.approx(-2 / 3)


def test_to_sample_shapes_reward_and_keeps_raw():
    c = completion([4] * 14, [-0.5] * 14, [(0, 0, 14)], finish="stop")
    shaped = to_sample(c, 1.0, SamplingParams(max_tokens=16, overlong_buffer_tokens=4)).sample
    assert shaped.reward == pytest.approx(0.5)  # 1 + (12 - 14) / 4
    assert shaped.raw_reward == 1.0 and shaped.task_reward == 1.0
    plain = to_sample(c, 1.0, SamplingParams(max_tokens=16)).sample
    assert plain.reward == 1.0 and plain.task_reward == 1.0
    wrong = to_sample(
        completion([4] * 16, [-0.5] * 16, [(0, 0, 16)], finish="length"),
        0.0,
        SamplingParams(max_tokens=16, overlong_buffer_tokens=4),
    ).sample
    assert (wrong.reward, wrong.task_reward, wrong.finish_reason) == (-1.0, 0.0, "length")


# ---- splicing ----------------------------------------------------------------------------------


def test_think_budgets_are_uniform_inclusive_and_reproducible():
    budgets = think_budgets("run-g7", 4000, INTERRUPT)
    assert set(budgets) == {3, 4, 5, 6}
    counts = np.bincount(budgets)[3:]
    assert counts.min() > 900 and counts.max() < 1100  # 1000 expected each
    assert think_budgets("run-g7", 8, INTERRUPT) == budgets[:8]
    assert think_budgets("run-g8", 32, INTERRUPT) != budgets[:32]


def test_answer_prompt_is_prompt_then_thinking_then_interruption():
    thinking = completion([21, 22, 23], [-1, -1, -1], [(0, 0, 3)], finish="length")
    assert answer_prompt([7, 8], thinking, INTERRUPT) == [7, 8, 21, 22, 23, 50, 51]


@pytest.mark.parametrize(
    "think, answer, expected",
    [
        # a swap during thinking (v0 -> v1) and another during the answer (v1 -> v2): the 2 injected
        # tokens at 3..5 take the last thinking version (1) and merge with its neighbours
        ([(0, 0, 2), (1, 2, 3)], [(1, 0, 1), (2, 1, 4)], [(0, 0, 2), (1, 2, 6), (2, 6, 9)]),
        # a swap between the two requests: thinking + injected at v0, the answer at v1
        ([(0, 0, 3)], [(1, 0, 4)], [(0, 0, 5), (1, 5, 9)]),
    ],
)
def test_transcript_spans(think, answer, expected):
    spans = (
        Transcript()
        .add_sampled(completion([7] * 3, [0.0] * 3, think, finish="length"))
        .add_injected([8, 8], "")
        .add_sampled(completion([9] * 4, [0.0] * 4, answer))
        .spans
    )
    assert spans == expected


@pytest.mark.parametrize("answer_finish, expected", [("stop", "interrupted"), ("length", "length")])
def test_splice_assembles_tokens_logprobs_and_masks(answer_finish, expected):
    thinking = completion([21, 22, 23], [-0.1, -0.2, -0.3], [(4, 0, 3)], "abc", finish="length")
    answer = completion([31, 32], [-0.4, -0.5], [(5, 0, 2)], "xy", finish=answer_finish)
    c = splice(thinking, INTERRUPT, answer)
    assert c.tokens.tolist() == [21, 22, 23, 50, 51, 31, 32]
    np.testing.assert_allclose(c.logprobs, [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5])
    assert c.version_spans == [(4, 0, 5), (5, 5, 7)]
    assert c.injected_spans == [(3, 5)]
    assert c.text == "abc<stop>xy"
    assert c.finish_reason == expected  # "length": ran out of the answer budget too, a truncation


class ThinkThenAnswerEngine:
    """Thinks 5 tokens then stops (unless the budget is smaller); answers [9, EOS]. Weights move from
    v3 to v4 between thinking and answering. Records every request."""

    def __init__(self):
        self.requests = []

    async def sample(self, prompt_tokens, n, params, request_id, max_tokens=None):
        self.requests.append((request_id, list(prompt_tokens), n, max_tokens))
        if request_id.endswith("-answer"):
            return [completion([9, EOS], [-0.7, -0.8], [(4, 0, 2)], "9")] * n
        length = min(5, max_tokens or params.max_tokens)
        return [
            completion(
                range(20, 20 + length),
                [-0.5] * length,
                [(3, 0, length)],
                "t" * length,
                "stop" if length == 5 else "length",
            )
            for _ in range(n)
        ]


def prompt_group(sampling: SamplingParams, n=8) -> PromptGroup:
    return PromptGroup(
        run_id="r",
        group_id="r-g1",
        prompt_id=1,
        prompt_tokens=int32s([7, 8]),
        task="arithmetic",
        payload={"answer": "9"},
        n=n,
        sampling=sampling,
        min_version=0,
    )


def test_generate_interrupts_only_samples_that_reach_their_budget():
    engine = ThinkThenAnswerEngine()
    group = prompt_group(SamplingParams(max_tokens=12, stop_token_ids=(EOS,), interrupt=INTERRUPT))
    completions = asyncio.run(generate(engine, group))
    budgets = think_budgets("r-g1", 8, INTERRUPT)
    assert 0 < sum(b < 5 for b in budgets) < 8  # this group id draws budgets on both sides of 5
    thinks = [r for r in engine.requests if not r[0].endswith("-answer")]
    assert [(r[0], r[2], r[3]) for r in thinks] == [(f"r-g1-s{i}", 1, b) for i, b in enumerate(budgets)]
    answers = {r[0]: r for r in engine.requests if r[0].endswith("-answer")}
    for i, (b, c) in enumerate(zip(budgets, completions)):
        if b >= 5:  # stopped by itself inside its budget
            assert (c.tokens.tolist(), c.finish_reason, c.injected_spans) == ([20, 21, 22, 23, 24], "stop", [])
            continue
        think = list(range(20, 20 + b))
        _, prompt, n, max_tokens = answers[f"r-g1-s{i}-answer"]
        assert (prompt, n, max_tokens) == ([7, 8, *think, 50, 51], 1, 4)
        assert c.tokens.tolist() == [*think, 50, 51, 9, EOS]
        assert c.injected_spans == [(b, b + 2)] and c.finish_reason == "interrupted"
        assert c.version_spans == [(3, 0, b + 2), (4, b + 2, b + 4)]
    assert len(answers) == sum(b < 5 for b in budgets)


def test_generate_without_interruptions_is_one_request():
    engine = ThinkThenAnswerEngine()
    completions = asyncio.run(generate(engine, prompt_group(SamplingParams(max_tokens=3), n=4)))
    assert engine.requests == [("r-g1", [7, 8], 4, None)]
    assert all(c.finish_reason == "length" and not c.injected_spans for c in completions)


def test_injected_tokens_cross_the_wire_and_never_train():
    interrupted = splice(
        completion([21, 22], [-0.1, -0.2], [(0, 0, 2)], finish="length"),
        INTERRUPT,
        completion([31], [-0.4], [(0, 0, 1)], finish="stop"),
    )
    plain = completion([21, 22, EOS], [-0.1, -0.2, -0.3], [(0, 0, 3)])
    params = SamplingParams(max_tokens=12, interrupt=INTERRUPT)
    group = RolloutGroup.pack(
        [to_sample(interrupted, 1.0, params), to_sample(plain, 0.0, params)],
        group_id="g",
        prompt_id=1,
        actor_id="a",
        prompt_tokens=int32s([7, 8]),
    )
    codec = WireCodec(1 << 20)
    back = codec.decode(codec.encode(group), expect=RolloutGroup)
    assert back.samples[0].injected_spans == [(2, 4)] and back.samples[0].finish_reason == "interrupted"
    masks = [[np.ones(s.num_tokens, bool) for s in back.samples]]
    # weights from the learner's masks count the injected tokens; build_rows zeroes them all the same
    weights = aggregation_weights(masks, Aggregation.token_mean)
    rows = build_rows([back], masks, [np.array([0.5, -0.5])], weights)
    assert rows[0].token_mask.tolist() == [True, True, False, False, True]
    assert rows[0].token_weight[2:4].tolist() == [0.0, 0.0] and rows[0].token_weight[0] > 0
    assert rows[0].input_ids.tolist() == [7, 8, 21, 22, 50, 51, 31]  # positions line up with the model's view
    assert rows[1].token_mask.all()


# ---- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["sampling.interrupt.enabled=true"], "sampling.interrupt.min_tokens"),
        (
            ["sampling.interrupt.enabled=true", "sampling.interrupt.min_tokens=4", "sampling.interrupt.max_tokens=3"],
            "sampling.interrupt.max_tokens",
        ),
        (
            ["sampling.interrupt.enabled=true", "sampling.interrupt.min_tokens=2", "sampling.interrupt.max_tokens=3"],
            "sampling.interrupt.answer_tokens",
        ),
        (
            [
                "sampling.interrupt.enabled=true",
                "sampling.interrupt.min_tokens=2",
                "sampling.interrupt.max_tokens=5",
                "sampling.interrupt.answer_tokens=3",
                "sampling.max_tokens=8",
            ],
            "sampling.interrupt.max_tokens",
        ),  # 5+3+text > 8
        (["sampling.overlong.enabled=true"], "sampling.overlong.buffer_tokens"),
        (
            ["sampling.overlong.enabled=true", "sampling.overlong.buffer_tokens=8", "sampling.max_tokens=8"],
            "sampling.overlong.buffer_tokens",
        ),
        (
            ["sampling.overlong.enabled=true", "sampling.overlong.buffer_tokens=2", "sampling.interrupt.enabled=true"],
            "sampling.overlong.enabled",
        ),
    ],
)
def test_bad_length_control_configs_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_length_control_defaults_off_and_valid_settings_load():
    cfg = load_config(None)
    assert not cfg.sampling.interrupt.enabled and not cfg.sampling.overlong.enabled
    cfg = load_config(
        None,
        [
            "sampling.max_tokens=64",
            "sampling.interrupt.enabled=true",
            "sampling.interrupt.min_tokens=16",
            "sampling.interrupt.max_tokens=32",
            "sampling.interrupt.answer_tokens=8",
        ],
    )
    assert (cfg.sampling.interrupt.min_tokens, cfg.sampling.interrupt.answer_tokens) == (16, 8)
    assert (
        load_config(
            None, ["sampling.overlong.enabled=true", "sampling.overlong.buffer_tokens=2"]
        ).sampling.overlong.buffer_tokens
        == 2
    )


def test_an_interruption_text_too_long_for_the_budget_stops_at_preflight(tmp_path):
    """Its token count needs the tokenizer: the learner used to find out after every process had started."""
    from conftest import ALPHABET, TINY
    from tidal.ops.preflight import preflight
    from tidal.tiny import build_tiny_model, save_model

    save_model(*build_tiny_model(TINY, ALPHABET, seed=0), tmp_path / "model")
    budget = [
        "sampling.max_tokens=8",
        "sampling.interrupt.enabled=true",
        "sampling.interrupt.min_tokens=1",
        "sampling.interrupt.max_tokens=4",
        "sampling.interrupt.answer_tokens=2",
        "task.num_val=4",
    ]
    cfg = load_config(
        "configs/tiny.yaml", [f"model.path={tmp_path / 'model'}", *budget, "sampling.interrupt.text=12"]
    )  # 4 + 2 tokens + 2 = 8: fits
    preflight(cfg)
    cfg = load_config(
        "configs/tiny.yaml", [f"model.path={tmp_path / 'model'}", *budget, "sampling.interrupt.text=123"]
    )  # 4 + 3 + 2 = 9 > 8
    with pytest.raises(
        ConfigError,
        match=r"config key 'sampling.interrupt': .* 3 interruption tokens .* = 9 > "
        r"max_tokens 8",
    ):
        preflight(cfg)
