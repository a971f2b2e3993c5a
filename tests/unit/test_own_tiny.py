"""A task that names nothing for the tiny model gets one built from its own prompts and answers."""

import string
from types import SimpleNamespace

import pytest

from tidal.config import ConfigError, TaskConfig
from tidal.tasks import Prompt, Split
from tidal.tiny import DEFAULT_POSITIONS, OwnTask


def module(*prompts: Prompt, val: int = 1):
    return SimpleNamespace(load_prompts=lambda cfg: Split(train=list(prompts[val:]), val=list(prompts[:val])))


def test_its_tokens_are_printable_ascii_and_its_own_characters_and_its_answers_teach_it():
    own = OwnTask.of(
        module(Prompt(0, "37+48=", {"answer": "085"}), Prompt(1, "π·2=", {"answer": "6.28"})), TaskConfig()
    )
    assert set(string.printable.strip()) | {" ", "π", "·"} == set(own.alphabet)
    assert own.pairs == (("π·2=", "6.28"), ("37+48=", "085")) and own.num_train == 1  # training, then held out
    assert own.positions == DEFAULT_POSITIONS


def test_a_long_prompt_gets_the_context_it_needs_and_other_data_another_model():
    long = OwnTask.of(module(Prompt(0, "x" * 100, {"answer": "1"}), Prompt(1, "y", {"answer": "2"})), TaskConfig())
    short = OwnTask.of(module(Prompt(0, "x", {"answer": "1"}), Prompt(1, "y", {"answer": "2"})), TaskConfig())
    assert long.positions == 128 and long.digest != short.digest


def test_an_answer_from_task_answer_field_for_rows():
    own = OwnTask.of(
        module(Prompt(0, "2+2=", {"gold": 4}), Prompt(1, "1+1=", {"gold": 2})), TaskConfig(answer_field="gold")
    )
    assert own.pairs == (("1+1=", "2"), ("2+2=", "4"))


@pytest.mark.parametrize(
    "prompt, why",
    [
        (Prompt(3, "2+2=", {"solution": "4"}), r"prompt 3 has no answer .*task.answer_field = 'answer'\)"),
        (Prompt(3, "", {"answer": "4"}, messages=({"role": "user", "content": "2+2"},)), "prompt 3 is chat messages"),
    ],
)
def test_a_prompt_it_cannot_learn_from_is_one_line_saying_what_to_set(prompt, why):
    with pytest.raises(ConfigError, match=f"config key 'model.path' = '': .*{why}; set model.path .* docs/tasks.md"):
        OwnTask.of(module(prompt, Prompt(4, "1+1=", {"answer": "2"})), TaskConfig())
