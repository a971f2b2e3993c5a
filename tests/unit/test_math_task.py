"""The math task: prompts from JSON Lines and Parquet files, one-line errors naming file and line,
and math-verify rewards that hold from any thread and never raise on model output."""

import asyncio
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tidal.config import ConfigError, ModelConfig, TaskConfig, load_config, to_yaml
from tidal.tasks import get_task
from tidal.tasks import math as math_task

DATA = Path(__file__).parents[1] / "data" / "math_small.jsonl"
PRESET = Path(__file__).parents[2] / "configs" / "math.yaml"


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """Keep datasets' cache of the test files out of the user's ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def task(**overrides) -> TaskConfig:
    return TaskConfig(**{"name": "math", "data_path": str(DATA), "num_val": 4, **overrides})


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- prompts -------------------------------------------------------------------------------


def test_jsonl_split_is_seeded_and_disjoint():
    split = get_task("math").load_prompts(task())
    assert (len(split.train), len(split.val)) == (8, 4)
    assert sorted(p.prompt_id for p in split.train + split.val) == list(range(12))  # id = row of the file
    again = math_task.load_prompts(task())
    assert [p.prompt_id for p in again.val] == [p.prompt_id for p in split.val]
    other = math_task.load_prompts(task(seed=1))
    assert [p.prompt_id for p in other.val] != [p.prompt_id for p in split.val]
    first = next(p for p in split.train + split.val if p.prompt_id == 0)
    assert first.text == "What is $7 + 5$?\nPut the final answer in \\boxed{}."
    assert first.payload == {"answer": "12"}


def test_parquet_train_file_with_a_separate_val_file(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["1+1?", "2+3?", "10-4?"], "solution": ["2", "5", "6"]}), path)
    val_path = write_jsonl(
        tmp_path / "val.jsonl", [f'{{"question": "{a}+{a}?", "solution": "{2 * a}"}}' for a in range(10)]
    )
    cfg = task(
        data_path=str(path),
        val_path=str(val_path),
        num_val=4,
        prompt_field="question",
        answer_field="solution",
        prompt_template="Q: {question}\nA:",
    )
    split = math_task.load_prompts(cfg)
    assert [(p.prompt_id, p.text, p.payload["answer"]) for p in split.train] == [
        (0, "Q: 1+1?\nA:", "2"),
        (1, "Q: 2+3?\nA:", "5"),
        (2, "Q: 10-4?\nA:", "6"),
    ]
    # num_val of the val file's rows, with ids after the train file's
    assert len(split.val) == 4 and all(3 <= p.prompt_id < 13 for p in split.val)
    assert all(p.payload["answer"] == str(2 * (p.prompt_id - 3)) for p in split.val)


@pytest.mark.parametrize(
    "bad_line, line_no, says",
    [
        ('{"problem": "2+2?"}', 3, "'answer' is missing"),
        ('{"problem": "2+2?", "answer": 4}', 3, "'answer' is int 4, expected a string"),
        ('{"problem": "  ", "answer": "4"}', 3, "'problem' is empty"),
        ('{"problem": null, "answer": "4"}', 3, "'problem' is missing or null"),
        ('{"problem": "2+2?", "answer": ', 3, "not valid JSON"),
    ],
)
def test_bad_row_names_file_and_line(tmp_path, bad_line, line_no, says):
    # a blank line before the bad one: line numbers are the file's, not row indices
    path = write_jsonl(
        tmp_path / "train.jsonl",
        ['{"problem": "1+1?", "answer": "2"}', "", bad_line, '{"problem": "3+3?", "answer": "6"}'],
    )
    with pytest.raises(ValueError) as err:
        math_task.load_prompts(task(data_path=str(path), num_val=1))
    message = str(err.value)
    assert f"{path}:{line_no}:" in message and says in message and "\n" not in message


def test_bad_parquet_row_names_the_row(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"problem": ["a", "b", "c"], "answer": ["1", "2", None]}), path)
    with pytest.raises(ValueError, match=rf"{path}: row 2 \(counting from 0\): 'answer' is missing or null"):
        math_task.load_prompts(task(data_path=str(path), num_val=1))


@pytest.mark.parametrize(
    "overrides, error, says",
    [
        (
            {"data_path": "no/such/file.jsonl"},
            FileNotFoundError,
            "'task.data_path' = 'no/such/file.jsonl': no such file",
        ),
        ({"val_path": "missing-val.parquet"}, FileNotFoundError, "'task.val_path' = 'missing-val.parquet'"),
        ({"data_path": ""}, ValueError, "'task.data_path' is empty"),
        ({"answer_field": "solution"}, ValueError, "no column 'solution' (config key task.answer_field)"),
        ({"prompt_field": "question"}, ValueError, "no column 'question' (config key task.prompt_field)"),
        ({"prompt_field": "answer"}, ValueError, "needs exactly the placeholder {answer}"),
        ({"prompt_template": "{problem} in \\boxed{}"}, ValueError, "found {}, {problem}"),
        ({"num_val": 12}, ValueError, "'task.num_val' = 12 leaves no training prompts"),
    ],
)
def test_config_mistakes_name_the_key(overrides, error, says):
    with pytest.raises(error) as err:
        math_task.load_prompts(task(**overrides))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_preset_loads_and_its_template_survives_the_run_directory_yaml(tmp_path):
    cfg = load_config(PRESET)
    assert cfg.task.name == "math" and cfg.model.path == ""  # the user must set it
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))  # what `tidal run` hands its processes
    assert load_config(tmp_path / "config.yaml").task == cfg.task


def test_tiny_model_with_the_math_task_is_a_clear_config_error():
    from tidal.tiny import cached_model_path

    with pytest.raises(ConfigError, match="config key 'model.path' = '': task.name = 'math' needs a Hugging Face"):
        cached_model_path(ModelConfig(), task())


# ---- reward --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gold, completion",
    [
        ("0.5", "So the answer is \\boxed{1/2}."),
        ("0.5", "\\boxed{\\frac{1}{2}}"),
        ("\\frac{1}{2}", "Half of it: \\boxed{0.5}"),
        ("\\frac{1}{2}", "$\\dfrac{2}{4}$"),
        ("12", "7 + 5 = 12, so \\boxed{12}"),
        ("\\sqrt{2}", "\\boxed{2^{1/2}}"),
        ("x^2+1", "\\boxed{1 + x^2}"),
        ("9\\pi", "\\boxed{9 \\pi}"),
    ],
)
def test_equivalent_answers_score_one(gold, completion):
    assert math_task.reward(completion, {"answer": gold}) == 1.0


@pytest.mark.parametrize(
    "gold, completion",
    [
        ("0.5", "\\boxed{1/3}"),
        ("12", "\\boxed{13}"),
        ("\\sqrt{2}", "\\boxed{1.4}"),
        ("x^2+1", "\\boxed{x^2+2}"),
    ],
)
def test_wrong_answers_score_zero(gold, completion):
    assert math_task.reward(completion, {"answer": gold}) == 0.0


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "   ",
        "}}}{{{\\\\\\boxed{",
        "\\boxed{",
        "\\boxed{\\frac{1}{0}}",
        "\x00\ud800\uffff",
        "x" * 200_000,
        "\\boxed{" + "{" * 60 + "}",
        "$$$$\\left(\\right]",
        "\\boxed{1/2" * 1000,
    ],
)
def test_garbage_scores_zero_without_raising(garbage):
    assert math_task.reward(garbage, {"answer": "3"}) == 0.0


def test_reward_from_a_non_main_thread_and_an_event_loop():
    results = []
    worker = threading.Thread(target=lambda: results.append(math_task.reward("\\boxed{0.5}", {"answer": "1/2"})))
    worker.start()
    worker.join()

    async def in_loop():  # as the actor calls it: synchronously inside a coroutine
        return math_task.reward("\\boxed{\\frac12}", {"answer": "0.5"})

    loop_thread = threading.Thread(target=lambda: results.append(asyncio.run(in_loop())))
    loop_thread.start()
    loop_thread.join()
    assert results == [1.0, 1.0]
    assert math_task.reward_stats()["rollout/math_correct"] >= 2


def test_pathological_answer_times_out_and_the_helper_is_replaced():
    verifier = math_task.Verifier(timeout_s=0.5)
    try:
        assert verifier.judge("3", "\\boxed{3}") == math_task.CORRECT  # started and warm
        start = time.monotonic()
        result = []
        worker = threading.Thread(target=lambda: result.append(verifier.judge("3", "\\boxed{9^{9^{9^{9}}}}")))
        worker.start()
        worker.join()
        assert result == [math_task.TIMEOUT] and time.monotonic() - start < 3.0
        assert verifier.judge("3", "\\boxed{3}") == math_task.CORRECT  # a fresh helper
        assert verifier.counts == {math_task.CORRECT: 2, math_task.TIMEOUT: 1}
    finally:
        verifier.close()


def test_the_helpers_address_space_is_capped():
    """Without a cap, an answer whose evaluation needs gigabytes grows the helper until the actor's
    pod is out of memory; with it, the allocation fails inside the helper (MemoryError: scored 0)."""
    verifier = math_task.Verifier()
    try:
        assert verifier.judge("3", "\\boxed{3}") == math_task.CORRECT
        limits = Path(f"/proc/{verifier._helper.proc.pid}/limits").read_text()
        soft = next(line.split()[3] for line in limits.splitlines() if line.startswith("Max address space"))
        assert soft != "unlimited" and int(soft) < 8 << 30
    finally:
        verifier.close()


def test_a_capped_process_fails_a_huge_allocation_and_goes_on():
    import subprocess
    import sys

    probe = (
        "from tidal.tasks.math import cap_memory\n"
        "cap_memory(64 << 20)\n"
        "try:\n    bytearray(1 << 30)\nexcept MemoryError:\n    print('refused')\n"
        "print(len(bytearray(1 << 20)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["refused", str(1 << 20)], out.stderr
