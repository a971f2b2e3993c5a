"""Episodes of several turns on a scripted engine: the tokens the learner trains on are exactly those
sampled and injected, across turns and a tool call, for a byte-level BPE tokenizer with a ChatML
template that lists tools; tools and environments that fail, hang or flood are answered or scored
as failed and counted, never raised; budgets end episodes."""

import asyncio
import time

import numpy as np
import pytest

from tidal.actor.engine import Completion
from tidal.actor.episode import Episodes
from tidal.actor.sample import to_sample
from tidal.broker.schema import PromptGroup, RolloutGroup, SamplingParams, WireCodec, int32s
from tidal.config import EnvConfig
from tidal.tasks import ChatRenderer, Env, Prompt, PromptEncoder, SingleTurn, Turn, tool_schemas

# ChatML with tools, as Qwen-style models write it: tool schemas in the system turn, calls as
# <tool_call>{json}</tool_call> in the assistant's text, each tool's output in a <tool_response>
# block, consecutive ones sharing one user turn
CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL = ["<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE trained here, so that text has one canonical tokenization and others that
    decode to the same text (a model may sample either)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>',
        "What is 12 + 30 + 7? The answer is 49. Tools: add, multiply. tool_response user assistant system",
    ] * 50
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>")
    out.chat_template = CHATML_TOOLS
    return out


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def crash(x: int) -> int:
    """Raises.

    Args:
        x: anything
    """
    raise RuntimeError("the tool broke")


def flood(x: int) -> str:
    """Answers far too much.

    Args:
        x: anything
    """
    return "y" * 100_000


def hang(x: int) -> int:
    """Never answers in time.

    Args:
        x: anything
    """
    time.sleep(2)
    return x


class Sum(Env):
    """Sum the numbers of the prompt; the model may call `add`. One answer, scored, ends the episode."""

    def tools(self):
        return [add, crash, flood, hang]

    def step(self, state, reply):
        if reply.strip() == state["answer"]:
            return Turn(done=True, reward=1.0)
        return Turn([{"role": "user", "content": "Not yet; try again."}])


class ScriptedTurns:
    """An engine whose n-th request of each episode answers the n-th script line, tokenized by `encode`
    (the canonical tokenization unless a test gives another), stop token last. Every request's prompt
    tokens are kept, and the version it runs stamps each token."""

    def __init__(self, tokenizer, script, encode=None):
        self.tokenizer = tokenizer
        self.script = script
        self.encode = encode or (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
        self.prompts: list[list[int]] = []
        self.version = 0

    async def sample(self, prompt_tokens, n, params, request_id, max_tokens=None):
        await asyncio.sleep(0)
        self.prompts.append(list(prompt_tokens))
        turn = int(request_id.rsplit("-t", 1)[1]) if "-t" in request_id else 0
        text = self.script[turn]
        tokens = [*self.encode(text), self.tokenizer.eos_token_id]
        budget = max_tokens or params.max_tokens
        finish = "stop" if len(tokens) <= budget else "length"
        tokens = tokens[:budget]
        shown = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return [
            Completion(
                np.asarray(tokens, np.int32),
                np.full(len(tokens), -0.5, np.float32),
                [(self.version, 0, len(tokens))],
                shown,
                finish,
            )
            for _ in range(n)
        ]


def group(prompt_tokens, n=1, max_tokens=256, answer="49") -> PromptGroup:
    return PromptGroup(
        run_id="r",
        group_id="g0",
        prompt_id=0,
        prompt_tokens=int32s(prompt_tokens),
        task="sum",
        payload={"answer": answer},
        n=n,
        sampling=SamplingParams(max_tokens=max_tokens),
        min_version=0,
    )


def run(episodes, engine, g):
    return asyncio.run(episodes.run(engine, g))


def test_tokens_are_exact_across_turns_and_a_tool_call(tokenizer):
    env = Sum()
    prompt = PromptEncoder(tokenizer, chat_template=True, tools=tool_schemas(env.tools()))(
        Prompt(0, "What is 12 + 30 + 7?", {})
    )
    call = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
    engine = ScriptedTurns(tokenizer, [call, "The answer is 42.", "49"])
    episodes = Episodes(env, EnvConfig(), tokenizer, chat_template=True)
    [result] = run(episodes, engine, group(prompt))

    assert result.reward == 1.0 and result.episode.turns == 3 and result.episode.tool_calls == 1
    assert result.episode.tool_errors == 0
    # what the learner trains on is the whole conversation as the chat template renders it
    conversation = [
        {"role": "user", "content": "What is 12 + 30 + 7?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "The answer is 42."},
        {"role": "user", "content": "Not yet; try again."},
        {"role": "assistant", "content": "49"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tools=tool_schemas(env.tools()), tokenize=False)
    learner_sees = prompt + result.completion.tokens.tolist()
    assert learner_sees == tokenizer(rendered.rstrip("\n"), add_special_tokens=False)["input_ids"]
    # each request was exactly the prompt and every token so far
    assert engine.prompts[1] == learner_sees[: len(engine.prompts[1])]
    assert engine.prompts[2] == learner_sees[: len(engine.prompts[2])]
    # the model's tokens are trained on, the template's and the tool's are not
    sample = to_sample(result.completion, result.reward, SamplingParams(max_tokens=256), result.episode)
    mask = sample.sample.injected_mask()
    model_ids = [t for t, injected in zip(result.completion.tokens.tolist(), mask) if not injected]
    eos = tokenizer.eos_token_id
    assert model_ids == [*engine.encode(call), eos, *engine.encode("The answer is 42."), eos, *engine.encode("49"), eos]
    assert all(sample.logprobs[mask] == 0.0)
    assert [m["role"] for m in result.messages] == ["assistant", "tool", "assistant", "user", "assistant"]


def test_a_sampled_tokenization_that_is_not_canonical_is_kept_as_sampled(tokenizer):
    """A model may sample text in pieces the tokenizer would merge: decoding and encoding again would
    train on tokens the model never sampled, with the wrong logprobs."""

    def one_byte_each(text):
        return [
            tokenizer.convert_tokens_to_ids(ch)
            for ch in tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])
            for ch in ch
        ]

    prompt = PromptEncoder(tokenizer, chat_template=True)(Prompt(0, "What is 12 + 30 + 7?", {}))
    engine = ScriptedTurns(tokenizer, ["The answer is 42.", "49"], encode=one_byte_each)
    [result] = run(Episodes(Sum(), EnvConfig(), tokenizer, chat_template=True), engine, group(prompt))
    first = one_byte_each("The answer is 42.")
    assert first != tokenizer("The answer is 42.", add_special_tokens=False)["input_ids"]  # not canonical
    assert result.completion.tokens.tolist()[: len(first)] == first
    assert engine.prompts[1][len(prompt) : len(prompt) + len(first)] == first  # the next turn reads them too


def test_single_turn_tasks_are_the_one_turn_case(tokenizer):
    prompt = tokenizer("12+30=", add_special_tokens=False)["input_ids"]
    engine = ScriptedTurns(tokenizer, ["42"])
    episodes = Episodes(
        SingleTurn(lambda text, payload: float(text == payload["answer"])), EnvConfig(), tokenizer, chat_template=False
    )
    results = run(episodes, engine, group(prompt, n=3, answer="42"))
    assert [r.reward for r in results] == [1.0] * 3 and all(r.episode is None for r in results)
    assert len(engine.prompts) == 1  # the group's samples in one request, as before episodes


class Graded(Env):
    """An environment that names its reward's parts, as task.reward_funcs do; and one whose parts are broken."""

    max_turns = 1

    def __init__(self, parts):
        super().__init__()
        self.parts = parts

    def step(self, state, reply):
        self.reply = (str(reply), list(reply.token_ids), reply.prompt)
        return Turn(done=True, reward=1.5, components=self.parts)


def test_any_environment_can_name_its_rewards_parts_and_they_reach_the_sample(tokenizer):
    prompt = tokenizer("12+30=", add_special_tokens=False)["input_ids"]
    env, engine = Graded({"exact": 1.0, "format": 0.5}), ScriptedTurns(tokenizer, ["42"])
    [result] = run(Episodes(env, EnvConfig(), tokenizer, chat_template=False), engine, group(prompt))
    # a reply is the turn's text, with the token ids it was sampled as and the prompt as the model read it
    assert env.reply == ("42", [*engine.encode("42"), tokenizer.eos_token_id], "12+30=")
    assert result.reward == 1.5 and result.components == {"exact": 1.0, "format": 0.5}
    assert result.sample(SamplingParams(max_tokens=256)).sample.reward_components == {"exact": 1.0, "format": 0.5}
    for broken, why in (
        ([1.0], "not a dict"),
        ({"exact": "high"}, "could not convert"),
        ({"exact": float("nan")}, "'exact' is not finite"),
    ):
        episodes = Episodes(Graded(broken), EnvConfig(), tokenizer, chat_template=False)
        [result] = run(episodes, ScriptedTurns(tokenizer, ["42"]), group(prompt))
        assert result.reward == 0.0 and why in result.episode.env_error and result.components == {}


def test_failing_tools_are_answered_and_counted(tokenizer, caplog):
    calls = "".join(
        f'<tool_call>{{"name": "{name}", "arguments": {{"x": 1}}}}</tool_call>'
        for name in ("crash", "flood", "hang", "nope")
    )
    prompt = PromptEncoder(tokenizer, chat_template=True)(Prompt(0, "go", {}))
    engine = ScriptedTurns(tokenizer, [calls + '<tool_call>{"name": "add", "arguments": "1"}</tool_call>', "49"])
    cfg = EnvConfig(tool_timeout_s=0.2, tool_output_chars=50, max_tool_calls=4)
    [result] = run(Episodes(Sum(), cfg, tokenizer, chat_template=True), engine, group(prompt, max_tokens=1024))
    outputs = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert outputs[0] == "error: RuntimeError: the tool broke"
    # the model reads the tool's error; the actor's log says where the user's tool raised it
    [logged] = [r.getMessage() for r in caplog.records if r.name == "tidal.actor.tools"]
    assert logged == (
        f'tool crash raised RuntimeError: the tool broke (1 time so far)\n  File "{__file__}", '
        f'line {line_of("the tool broke")}, in crash\n    raise RuntimeError("the tool broke")'
    )
    assert outputs[1] == "y" * 50 + "\n[cut: 99950 more characters]"
    assert outputs[2] == "error: hang took longer than 0.2 s"
    assert outputs[3].startswith("error: no tool named 'nope'")
    assert outputs[4] == "error: more than 4 tool calls in one turn"
    e = result.episode
    assert (e.tool_calls, e.tool_errors, e.tool_timeouts, result.reward) == (5, 3, 1, 1.0)


def test_a_garbled_tool_call_is_answered_with_an_error(tokenizer):
    prompt = PromptEncoder(tokenizer, chat_template=True)(Prompt(0, "go", {}))
    engine = ScriptedTurns(tokenizer, ['<tool_call>{"name": add', "49"])
    [result] = run(Episodes(Sum(), EnvConfig(), tokenizer, chat_template=True), engine, group(prompt))
    assert result.messages[1]["content"] == "error: the tool call could not be read"
    assert (result.episode.tool_calls, result.episode.tool_errors, result.reward) == (1, 1, 1.0)


def line_of(text: str, source: str | None = None) -> int:
    """The line of this file (or of `source`) that holds `text`."""
    lines = (source or open(__file__).read()).splitlines()
    return next(i for i, line in enumerate(lines, start=1) if text in line and "line_of(" not in line)


class Broken(Env):
    def __init__(self, how):
        super().__init__()
        self.how = how

    async def step(self, state, reply):
        if self.how == "raises":
            raise KeyError("answer")
        if self.how == "hangs":
            await asyncio.sleep(5)
        return "not a turn"


@pytest.mark.parametrize(
    "how, error",
    [
        (
            "raises",
            f"Broken.step raised KeyError: 'answer'\n  File \"{__file__}\", line {line_of('raise KeyError')}, "
            'in step\n    raise KeyError("answer")',
        ),  # the user's method, file and line
        ("hangs", "Broken.step took longer than env.step_timeout_s = 0.2 s"),
        ("returns", "Broken.step returned str, not a Turn"),
    ],
)
def test_an_environment_that_fails_scores_its_episode_as_failed(tokenizer, how, error):
    engine = ScriptedTurns(tokenizer, ["49"])
    [result] = run(
        Episodes(Broken(how), EnvConfig(step_timeout_s=0.2), tokenizer, chat_template=False), engine, group([5, 6])
    )
    assert result.reward == 0.0 and result.episode.env_error == error
    assert result.completion.tokens.tolist() == [*engine.encode("49"), tokenizer.eos_token_id]


def test_budgets_end_episodes(tokenizer):
    prompt = PromptEncoder(tokenizer, chat_template=True)(Prompt(0, "go", {}))
    wrong = ["12"] * 10
    [by_turns] = run(
        Episodes(Sum(), EnvConfig(max_turns=3), tokenizer, chat_template=True),
        ScriptedTurns(tokenizer, wrong),
        group(prompt),
    )
    assert by_turns.episode.turns == 3 and by_turns.reward == 0.0
    [by_tokens] = run(
        Episodes(Sum(), EnvConfig(), tokenizer, chat_template=True),
        ScriptedTurns(tokenizer, wrong),
        group(prompt, max_tokens=20),
    )
    assert by_tokens.completion.finish_reason == "length" and len(by_tokens.completion.tokens) <= 20
    assert by_tokens.episode.turns < 10


def test_a_weight_update_between_turns_is_in_the_version_spans(tokenizer):
    prompt = PromptEncoder(tokenizer, chat_template=True)(Prompt(0, "go", {}))
    engine = ScriptedTurns(tokenizer, ["12", "49"])

    async def update_after_first_turn():
        episodes = Episodes(Sum(), EnvConfig(), tokenizer, chat_template=True)
        original = engine.sample

        async def sample(*args, **kwargs):
            out = await original(*args, **kwargs)
            engine.version += 1  # the next request runs newer weights
            return out

        engine.sample = sample
        return await episodes.run(engine, group(prompt))

    [result] = asyncio.run(update_after_first_turn())
    c = result.completion
    first_turn = len(engine.encode("12")) + 1
    ((start, end),) = c.injected_spans
    assert start == first_turn
    assert c.version_spans == [(0, 0, end), (1, end, len(c.tokens))]  # injected tokens take the turn's version
    codec = WireCodec(1 << 20)
    wire = RolloutGroup.pack(
        [to_sample(c, result.reward, SamplingParams(max_tokens=256), result.episode)],
        group_id="g0",
        prompt_id=0,
        actor_id="a",
        prompt_tokens=int32s(prompt),
    )
    back = codec.decode(codec.encode(wire))
    assert back.samples[0].episode == result.episode and back.samples[0].injected_spans == [(start, end)]


def test_the_renderer_closes_a_turn_cut_short(tokenizer):
    """A turn that ran out of tokens has no stop token: its end-of-turn text is added with the reply."""
    renderer = ChatRenderer(tokenizer, chat_template=True)
    stopped = tokenizer.decode(renderer.increment([{"role": "user", "content": "hi"}], "<|im_end|>"))
    cut = tokenizer.decode(renderer.increment([{"role": "user", "content": "hi"}], None))
    assert stopped == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert cut == "<|im_end|>" + stopped


def test_the_learner_counts_episodes_and_tables_their_turns(tokenizer, tmp_path):
    from collections import Counter

    from tidal.learner.rank0.accounting import episode_metrics
    from tidal.learner.rank0.admission import count
    from tidal.learner.rank0.diagnostics import Diagnostics

    env = Sum()
    prompt = PromptEncoder(tokenizer, chat_template=True, tools=tool_schemas(env.tools()))(Prompt(0, "go", {}))
    call = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
    results = run(
        Episodes(env, EnvConfig(), tokenizer, chat_template=True),
        ScriptedTurns(tokenizer, [call, "49"]),
        group(prompt, n=2),
    )
    wire = RolloutGroup.pack(
        [to_sample(r.completion, r.reward, SamplingParams(max_tokens=256), r.episode) for r in results],
        group_id="g0",
        prompt_id=0,
        actor_id="a",
        prompt_tokens=int32s(prompt),
        eval_version=3,
    )
    stats = Counter()
    count(wire, stats)
    metrics = episode_metrics(stats)
    assert metrics["episode/turns_mean"] == 2 and metrics["episode/tool_calls_mean"] == 1
    assert metrics["episode/tool_error_rate"] == 0 and metrics["episode/env_failed_frac"] == 0
    assert stats["injected_tokens"] == 2 * (wire.samples[0].injected_spans[0][1] - wire.samples[0].injected_spans[0][0])
    logged = {}
    tracker = type("Tracker", (), {"log_table": lambda self, columns, name: logged.update(columns)})()
    diagnostics = Diagnostics(tracker, lambda ids: tokenizer.decode(ids.tolist()), tmp_path, 2, max_lag=1)
    diagnostics.expect_eval(3, ["g0"], n=2)
    diagnostics.on_eval_group(wire, arrived_at=3)
    diagnostics.eval_done(3)
    conversation = logged["conversation"][0]
    assert [p["by"] for p in conversation] == ["model", "environment", "model"]
    assert conversation[0]["text"] == call + "<|im_end|>" and conversation[0]["versions"] == [0]
    assert "<tool_response>\n42\n</tool_response>" in conversation[1]["text"]
    assert logged["turns"] == [2, 2] and logged["tool_calls"] == [1, 1]


def test_the_chain_tasks_teacher_writes_the_episodes_the_actor_runs():
    """The warm start trains on demonstrations rendered as the actor renders real episodes: replayed
    through the actor's episode loop (the pythonic parser, the lookup tool, the task's template), a
    clean demonstration earns 1.0 with the very tokens the warm start trained on; the lengths are
    geometric and capped."""
    import random

    from conftest import TINY
    from tidal.config import TaskConfig
    from tidal.learner.tools.warmstart import Teacher
    from tidal.tasks import chain, get_environment
    from tidal.tiny import build_tiny_model

    task = TaskConfig(name="chain", chat_template=True, num_val=8)
    _, tok = build_tiny_model(
        TINY, chain.ALPHABET, seed=0, positions=chain.MAX_POSITIONS, chat_template=chain.CHAT_TEMPLATE
    )
    teacher = Teacher(tok, task, chain.demonstration)
    lengths = [len(chain.walk(k, 0)) for k in chain.KEYS]
    assert max(lengths) <= chain.MAX_LINKS and sorted(lengths)[len(lengths) // 2] <= 2 and max(lengths) >= 8
    split = chain.load_prompts(task)
    episodes = Episodes(
        get_environment(task), EnvConfig(tool_parser="pythonic", max_turns=chain.MAX_LINKS + 1), tok, chat_template=True
    )
    longest = max(split.train, key=lambda p: len(chain.walk(int(p.text), 0)))
    for prompt in [*split.val[:4], longest]:
        prompt_ids, completion, trained = teacher(prompt, random.Random(0), sloppy=False)
        turns = [
            m["content"] for m in chain.demonstration(prompt, task, random.Random(0), False) if m["role"] == "assistant"
        ]
        [result] = run(
            episodes, ScriptedTurns(tok, turns), group(prompt_ids, max_tokens=240, answer=prompt.payload["answer"])
        )
        assert result.reward == 1.0 and result.episode.tool_calls == len(turns) - 1
        assert result.completion.tokens.tolist() == completion
        injected = np.zeros(len(completion), bool)
        for start, end in result.completion.injected_spans:
            injected[start:end] = True
        assert (~injected).tolist() == trained


def test_a_skyrl_gym_environment_trains_unchanged(tokenizer, tmp_path):
    """skyrl-gym's own gsm8k_multi_turn environment, from rows in skyrl-gym's dataset format: its
    observations are rendered as the next turn's prompt, its turn-level rewards summed, and its done
    ends the episode."""
    import json

    from tidal.config import TaskConfig
    from tidal.tasks import get_task

    rows = [
        {
            "prompt": [{"role": "user", "content": f"Natalia sold {n} clips, then half as many. How many?"}],
            "env_class": "gsm8k_multi_turn",
            "reward_spec": {"method": "rule", "ground_truth": str(n + n // 2)},
            "extra_info": {"split": "train"},
        }
        for n in (48, 50, 52, 54)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = TaskConfig(
        name="skyrl", data_path=str(tmp_path / "train.jsonl"), prompt_field="prompt", num_val=1, chat_template=True
    )
    env = EnvConfig(kwargs={"max_turns": 3})
    split = get_task("skyrl").load_prompts(task)
    assert (len(split.train), len(split.val)) == (3, 1)
    prompt = next(p for p in split.train if "48" in p.messages[0]["content"])
    prompt_ids = PromptEncoder.for_task(tokenizer, task, env.kwargs)(prompt)
    engine = ScriptedTurns(tokenizer, ["48 + 24 = 70.\n#### 70", "48 + 24 = 72.\n#### 72"])
    episodes = Episodes.of(task, env, tokenizer)
    g = PromptGroup(
        run_id="r",
        group_id="g0",
        prompt_id=prompt.prompt_id,
        prompt_tokens=int32s(prompt_ids),
        task="skyrl",
        payload=prompt.payload,
        n=1,
        sampling=SamplingParams(max_tokens=512),
        min_version=0,
    )
    [result] = run(episodes, engine, g)
    assert result.episode.turns == 2 and result.episode.env_error == ""
    assert result.reward == pytest.approx(0.2 / 3 + 1.0)  # a well-formatted wrong answer, then the right one
    assert result.messages[1]["role"] == "user" and "#### ANSWER" in result.messages[1]["content"]
    injected = tokenizer.decode(result.completion.tokens[slice(*result.completion.injected_spans[0])].tolist())
    assert result.messages[1]["content"] in injected


class Garbage(Env):
    async def step(self, state, reply):
        return Turn([{"role": "user", "content": None}, "not a message"])


def test_messages_the_template_cannot_render_fail_the_episode_not_the_actor(tokenizer):
    prompt = PromptEncoder(tokenizer, chat_template=True)(Prompt(0, "go", {}))
    [result] = run(
        Episodes(Garbage(), EnvConfig(), tokenizer, chat_template=True), ScriptedTurns(tokenizer, ["1"]), group(prompt)
    )
    assert result.reward == 0.0
    assert (
        result.episode.env_error == 'Garbage.step\'s messages: message 0 is not {"role": str, "content": str}: '
        "{'role': 'user', 'content': None}"
    )


def test_a_groups_plain_steps_share_one_thread_hop_and_a_hung_one_holds_only_those_after_it(tokenizer):
    import threading

    threads, calls = set(), []

    def reward(text, payload):
        threads.add(threading.get_ident())
        calls.append(text)
        if len(calls) == 2:
            time.sleep(0.6)  # the group's second episode hangs past its timeout
        return 1.0

    engine = ScriptedTurns(tokenizer, ["42"])
    results = run(
        Episodes(SingleTurn(reward), EnvConfig(step_timeout_s=0.3), tokenizer, chat_template=False),
        engine,
        group([5, 6], n=4),
    )
    assert len(threads) == 1 and threading.get_ident() not in threads  # one worker thread, not the loop's
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 0.0]
    assert all(r.episode.env_error.startswith("SingleTurn.step took longer") for r in results[1:])


LOOKUP_ENVS = """
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.envs.registration import register


class LookupEnv(BaseTextEnv):
    def __init__(self, env_config=None, extras={}):
        super().__init__()
        self.table = {1: "one"}

    def step(self, action):
        return BaseTextEnvStepOutput(observations=[], reward=float(self.table[int(action)] == "one"), done=True,
                                     metadata={})


register(id="tidal_test_lookup", entry_point=LookupEnv)
"""


def test_a_skyrl_gym_environments_error_names_the_users_class_and_line_and_its_messages(
    tokenizer, tmp_path, monkeypatch
):
    """Named after the user's LookupEnv, not tidal's adapter (Environment); the end-of-run summary counts the
    failures as one kind at that line, and shows two of their messages rather than one standing for all."""
    import json
    import sys
    from types import SimpleNamespace

    from tidal.config import StalenessConfig, TaskConfig
    from tidal.learner.rank0.admission import Admission
    from tidal.tasks import get_task

    (tmp_path / "lookup_envs.py").write_text(LOOKUP_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lookup_envs", raising=False)
    rows = [{"prompt": [{"role": "user", "content": "look it up"}], "env_class": "tidal_test_lookup"}] * 3
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = TaskConfig(name="skyrl", data_path=str(tmp_path / "train.jsonl"), prompt_field="prompt", num_val=1)
    episodes = Episodes.of(task, EnvConfig(kwargs={"imports": ["lookup_envs"]}), tokenizer)
    payload = get_task("skyrl").load_prompts(task).train[0].payload
    errors = []
    for key in ("39", "5207", "39"):
        [result] = run(
            episodes,
            ScriptedTurns(tokenizer, [key]),
            PromptGroup(
                run_id="r",
                group_id="g0",
                prompt_id=0,
                prompt_tokens=int32s([5, 6]),
                task="skyrl",
                payload=payload,
                n=1,
                sampling=SamplingParams(),
                min_version=0,
            ),
        )
        errors.append(result.episode.env_error)
    where = (
        f'  File "{tmp_path / "lookup_envs.py"}", line {line_of("self.table[int", LOOKUP_ENVS)}, in step\n'
        '    return BaseTextEnvStepOutput(observations=[], reward=float(self.table[int(action)] == "one"), '
        "done=True,"
    )
    assert errors[0] == f"LookupEnv.step raised KeyError: 39\n{where}"
    admission = Admission(StalenessConfig(), True, None, on_rewards=lambda *_: None)
    admission._note_failures(
        SimpleNamespace(samples=[SimpleNamespace(episode=SimpleNamespace(env_error=e)) for e in errors])
    )
    assert admission.failure_summary() == {
        "count": 3,
        "reasons": [(f"LookupEnv.step raised KeyError with different messages, e.g. '39' and '5207'\n{where}", 3)],
    }
