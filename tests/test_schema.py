"""Wire schema: round trips, and every kind of bad frame rejected with a named, counted reason."""
import msgspec
import numpy as np
import pytest

from tidal.broker.schema import (PromptGroup, RolloutGroup, Sample, SamplingParams, WeightUpdate, WireCodec,
                                 WireError, float32s, int32s)


def rollout(tokens=(3, 4, 1), logprobs=(-0.5, -1.0, -0.1), spans=((0, 0, 1), (1, 1, 3)), reward=1.0):
    return RolloutGroup(group_id="g1", prompt_id=7, actor_id="actor-0", prompt_tokens=int32s([5, 6]),
                        samples=[Sample(tokens=int32s(tokens), logprobs=float32s(logprobs),
                                        version_spans=[tuple(s) for s in spans], reward=reward, finish_reason="stop")])


def test_rollout_round_trip_keeps_arrays_and_versions():
    codec = WireCodec(1 << 20)
    back = codec.decode(codec.encode(rollout()), expect=RolloutGroup)
    s = back.samples[0]
    assert s.tokens.numpy("i4", "t").tolist() == [3, 4, 1]
    assert np.allclose(s.logprobs.numpy("f4", "l"), [-0.5, -1.0, -0.1])
    assert s.versions().tolist() == [0, 1, 1]


def test_prompt_group_round_trip():
    codec = WireCodec(1 << 20)
    g = PromptGroup(run_id="r", group_id="r-0", prompt_id=1, prompt_tokens=int32s([1, 2]), task="arithmetic",
                    payload={"answer": "3"}, n=4, sampling=SamplingParams(0.7, 1.0, 8, (1,)), min_version=3)
    back = codec.decode(codec.encode(g))
    assert back == g


@pytest.mark.parametrize("frame, reason", [
    (b"\x00\x01garbage", "malformed"),
    (msgspec.msgpack.encode({"kind": "rollout_group", "schema_version": 99}), "schema_version"),
    (msgspec.msgpack.encode({"kind": "no_such_kind", "schema_version": 1}), "malformed"),
])
def test_garbage_frames_are_rejected_and_counted(frame, reason):
    codec = WireCodec(1 << 20)
    with pytest.raises(WireError) as err:
        codec.decode(frame)
    assert err.value.reason == reason
    assert codec.rejected[reason] == 1


def test_oversized_frame_is_rejected_before_decoding():
    codec = WireCodec(64)
    with pytest.raises(WireError, match="max_message_bytes"):
        codec.decode(b"x" * 65)
    assert codec.rejected["oversized"] == 1
    with pytest.raises(WireError):
        codec.encode(rollout())


@pytest.mark.parametrize("bad, reason", [
    (dict(logprobs=(-0.5, -1.0)), "bad_length"),
    (dict(spans=((0, 0, 2),)), "bad_spans"),
    (dict(spans=((0, 0, 1), (1, 2, 3))), "bad_spans"),
    (dict(reward=float("nan")), "bad_value"),
])
def test_inconsistent_rollouts_are_rejected(bad, reason):
    codec = WireCodec(1 << 20)
    with pytest.raises(WireError) as err:
        codec.decode(codec.encode(rollout(**bad)))
    assert err.value.reason == reason


def test_wrong_dtype_is_rejected():
    codec = WireCodec(1 << 20)
    g = rollout()
    g.samples[0].tokens = float32s([1.0, 2.0, 3.0])
    with pytest.raises(WireError) as err:
        codec.decode(codec.encode(g))
    assert err.value.reason == "bad_dtype"


def test_unexpected_kind_is_rejected():
    codec = WireCodec(1 << 20)
    update = WeightUpdate(version=1, transport="file", location="/x", manifest=[], checksum="0")
    with pytest.raises(WireError) as err:
        codec.decode(codec.encode(update), expect=RolloutGroup)
    assert err.value.reason == "unexpected_kind"
