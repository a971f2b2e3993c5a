"""Reward functions as users write them (task.reward_funcs, task.reward_weights): loading, the keyword
arguments they get, weighted sums and components, their metrics, `config check` scoring a few rows, and
a two-function reward through the whole pipeline in one process."""

import asyncio
import json
import logging
import math
import sys
import threading
from collections import Counter

import numpy as np
import pytest

from conftest import ALPHABET, TINY, ScriptedEngine, sample
from tidal.broker.schema import RolloutGroup, int32s
from tidal.config import ConfigError, load_config
from tidal.learner.rank0.accounting import reward_component_metrics
from tidal.learner.rank0.admission import count
from tidal.tasks import get_environment, get_task
from tidal.tasks.rewards import (
    PROMPT_TEXT,
    Rewarded,
    RewardFailed,
    call_kwargs,
    decode_row,
    encode_row,
    load_reward_funcs,
    score,
)

REWARDS = """
import asyncio


def exact(completion, answer, **kwargs):
    return 1.0 if completion == answer else 0.0


async def short(completion_ids, prompt, problem, **kwargs):
    await asyncio.sleep(0)
    assert problem in prompt  # the prompt as the model read it holds the row's prompt column
    return 1.0 if len(completion_ids) <= 4 else 0.0


def seen(**kwargs):
    return float(len(kwargs["tags"]))  # a list column arrives as a list


def broken(completion, **kwargs):
    return kwargs["answr"]  # a typo: raises KeyError on every sample


CALLS = []


def accuracy(prompts, completions, completion_ids, answer, **kwargs):  # written for TRL: lists in, list out
    CALLS.append(len(completions))
    assert len(prompts) == len(completion_ids) == len(answer)
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


async def digits(completions, **kwargs):
    return [float(c.isdigit()) if c else None for c in completions]  # None: does not apply to an empty one


def one_short(completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def picky(completion, answer, **kwargs):
    if completion != answer:
        raise ValueError("not a number I can read")  # a reward that fails on wrong answers
    return 1.0


def fails_in_batch(completions, **kwargs):
    return [1.0 / len(c) for c in completions]  # ZeroDivisionError on an empty completion
"""


def line_of(text: str) -> int:
    """The line of my_rewards.py that holds `text`."""
    return next(i for i, line in enumerate(REWARDS.splitlines(), start=1) if text in line)


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # each test imports its own copy
    return tmp_path / "my_rewards.py"


def task(*overrides):
    return load_config(None, list(overrides)).task


# ---- loading -------------------------------------------------------------------------------


def test_functions_load_by_either_import_path_with_weights_defaulting_to_one(user_rewards):
    funcs = load_reward_funcs(task("task.reward_funcs=[my_rewards:exact,my_rewards.short]"))
    assert [(f.name, f.weight) for f in funcs] == [("exact", 1.0), ("short", 1.0)]
    weighted = load_reward_funcs(
        task("task.reward_funcs=[my_rewards:exact,my_rewards.short]", "task.reward_weights=[2,0.5]")
    )
    assert [f.weight for f in weighted] == [2.0, 0.5]


@pytest.mark.parametrize(
    "spec, words",
    [
        ("my_rewards:nope", "my_rewards has no 'nope'"),
        ("no_such_pkg.mod:f", "cannot import no_such_pkg.mod"),
        ("justaname", "not an import path"),
    ],
)
def test_an_unknown_function_is_one_line_naming_the_key(user_rewards, spec, words):
    with pytest.raises(ConfigError, match="task.reward_funcs") as err:
        load_reward_funcs(task(f"task.reward_funcs=[{spec}]"))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_weights_of_the_wrong_length_fail_at_load():
    with pytest.raises(ConfigError, match=r"'task.reward_weights' = \[1.0\]: one weight per reward function \(2"):
        load_config(None, ["task.reward_funcs=[a:b,c:d]", "task.reward_weights=[1]"])


def test_a_task_of_episodes_refuses_reward_functions(user_rewards):
    cfg = task("task.name=skyrl", "task.reward_funcs=[my_rewards:exact]")
    with pytest.raises(ConfigError, match="task.reward_funcs"):
        get_environment(cfg)


def test_a_function_named_by_its_file_loads_from_any_working_folder(user_rewards, tmp_path, monkeypatch):
    """verl's way: `./my_rewards.py:exact` and `my_rewards.py:exact` are made absolute at load, so the
    processes a run starts (and a config.yaml read from another folder) find the same file."""
    monkeypatch.chdir(tmp_path)
    cfg = task("task.reward_funcs=[./my_rewards.py:exact,my_rewards.py:short]")
    assert list(cfg.reward_funcs) == [f"{user_rewards}:exact", f"{user_rewards}:short"]
    monkeypatch.chdir("/")
    assert [f.name for f in load_reward_funcs(cfg)] == ["exact", "short"]


def test_the_working_folder_is_importable_as_python_m_makes_it(tmp_path, monkeypatch):
    (tmp_path / "here_rewards.py").write_text("def exact(completion, answer, **kwargs):\n    return 1.0\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "here_rewards", raising=False)
    monkeypatch.chdir(tmp_path)
    assert [f.name for f in load_reward_funcs(task("task.reward_funcs=[here_rewards:exact]"))] == ["exact"]


@pytest.mark.parametrize(
    "source, says",
    [
        ("def accuracy(completion, **kwargs)\n    return 1.0\n", "{file}:1: expected ':' (a syntax error)"),
        (
            "import no_such_dependency\n",
            "importing {name} raised ModuleNotFoundError: No module named 'no_such_dependency'",
        ),
    ],
)
def test_a_reward_file_that_does_not_import_is_one_line_at_its_line(tmp_path, source, says):
    (tmp_path / "broken_rewards.py").write_text(source)
    with pytest.raises(ConfigError) as err:
        load_reward_funcs(task(f"task.reward_funcs=[{tmp_path / 'broken_rewards.py'}:accuracy]"))
    first = str(err.value).splitlines()[0]
    assert first.startswith("config key 'task.reward_funcs' entry ")
    assert first.endswith(says.format(file=tmp_path / "broken_rewards.py", name=tmp_path / "broken_rewards.py"))
    assert "Traceback" not in str(err.value)


# ---- rows and calls -----------------------------------------------------------------------


def test_a_row_travels_as_strings_and_comes_back_with_its_types():
    row = {"problem": "1+2=", "answer": "3", "tags": ["easy", "sum"], "level": 2, "meta": {"k": None}}
    payload = encode_row(row)
    assert all(isinstance(v, str) for v in payload.values())
    assert decode_row({**payload, PROMPT_TEXT: "x"}) == row


def test_calls_get_prompt_completion_ids_and_every_column():
    payload = {
        **encode_row({"problem": "1+2=", "answer": "3", "prompt": "a column named prompt"}),
        PROMPT_TEXT: "Q: 1+2=",
    }
    kwargs = call_kwargs(payload, "problem", "3", np.array([7, 8]).tolist())
    assert kwargs == {
        "problem": "1+2=",
        "answer": "3",
        "prompt": "Q: 1+2=",
        "completion": "3",
        "completion_ids": [7, 8],
    }
    messages = [{"role": "user", "content": "1+2="}]
    assert call_kwargs(encode_row({"messages": messages}), "messages", "3", [])["prompt"] == messages


def test_the_reward_is_the_weighted_sum_and_each_value_a_component(user_rewards):
    env = Rewarded(task("task.reward_funcs=[my_rewards:exact,my_rewards:short]", "task.reward_weights=[1,-0.5]"))
    state = {**encode_row({"problem": "1+2=", "answer": "3"}), PROMPT_TEXT: "1+2="}
    assert asyncio.run(env.score(state, "3", [5])) == (0.5, {"exact": 1.0, "short": 1.0})
    assert asyncio.run(env.score(state, "4", [5] * 5)) == (0.0, {"exact": 0.0, "short": 0.0})


def test_a_raising_function_names_itself_and_the_users_line(user_rewards):
    funcs = load_reward_funcs(task("task.reward_funcs=[my_rewards:broken]"))
    with pytest.raises(RewardFailed) as err:
        asyncio.run(score(funcs, {"completion": "3"}))
    text = str(err.value)
    assert text.startswith("reward function broken raised KeyError: 'answr'")
    assert f'File "{user_rewards}", line 20, in broken' in text and "asyncio" not in text


SIGNATURES = """
def no_kwargs(completion, solution):
    return 1.0


def missing_column(completion, ground_truth, **kwargs):
    return 1.0


def plural_typo(completions, answers, **kwargs):
    return [1.0] * len(completions)


def strict(completion, answer):
    return 1.0
"""


@pytest.fixture
def signatures(tmp_path):
    (tmp_path / "signatures.py").write_text(SIGNATURES)
    return tmp_path / "signatures.py"


def def_of(path, name: str) -> str:
    line = next(i for i, text in enumerate(SIGNATURES.splitlines(), 1) if text.startswith(f"def {name}("))
    return f'  File "{path}", line {line}, in {name}'


@pytest.mark.parametrize(
    "name, says",
    [
        (
            "no_kwargs",
            "reward function no_kwargs(completion, solution) asks for 'solution', which the rows lack "
            "(columns: problem, answer, tags, prompt); add **kwargs: it is passed the row's columns problem, "
            "answer, tags, prompt and completion_ids",
        ),
        (
            "missing_column",
            "reward function missing_column(completion, ground_truth, **kwargs) asks for 'ground_truth', "
            "which the rows lack (columns: problem, answer, tags, prompt)",
        ),
        (
            "plural_typo",
            "reward function plural_typo(completions, answers, **kwargs) asks for 'answers', which the rows "
            "lack (columns: problem, answer, tags, prompt, each passed as a list); did you mean 'answer'?",
        ),
        (
            "strict",
            "reward function strict(completion, answer): add **kwargs: it is passed the row's columns problem, "
            "tags, prompt and completion_ids",
        ),
    ],
)
def test_a_signature_that_does_not_fit_the_row_is_reported_at_its_def(signatures, name, says):
    """Was Python's TypeError at concurrent/futures/thread.py, line 58, naming neither the def nor the columns."""
    env = Rewarded(task(f"task.reward_funcs=[{signatures}:{name}]"))
    state = {**encode_row({"problem": "1+2=", "answer": "3", "tags": ["sum"]}), PROMPT_TEXT: "1+2="}
    with pytest.raises(RewardFailed) as err:
        asyncio.run(env.score(state, "3", [5]))
    assert str(err.value).splitlines()[:2] == [says, def_of(signatures, name)]
    assert "thread.py" not in str(err.value)


@pytest.mark.parametrize("value", ["three", float("nan"), [1.0]])
def test_a_function_returning_no_number_fails_naming_it(value):
    from tidal.tasks.rewards import RewardFunc

    with pytest.raises(RewardFailed, match="reward function f returned"):
        asyncio.run(score([RewardFunc("f", lambda **kw: value, 1.0)], {}))


def test_a_function_answering_none_does_not_apply_to_that_sample():
    from tidal.tasks.rewards import RewardFunc

    funcs = [RewardFunc("always", lambda **kw: 1.0, 1.0), RewardFunc("never", lambda **kw: None, 5.0)]
    assert asyncio.run(score(funcs, {})) == (1.0, {"always": 1.0})


# ---- functions written for batches --------------------------------------------------------


def test_a_function_taking_lists_scores_a_whole_group_in_one_call(user_rewards):
    import my_rewards

    env = Rewarded(task("task.reward_funcs=[my_rewards:accuracy,my_rewards:digits]", "task.reward_weights=[1,0.5]"))
    assert score_group(env, ["3", "x", ""]) == [
        (1.5, {"accuracy": 1.0, "digits": 1.0}),
        (0.0, {"accuracy": 0.0, "digits": 0.0}),
        (0.0, {"accuracy": 0.0}),
    ]  # digits does not apply to ""
    assert my_rewards.CALLS == [3]


def test_groups_scored_in_the_same_pass_get_a_call_each_so_an_error_fails_its_own_group(user_rewards):
    """Groups finishing together are not one batch: a completion that breaks the function fails its group only."""
    env = Rewarded(task("task.reward_funcs=[my_rewards:fails_in_batch]"))

    async def two_groups():
        def state(problem):
            return {**encode_row({"problem": problem, "answer": "3"}), PROMPT_TEXT: problem}

        calls = [env.score(state("1+2="), c, [1]) for c in ["1", "22"]]
        calls += [env.score(state("2+1="), c, [1]) for c in ["3", ""]]  # "" raises ZeroDivisionError
        return await asyncio.gather(*calls, return_exceptions=True)

    first, second, third, fourth = asyncio.run(two_groups())
    assert (first, second) == ((1.0, {"fails_in_batch": 1.0}), (0.5, {"fails_in_batch": 0.5}))
    assert isinstance(third, RewardFailed) and isinstance(fourth, RewardFailed)


def test_a_batch_function_with_the_wrong_count_or_an_error_names_itself(user_rewards):
    env = Rewarded(task("task.reward_funcs=[my_rewards:one_short]"))
    with pytest.raises(RewardFailed, match=r"one_short takes lists .* returned 2 values for 3 samples"):
        score_group(env, ["1", "2", "3"])
    env = Rewarded(task("task.reward_funcs=[my_rewards:fails_in_batch]"))
    with pytest.raises(RewardFailed) as err:
        score_group(env, ["1", ""])
    assert str(err.value).startswith("reward function fails_in_batch raised ZeroDivisionError")
    assert f'File "{user_rewards}", line {line_of("1.0 / len(c)")}' in str(err.value)  # the user's, not tidal's


# ---- the rows task ------------------------------------------------------------------------


def write_rows(tmp_path, n=12):
    rows = [
        {"problem": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}", "tags": ["sum"] * (a % 3)}
        for a in range(20, 20 + n // 2)
        for b in range(2)
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "rows.jsonl"


def test_the_rows_task_carries_every_column_to_the_reward(tmp_path, user_rewards):
    cfg = task(
        "task.name=rows",
        f"task.data_path={write_rows(tmp_path)}",
        "task.num_val=2",
        "task.reward_funcs=[my_rewards:seen]",
    )
    split = get_task("rows").load_prompts(cfg)
    assert len(split.train) == 10 and split.train[0].text == "20+00="
    assert decode_row(split.train[0].payload) == {"problem": "20+00=", "answer": "020", "tags": ["sum", "sum"]}


def test_the_rows_task_without_reward_functions_names_the_key(tmp_path):
    cfg = task("task.name=rows", f"task.data_path={write_rows(tmp_path)}")
    with pytest.raises(ConfigError, match="'task.reward_funcs' is empty"):
        get_task("rows").load_prompts(cfg)


def test_the_math_task_with_reward_functions_carries_every_column(tmp_path, user_rewards):
    cfg = task(
        "task.name=math",
        f"task.data_path={write_rows(tmp_path)}",
        "task.num_val=2",
        "task.reward_funcs=[my_rewards:seen]",
    )
    payload = get_task("math").load_prompts(cfg).train[0].payload
    assert decode_row(payload)["tags"] == ["sum", "sum"] and decode_row(payload)["answer"] == "020"


# ---- metrics ------------------------------------------------------------------------------


def test_each_function_gets_a_mean_and_std_per_step():
    samples = [
        sample([(0, 2)], r, reward_components={"exact": e, "short": s})
        for r, e, s in ((1.5, 1.0, 1.0), (0.5, 0.0, 1.0), (1.0, 1.0, 0.0), (0.0, 0.0, 0.0))
    ]
    group = RolloutGroup.pack(samples, group_id="g", prompt_id=0, actor_id="a", prompt_tokens=int32s([1]))
    stats = Counter()
    count(group, stats)
    metrics = reward_component_metrics(stats)
    assert metrics == {
        "rewards/exact/mean": 0.5,
        "rewards/exact/std": 0.5,
        "rewards/short/mean": 0.5,
        "rewards/short/std": 0.5,
    }
    assert reward_component_metrics(Counter({"samples": 3})) == {}


# ---- config check -------------------------------------------------------------------------


def check(tmp_path, capsys, funcs, *more):
    from tidal.ops.cli import main
    from tidal.tiny import build_tiny_model, save_model

    if not (tmp_path / "model").exists():
        save_model(*build_tiny_model(TINY, ALPHABET, seed=0), tmp_path / "model")
    capsys.readouterr()  # the saving's progress bar is not the check's output
    code = main(
        [
            "config",
            "check",
            "tiny",
            f"model.path={tmp_path / 'model'}",
            "task.name=rows",
            f"task.data_path={write_rows(tmp_path)}",
            "task.num_val=2",
            f"task.reward_funcs=[{funcs}]",
            *more,
        ]
    )
    return code, capsys.readouterr()


def test_config_check_scores_a_few_rows_with_their_answers(tmp_path, user_rewards, capsys):
    code, out = check(tmp_path, capsys, "my_rewards:exact,my_rewards:seen")
    assert code == 0, out.err
    assert "reward exact (weight 1) on 3 training prompts, completion = its 'answer' column: 1, 1, 1" in out.out
    assert "reward, their weighted sum:" in out.out and "config ok" in out.out
    assert "a sample passes when the weighted sum is >= 1 (task.pass_threshold)" in out.out
    code, out = check(tmp_path, capsys, "my_rewards:exact,my_rewards:seen", "task.pass_on=exact")
    assert "a sample passes when reward function exact's value is >= 1 (task.pass_threshold)" in out.out


def test_config_check_shows_where_a_raising_reward_failed_and_exits_2(tmp_path, user_rewards, capsys):
    code, out = check(tmp_path, capsys, "my_rewards:broken")
    assert code == 2
    lines = out.err.strip().splitlines()
    assert lines[0] == ("tidal config: config key 'task.reward_funcs': reward function broken raised KeyError: 'answr'")
    assert lines[1] == f'  File "{user_rewards}", line 20, in broken'
    assert len(lines) <= 5 and "asyncio" not in out.err


def test_config_check_reports_a_signature_at_its_def_naming_the_columns(tmp_path, signatures, capsys):
    code, out = check(tmp_path, capsys, f"{signatures}:missing_column")
    assert code == 2
    assert out.err.strip().splitlines()[:2] == [
        "tidal config: config key 'task.reward_funcs': reward function missing_column(completion, ground_truth, "
        "**kwargs) asks for 'ground_truth', which the rows lack (columns: problem, answer, tags)",
        def_of(signatures, "missing_column"),
    ]


def test_config_check_scores_a_function_taking_lists_in_one_call(tmp_path, user_rewards, capsys):
    """A group's worth of rows in one call: one returning the wrong count fails at the check, not 512
    episodes into a run."""
    import my_rewards

    code, out = check(tmp_path, capsys, "my_rewards:accuracy")
    assert code == 0, out.err
    assert my_rewards.CALLS == [3]
    code, out = check(tmp_path, capsys, "my_rewards:one_short")
    assert code == 2
    assert (
        "reward function one_short takes lists (it names `completions`) and returned 2 values for 3 samples" in out.err
    )


def test_config_check_refuses_rewards_outside_the_reward_range(tmp_path, user_rewards, capsys):
    """A 0-10 score plus a format bonus reached 10.2: `config ok`, then a run whose groups were all refused."""
    code, out = check(tmp_path, capsys, "my_rewards:exact,my_rewards:seen", "task.reward_weights=[10,0.2]")
    assert code == 2
    [line] = out.err.strip().splitlines()
    assert line == (
        "tidal config: config key 'task.reward_range' = [-10, 10]: training prompt 0 scored 10.4 "
        "(exact 1 x 10 + seen 2 x 0.2), completion = its 'answer' column, outside it; the learner refuses "
        "every group holding such a reward (widen task.reward_range, or rescale the rewards)"
    )
    code, out = check(
        tmp_path,
        capsys,
        "my_rewards:exact,my_rewards:seen",
        "task.reward_weights=[10,0.2]",
        "task.reward_range=[-1,11]",
    )
    assert code == 0, out.err


def test_the_readme_reward_functions_score_as_printed(tmp_path, monkeypatch, capsys):
    from conftest import ROOT

    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n# my_rewards.py")
    (tmp_path / "my_rewards.py").write_text(text[start + len("```python\n") : text.index("```", start + 10)])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    code, out = check(tmp_path, capsys, "my_rewards:accuracy,my_rewards:brief")
    assert code == 0, out.err
    assert "reward accuracy (weight 1) on 3 training prompts, completion = its 'answer' column: 1, 1, 1" in out.out
    assert "reward, their weighted sum: 2, 2, 2" in out.out


# ---- the whole pipeline -------------------------------------------------------------------


def run_pipeline(tmp_path, funcs: str, weights: str):
    """A two-step run of the whole pipeline in this process: the learner, and an actor on a thread whose
    engine answers right half the time; returns the run's folder."""
    from tidal.actor.episode import Episodes
    from tidal.actor.loop import Actor
    from tidal.broker.inproc import InprocBroker
    from tidal.broker.schema import WireCodec
    from tidal.broker.weights import build_receiver
    from tidal.config import resolve
    from tidal.learner.main import build, serve
    from tidal.tiny import build_tiny_model, save_model

    model, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    save_model(model, tokenizer, tmp_path / "model")
    cfg = resolve(
        load_config(
            "configs/tiny.yaml",
            [
                f"run_dir={tmp_path / 'run'}",
                f"model.path={tmp_path / 'model'}",
                "learner.max_steps=2",
                "learner.groups_per_step=4",
                "sampling.n=4",
                "eval.every=0",
                "eval.n=2",
                "actor.heartbeat_s=0.2",
                "task.name=rows",
                f"task.data_path={write_rows(tmp_path, 40)}",
                "task.num_val=4",
                f"task.reward_funcs=[{funcs}]",
                f"task.reward_weights=[{weights}]",
                "curriculum.enabled=false",
                "learner.zero_variance_filter=true",
            ],
        ),
        actor=True,
    )  # a reward failing everywhere: no step, only failures
    broker = InprocBroker(WireCodec(cfg.broker.max_message_bytes))
    learner, engine, result = build(cfg, transport=broker.learner()), ScriptedEngine(tokenizer, 0.5), {}

    def run_actor():
        async def run():
            result["loop"], result["actor"] = asyncio.get_running_loop(), actor
            return await actor.run()

        actor = Actor(
            cfg.actor,
            engine,
            broker.actor(cfg.actor.id),
            build_receiver(cfg.weights),
            Episodes.of(cfg.task, cfg.env, engine.tokenizer),
        )
        result["reason"] = asyncio.run(run())

    thread = threading.Thread(target=run_actor, daemon=True)
    thread.start()
    try:
        assert serve(learner, tmp_path / "run") == 0
    except BaseException:  # a learner that fails announces no shutdown: in a run, the launcher stops the actors
        result["loop"].call_soon_threadsafe(result["actor"].stop.set)
        raise
    finally:
        thread.join(timeout=30)
        assert not thread.is_alive(), "the actor outlived the learner"
    return tmp_path / "run"


def test_a_two_function_weighted_reward_reaches_the_learners_metrics(tmp_path, user_rewards):
    run_dir = run_pipeline(tmp_path, "my_rewards:exact,my_rewards:short", "1.0,0.5")
    steps = [
        m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "rollout/reward_mean" in m
    ]
    assert len(steps) == 2
    for m in steps:  # the scripted engine answers right half the time, in 4 tokens or fewer (its stop included)
        assert 0 < m["rewards/exact/mean"] < 1 and m["rewards/short/mean"] == 1.0
        assert m["rewards/short/std"] == 0.0 and m["rewards/exact/std"] > 0
        assert math.isclose(m["rollout/reward_mean"], m["rewards/exact/mean"] + 0.5 * m["rewards/short/mean"])
    assert json.loads((run_dir / "summary.json").read_text())["episode_failures"] == {"count": 0, "reasons": []}


def test_a_reward_raising_during_a_run_is_named_with_its_line_in_the_runs_last_lines(tmp_path, user_rewards, capsys):
    from tidal.ops.launcher import print_summary

    run_dir = run_pipeline(tmp_path, "my_rewards:picky", "1.0")
    summary = json.loads((run_dir / "summary.json").read_text())
    failed = summary["episode_failures"]
    assert 0 < failed["count"] < summary["samples"]  # the wrong half: the run went on with them scored 0
    print_summary(run_dir, 1.0)
    out = capsys.readouterr().out
    assert f"failed episodes: {failed['count']} of {summary['samples']} training samples were scored 0" in out
    assert (
        f"{failed['count']} x reward function picky raised ValueError: not a number I can read\n"
        f'      File "{user_rewards}", line {line_of("not a number I can read")}, in picky'
    ) in out


def test_a_reward_failing_every_episode_ends_the_learner_with_its_reason_not_a_traceback(
    tmp_path, user_rewards, caplog
):
    with caplog.at_level(logging.ERROR, logger="tidal.learner"), pytest.raises(SystemExit) as stopped:
        run_pipeline(tmp_path, "my_rewards:broken", "1.0")
    assert stopped.value.code == 1
    [error] = [r.getMessage() for r in caplog.records if r.name == "tidal.learner" and r.levelno == logging.ERROR]
    assert "training episodes all failed" in error
    assert (
        f"reward function broken raised KeyError: 'answr'\n  File \"{user_rewards}\", line "
        f'{line_of("answr")}, in broken\n    return kwargs["answr"]  # a typo: raises KeyError on '
        "every sample"
    ) in error
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["error"].startswith("the last 512 training episodes all failed")


# ---- a remote reward ----------------------------------------------------------------------


@pytest.fixture
def reward_server():
    """A real HTTP server on loopback: scores each sample by its completion's length, after failing the
    first `fail_first` requests with a 503."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = {"batches": [], "fail_first": 0, "requests": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            seen["requests"] += 1
            samples = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["samples"]
            if seen["requests"] <= seen["fail_first"]:
                self.send_response(503)
                self.end_headers()
                return
            seen["batches"].append(samples)
            body = json.dumps({"rewards": [float(len(s["completion"])) for s in samples]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/length", seen
    server.shutdown()
    server.server_close()


def score_group(env, completions):
    async def group():
        state = {**encode_row({"problem": "1+2=", "answer": "3"}), PROMPT_TEXT: "1+2="}
        return await asyncio.gather(*(env.score(state, c, [1] * len(c)) for c in completions))

    return asyncio.run(group())


def test_a_remote_reward_scores_a_group_in_one_post_after_a_retry(reward_server, monkeypatch):
    from tidal.tasks.rewards import RemoteReward

    monkeypatch.setattr(RemoteReward, "RETRY_PAUSE_S", 0.0)
    url, seen = reward_server
    seen["fail_first"] = 1
    env = Rewarded(task(f"task.reward_funcs=['{url}']", "task.reward_weights=[0.5]", "task.remote_timeout_s=5"))
    assert score_group(env, ["3", "33", "333"]) == [
        (0.5, {"length": 1.0}),
        (1.0, {"length": 2.0}),
        (1.5, {"length": 3.0}),
    ]
    assert seen["requests"] == 2 and len(seen["batches"]) == 1  # one failed try, then the whole group at once
    assert seen["batches"][0][1] == {
        "problem": "1+2=",
        "answer": "3",
        "prompt": "1+2=",
        "completion": "33",
        "completion_ids": [1, 1],
    }


def test_a_remote_reward_that_keeps_failing_names_its_url(reward_server, monkeypatch):
    from tidal.tasks.rewards import RemoteReward

    monkeypatch.setattr(RemoteReward, "RETRY_PAUSE_S", 0.0)
    url, seen = reward_server
    seen["fail_first"] = 10
    env = Rewarded(task(f"task.reward_funcs=['{url}']", "task.remote_retries=2"))
    with pytest.raises(RewardFailed, match=rf"reward function length raised ConnectionError: {url}: 3 tries failed"):
        score_group(env, ["3"])
    assert seen["requests"] == 3


@pytest.fixture
def odd_server():
    """A real HTTP server on loopback that misbehaves as `mode` says: drip (a reply a byte at a time,
    counting what it got out before the client hung up), huge (17 MiB), redirect (to `target`)."""
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = {"mode": "drip", "dripped": 0, "target": "", "requests": 0, "hung_up": threading.Event()}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            seen["requests"] += 1
            self.rfile.read(int(self.headers["Content-Length"]))
            if seen["mode"] == "redirect":
                self.send_response(302)
                self.send_header("Location", seen["target"])
                self.end_headers()
                return
            body = b" " * (17 << 20) if seen["mode"] == "huge" else b'{"rewards": [1.0]}' + b" " * 200
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                if seen["mode"] == "huge":
                    self.wfile.write(body)
                    return
                for i in range(len(body)):
                    self.wfile.write(body[i : i + 1])
                    self.wfile.flush()
                    seen["dripped"] = i + 1
                    time.sleep(0.05)
            except (BrokenPipeError, ConnectionResetError):
                seen["hung_up"].set()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def test_a_dripped_reply_is_cut_off_at_the_timeout_not_read_byte_by_byte(odd_server):
    """remote_timeout_s was a per-read timeout: a reply dripped a byte at a time took 30 s against 2. Now
    the whole POST ends at the timeout: the client hangs up long before the 218 bytes are out."""
    from tidal.tasks.rewards import RemoteReward

    url, seen = odd_server
    reward = RemoteReward(f"{url}/score", timeout_s=1.0, retries=0)
    with pytest.raises(ConnectionError, match="TimeoutError"):
        reward.post([{"completion": "3"}])
    assert seen["hung_up"].wait(30) and seen["dripped"] < 218


def test_a_huge_reply_is_refused_unread_and_a_redirect_is_not_followed(odd_server, reward_server):
    from tidal.tasks.rewards import RemoteReward

    url, seen = odd_server
    seen["mode"] = "huge"
    with pytest.raises(ConnectionError, match="a reply of more than 16777216 bytes"):
        RemoteReward(f"{url}/score", timeout_s=10, retries=0).post([{"completion": "3"}])
    target, target_seen = reward_server
    seen["mode"], seen["target"] = "redirect", target
    with pytest.raises(ConnectionError, match=r"HTTP 302 \(redirects are not followed\)"):
        RemoteReward(f"{url}/score", timeout_s=10, retries=0).post([{"completion": "3"}])
    assert target_seen["requests"] == 0


def test_credentials_in_a_remote_rewards_url_are_shown_nowhere(reward_server, monkeypatch):
    """A password and a token in the URL were in the MLflow params, config.yaml's artifact, the metric's
    name (rewards/score_token_S3cretTok/mean) and the failure text that travels to the learner."""
    from tidal.config import flatten, redacted_config, to_yaml
    from tidal.tasks.rewards import RemoteReward

    monkeypatch.setattr(RemoteReward, "RETRY_PAUSE_S", 0.0)
    url, seen = reward_server
    secret = url.replace("http://", "http://rw:S3cret@") + "?token=S3cretTok"
    cfg = load_config(None, [f"task.reward_funcs=['{secret}']"])
    shown = redacted_config(cfg)
    assert "S3cret" not in to_yaml(shown) and "S3cret" not in json.dumps(flatten(shown))
    [func] = load_reward_funcs(cfg.task)
    assert func.name == "length"
    seen["fail_first"] = 10
    with pytest.raises(ConnectionError) as err:
        func.fn.post([{"completion": "3"}])
    assert "S3cret" not in str(err.value) and "rw:***@" in str(err.value)
