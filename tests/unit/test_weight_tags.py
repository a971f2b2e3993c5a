"""Keyed tensor tags (the nccl channel's integrity check): exact on any device, as the reference in
Python integers says, and changed by any altered byte."""

import os

import pytest
import torch

from tidal.broker.weights import tags


def tag_of(data: bytes, key: bytes, dtype=torch.uint8) -> bytes:
    tagger = tags.Tagger(key)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    tagger.tag(raw.view(dtype))
    return tagger.digests()[0]


@pytest.mark.parametrize("num_bytes", [0, 1, 2, 3, 101, 2 * tags.WORDS_PER_BLOCK + 1, 2 * tags.WORDS_PER_BLOCK * 5 + 7])
def test_tags_agree_with_the_word_by_word_reference(num_bytes, monkeypatch):
    monkeypatch.setattr(tags, "BLOCKS_AT_ONCE", 2)  # several passes over a tensor of a few blocks
    key, data = tags.new_key(), os.urandom(num_bytes)
    assert tag_of(data, key) == tags.reference_tag(data, key)


def test_the_largest_words_and_keys_stay_exact():
    """Every byte 0xFF under keys of P - 1 and P - 2: the products and sums at their bounds."""
    key = (tags.P - 1).to_bytes(8, "little") + (tags.P - 2).to_bytes(8, "little")
    data = b"\xff" * (2 * tags.WORDS_PER_BLOCK * 3 + 5)
    assert tag_of(data, key) == tags.reference_tag(data, key)


def test_a_tensor_of_any_dtype_and_a_view_at_an_odd_offset_are_tagged_by_their_bytes():
    key = tags.new_key()
    for dtype in (torch.bfloat16, torch.float32, torch.int8):
        data = os.urandom(4 * 300)
        assert tag_of(data, key, dtype) == tags.reference_tag(data, key)
    base = torch.frombuffer(bytearray(os.urandom(1001)), dtype=torch.uint8)
    tagger = tags.Tagger(key)
    tagger.tag(base[1:])  # a view whose bytes start at an odd address
    assert tagger.digests() == [tags.reference_tag(bytes(base[1:].numpy()), key)]


def test_any_altered_byte_and_any_other_key_change_the_tag():
    key, weights = tags.new_key(), torch.randn(64, 1024).to(torch.bfloat16)
    tagger = tags.Tagger(key)
    tagger.tag(weights)
    for index in (0, 777, weights.numel() - 1):
        altered = weights.clone()
        altered.view(-1).view(torch.int16)[index] ^= 1  # one bit
        tagger.tag(altered)
    tags.Tagger(tags.new_key()).tag(weights)
    other = tags.Tagger(tags.new_key())
    other.tag(weights)
    original, *altered = tagger.digests()
    assert len(set(altered)) == 3 and original not in altered
    assert other.digests()[0] != original


@pytest.mark.parametrize("key", [b"short", bytes(16), (tags.P).to_bytes(8, "little") * 2])
def test_a_key_that_is_not_two_field_elements_is_refused(key):
    with pytest.raises(ValueError, match="tag key"):
        tags.Tagger(key)
