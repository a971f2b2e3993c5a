"""A finished sample's text, decoded once per group, is the text vLLM's own detokenizer writes
token by token (a decode stream primed with the prompt, special tokens skipped)."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from tidal.actor.engine import batch_decoder, completion_texts

CORPUS = [
    "the sum of 12 and 34 is 46",
    "naïve café au lait, déjà vu",
    "日本語のテキスト と 数字 42",
    "  leading spaces and\ttabs\nnew lines",
    "<eos> ends a sample",
]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE like Qwen2's, trained on a few lines: tokens begin with spaces, characters
    span several tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def streamed(tokenizer, prompt: list[int], completion: list[int]) -> str:
    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    return "".join(piece for t in completion if (piece := stream.step(tokenizer._tokenizer, t)) is not None)


def test_group_decoding_matches_the_streamed_text_of_every_sample(tokenizer):
    """Prompts cut from a line, completions that continue it or draw tokens at random, ending
    anywhere (inside a character too, as a sample cut at max_tokens does) or at <eos>."""
    rng = random.Random(0)
    lines = [tokenizer(line, add_special_tokens=False)["input_ids"] for line in CORPUS]
    whole = [t for t in range(len(tokenizer)) if "\ufffd" not in tokenizer.decode([t])]
    checked = 0
    for _ in range(60):
        line = rng.choice(lines)
        # a prompt is tokenized text, so it ends on a whole character
        cut = rng.choice([i for i in range(1, len(line)) if not tokenizer.decode(line[:i]).endswith("\ufffd")])
        completions = [line[cut : cut + rng.randint(0, 12)] for _ in range(4)]
        completions += [
            [rng.choice(whole) for _ in range(rng.randint(0, 8))] + [tokenizer.eos_token_id] for _ in range(4)
        ]
        expected = [streamed(tokenizer, line[:cut], c) for c in completions]
        assert completion_texts(batch_decoder(tokenizer), line[:cut], completions) == expected
        checked += sum(len(c) for c in completions)
    assert checked > 1000


def test_a_completion_after_a_space_keeps_its_leading_space(tokenizer):
    prompt = tokenizer("the sum of 12 and 34 is", add_special_tokens=False)["input_ids"]
    answer = tokenizer(" 46", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert completion_texts(batch_decoder(tokenizer), prompt, [answer]) == [" 46"]
    assert completion_texts(None, prompt, [answer]) == [""]
