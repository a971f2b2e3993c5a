"""Tasks as plugins and prompts as users bring them: a task from an import path or the tidal.tasks
entry points, its own options (task.kwargs), datasets from files, folders and Hub-style splits,
string or chat-message prompts through the tokenizer's chat template, a system prompt."""

import json

import pytest

from conftest import ALPHABET, ROOT, TINY, TINY_CHAT_TEMPLATE
from tidal.config import ConfigError, TaskConfig
from tidal.ops.cli import main
from tidal.tasks import Prompt, PromptEncoder, encode_prompt, get_reward, get_task, installed_tasks
from tidal.tasks.data import load_rows
from tidal.tiny import build_tiny_model

PLUGIN = '''
"""A task of a user's own: tidal's arithmetic prompts, an answer within task.kwargs.tolerance passes."""
from tidal.tasks import arithmetic

def load_prompts(cfg):
    return arithmetic.load_prompts(cfg)

def build_reward(cfg):
    tolerance = int(cfg.kwargs.get("tolerance", 0))
    def reward(text, payload):
        return 1.0 if text.strip().isdigit() and abs(int(text) - int(payload["answer"])) <= tolerance else 0.0
    return reward
'''


@pytest.fixture
def tokenizer():
    _, tok = build_tiny_model(TINY, ALPHABET, seed=0)
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def test_chat_messages_and_string_prompts_through_the_chat_template(tokenizer):
    plain = encode_prompt(tokenizer, "12+34=")
    chat = Prompt(1, "", {"answer": "046"}, messages=({"role": "user", "content": "12+34"},))
    assert PromptEncoder(tokenizer)(chat) == plain  # messages always get the template
    assert PromptEncoder(tokenizer, chat_template=True)(Prompt(2, "12+34", {})) == plain
    assert PromptEncoder(tokenizer)(Prompt(3, "12+34=", {})) == plain  # raw text: no template
    with_system = PromptEncoder(tokenizer, chat_template=True, system_prompt="7")
    assert with_system(chat) == encode_prompt(tokenizer, "7+12+34=")
    own_system = Prompt(4, "", {}, messages=({"role": "system", "content": "9"}, {"role": "user", "content": "1+2"}))
    assert with_system(own_system) == encode_prompt(tokenizer, "9+1+2=")  # the row's own system message wins


def test_a_tokenizer_without_a_chat_template_is_a_named_error(tokenizer):
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match="task.chat_template"):
        PromptEncoder(tokenizer, chat_template=True)


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_conversational_dataset_in_a_hub_style_folder_with_splits(tmp_path):
    """A folder laid out as a Hub dataset repository (data/<split>.jsonl) reads like one, split by split."""
    train = [{"prompt": [{"role": "user", "content": f"{i}+1"}], "answer": str(i + 1)} for i in range(5)]
    write_jsonl(tmp_path / "ds" / "data" / "train.jsonl", train)
    write_jsonl(tmp_path / "ds" / "data" / "test.jsonl", train[:2])
    rows = load_rows(str(tmp_path / "ds"), "task.data_path", "prompt", "answer", split="train")
    assert [r["prompt"][0]["content"] for r in rows] == [f"{i}+1" for i in range(5)]
    assert len(load_rows(str(tmp_path / "ds"), "task.val_path", "prompt", "answer", split="test")) == 2
    split = get_task("math").load_prompts(
        TaskConfig(
            name="math", data_path=str(tmp_path / "ds"), val_path=str(tmp_path / "ds"), prompt_field="prompt", num_val=2
        )
    )
    assert split.val[0].messages == ({"role": "user", "content": "0+1"},) and split.val[0].text == ""


@pytest.mark.parametrize(
    "rows, says",
    [
        ([{"prompt": [], "answer": "1"}], "holds no chat messages"),
        ([{"prompt": [{"role": "user"}], "answer": "1"}], "message 0 is not"),
    ],
)
def test_bad_chat_rows_name_file_and_line(tmp_path, rows, says):
    write_jsonl(tmp_path / "bad.jsonl", [{"prompt": [{"role": "user", "content": "1"}], "answer": "1"}, *rows])
    with pytest.raises(ValueError, match=f"bad.jsonl:2: 'prompt' {says}"):
        load_rows(str(tmp_path / "bad.jsonl"), "task.data_path", "prompt", "answer")


def test_a_task_from_an_import_path_with_its_own_options(tmp_path, monkeypatch):
    (tmp_path / "lenient_tasks").mkdir()  # a package name no other test imports (sys.modules outlives a test)
    (tmp_path / "lenient_tasks" / "__init__.py").write_text("")
    (tmp_path / "lenient_tasks" / "lenient.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = TaskConfig(name="lenient_tasks.lenient", kwargs={"tolerance": 1}, num_val=4)
    assert len(get_task(cfg.name).load_prompts(cfg).val) == 4
    reward = get_reward(cfg)
    assert (reward("086", {"answer": "085"}), reward("087", {"answer": "085"})) == (1.0, 0.0)


def test_built_in_tasks_are_entry_points_too():
    assert {"arithmetic", "count", "math"} <= set(installed_tasks())


def test_the_count_task_has_long_tailed_completions_in_one_batch():
    from tidal.tasks import count

    split = count.load_prompts(TaskConfig(name="count", max_operand=999, num_val=128))
    prompts = split.train + split.val
    assert len({p.prompt_id for p in prompts}) == len(prompts) and len(split.val) == 128
    assert len(prompts) > 5000  # a run of a few hundred steps cannot learn them one by one
    lengths = sorted(len(p.payload["answer"]) for p in prompts)
    median = lengths[len(lengths) // 2]
    assert lengths[0] == 7 and lengths[-1] == 95  # 2 to 24 three-digit numbers
    assert median <= 20 and lengths[int(0.95 * len(lengths))] >= 3 * median  # a long tail past a short median
    first = next(p for p in prompts if p.text.endswith(f"{int(p.text[:3]) + 3:03d}:"))  # a span of four
    a = int(first.text[:3])
    assert first.payload["answer"] == " ".join(f"{n:03d}" for n in range(a, a + 4))
    right, long = f" {first.payload['answer']}\n", f"{first.payload['answer']} {a + 4:03d}"
    assert (count.reward(right, first.payload), count.reward(long, first.payload)) == (1.0, 0.0)
    slipped = count.teacher_slip("997 998 999", __import__("random").Random(0))
    assert slipped.startswith("997 998 999 000")  # the sloppy teacher counts on past the end
    with pytest.raises(ConfigError, match="task.max_operand"):
        count.load_prompts(TaskConfig(name="count", max_operand=1200))


@pytest.mark.parametrize(
    "name, says",
    [
        ("nope", "'task.name' = 'nope': not a known task (arithmetic, chain, count, math"),
        ("no_such_pkg.task", "cannot import no_such_pkg.task"),
        ("tidal.tiny", "tidal.tiny has no load_prompts and no reward (or build_reward, or Environment)"),
    ],
)
def test_an_unknown_or_incomplete_task_is_one_line_and_exit_2(tmp_path, capsys, name, says):
    assert main(["run", str(ROOT / "configs/tiny.yaml"), f"task.name={name}", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]
    assert not (tmp_path / "run").exists()


def test_the_warm_start_loss_is_the_same_however_a_batch_is_chunked():
    import random

    import torch

    from tidal.config import TinyModelConfig
    from tidal.learner.tools.warmstart import pass_rate, sft_loss
    from tidal.tasks import count

    split = count.load_prompts(TaskConfig(name="count", max_operand=999, num_val=16))
    net, tok = build_tiny_model(TinyModelConfig(num_layers=1), count.ALPHABET, seed=0, positions=count.MAX_POSITIONS)
    batch = random.Random(0).sample(split.train, 12)
    whole = sft_loss(net, tok, batch, chunk_tokens=10**6)
    chunked = sft_loss(net, tok, batch, chunk_tokens=64)  # one or two sequences a chunk
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    # the warm start's cached greedy decoding writes what transformers' own generate does
    from tidal.tasks import Prompt, encode_prompt

    expected = []
    for p in split.val[:4]:
        ids = torch.tensor([encode_prompt(tok, p.text)])
        out = net.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1] :].tolist()
        out = out[: out.index(tok.eos_token_id)] if tok.eos_token_id in out else out
        expected.append(Prompt(p.prompt_id, p.text, {"answer": tok.decode(out, skip_special_tokens=True)}))
    assert pass_rate(net, tok, expected, count.reward, temperature=0.0, max_new_tokens=20) == 1.0


def test_the_warm_start_stops_only_after_its_target_holds_at_stable_checks_in_a_row(monkeypatch):
    """A single greedy pass can be a lucky jump: with stable_checks=2 the SFT goes on until two
    checks in a row reach the target (the checks' results scripted here; the SFT steps are real)."""
    from tidal.config import TinyModelConfig, WarmStartConfig
    from tidal.learner.tools import warmstart
    from tidal.tasks import arithmetic

    split = arithmetic.load_prompts(TaskConfig(name="arithmetic", max_operand=9, num_val=8))
    net, tok = build_tiny_model(TinyModelConfig(num_layers=1), arithmetic.ALPHABET, seed=0)
    for stable_checks, expected_checks in ((1, 1), (2, 4)):
        greedy = iter([0.95, 0.5, 0.92, 0.91, 0.99, 0.99])  # passes at checks 1, 3 and 4
        checks = []

        def scripted(net, tokenizer, prompts, reward, temperature, max_new_tokens, results=greedy, seen=checks):
            if temperature == 0.0:
                seen.append(1)
                return next(results)
            return 0.0

        monkeypatch.setattr(warmstart, "pass_rate", scripted)
        cfg = WarmStartConfig(check_every=1, batch_size=4, max_steps=10, stable_checks=stable_checks)
        done = warmstart.warm_start(
            net,
            tok,
            split.train,
            split.val,
            arithmetic.reward,
            warmstart.stray_suffix(arithmetic.ALPHABET),
            cfg,
            progress=lambda _: None,
        )
        assert len(checks) == expected_checks and done >= cfg.target_greedy_pass_rate


def test_the_arithmetic_task_gives_partial_credit_when_asked():
    plain = get_reward(TaskConfig(name="arithmetic"))
    partial = get_reward(TaskConfig(name="arithmetic", kwargs={"partial_credit": 0.1}))
    assert (plain("012", {"answer": "085"}), plain("085", {"answer": "085"})) == (0.0, 1.0)
    assert (partial("012", {"answer": "085"}), partial(" 085", {"answer": "085"})) == (0.1, 1.0)
    for bad in (1.0, -0.1, "0.1", True):
        with pytest.raises(ConfigError, match="task.kwargs.partial_credit"):
            get_reward(TaskConfig(name="arithmetic", kwargs={"partial_credit": bad}))
