"""Wire schema: round trips, and every kind of bad frame rejected with a named, counted reason."""

import msgspec
import numpy as np
import pytest

from conftest import rollout
from tidal.broker.schema import (
    SCHEMA_VERSION,
    InterruptParams,
    PromptGroup,
    RolloutGroup,
    Sample,
    SampleArrays,
    SamplingParams,
    WeightUpdate,
    WireCodec,
    WireError,
    float32s,
    int32s,
)


def test_rollout_round_trip_keeps_arrays_and_versions():
    codec = WireCodec(1 << 20)
    back = codec.decode(codec.encode(rollout()), expect=RolloutGroup)
    ((s, tokens, logprobs),) = back.unpack()
    assert tokens.tolist() == [3, 4, 1]
    assert np.allclose(logprobs, [-0.5, -1.0, -0.1])
    assert s.versions().tolist() == [0, 1, 1]


def test_a_group_lays_its_samples_end_to_end_in_one_buffer():
    codec = WireCodec(1 << 20)
    two = RolloutGroup.pack(
        [
            SampleArrays.of([3, 4], [-0.5, -1.0], version_spans=[(0, 0, 2)], reward=1.0, finish_reason="stop"),
            SampleArrays.of([], [], version_spans=[], reward=0.0, finish_reason="length"),
            SampleArrays.of([9], [-2.0], version_spans=[(1, 0, 1)], reward=0.0, finish_reason="stop"),
        ],
        group_id="g",
        prompt_id=0,
        actor_id="a",
        prompt_tokens=int32s([1]),
    )
    back = codec.decode(codec.encode(two), expect=RolloutGroup)
    assert back.tokens.numpy("i4", "t").tolist() == [3, 4, 9]
    assert [(s.num_tokens, t.tolist(), lp.tolist()) for s, t, lp in back.unpack()] == [
        (2, [3, 4], [-0.5, -1.0]),
        (0, [], []),
        (1, [9], [-2.0]),
    ]
    with pytest.raises(ValueError, match="samples\\[0\\]: 2 tokens, 1 logprobs"):
        RolloutGroup.pack(
            [SampleArrays(two.samples[0], np.array([3, 4], np.int32), np.array([-0.5], np.float32))],
            group_id="g",
            prompt_id=0,
            actor_id="a",
            prompt_tokens=int32s([1]),
        )


def test_prompt_group_round_trip():
    codec = WireCodec(1 << 20)
    g = PromptGroup(
        run_id="r",
        group_id="r-0",
        prompt_id=1,
        prompt_tokens=int32s([1, 2]),
        task="arithmetic",
        payload={"answer": "3"},
        n=4,
        sampling=SamplingParams(0.7, 1.0, 8, (1,)),
        min_version=3,
    )
    back = codec.decode(codec.encode(g))
    assert back == g


@pytest.mark.parametrize(
    "frame, reason",
    [
        (b"\x00\x01garbage", "malformed"),
        (msgspec.msgpack.encode({"kind": "rollout_group", "schema_version": 99}), "schema_version"),
        (msgspec.msgpack.encode({"kind": "no_such_kind", "schema_version": SCHEMA_VERSION}), "malformed"),
    ],
)
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


@pytest.mark.parametrize(
    "bad, reason",
    [
        (dict(logprobs=float32s([-0.5, -1.0])), "bad_length"),  # fewer logprobs than tokens
        (dict(tokens=int32s([3, 4, 1, 2]), logprobs=float32s([-0.5] * 4)), "bad_length"),  # more than the samples count
        (
            dict(samples=[Sample(num_tokens=3, version_spans=[(0, 0, 2)], reward=1.0, finish_reason="stop")]),
            "bad_spans",
        ),
        (
            dict(
                samples=[Sample(num_tokens=3, version_spans=[(0, 0, 1), (1, 2, 3)], reward=1.0, finish_reason="stop")]
            ),
            "bad_spans",
        ),
        (
            dict(samples=[Sample(num_tokens=3, version_spans=[(0, 0, 3)], reward=float("nan"), finish_reason="stop")]),
            "bad_value",
        ),
        (dict(logprobs=float32s([-0.5, float("nan"), -0.1])), "bad_value"),
        (dict(tokens=float32s([1.0, 2.0, 3.0])), "bad_dtype"),
    ],
)
def test_inconsistent_rollouts_are_rejected(bad, reason):
    codec = WireCodec(1 << 20)
    with pytest.raises(WireError) as err:
        codec.decode(codec.encode(msgspec.structs.replace(rollout(), **bad)))
    assert err.value.reason == reason


@pytest.mark.filterwarnings("ignore:overflow encountered in dot")  # silenced by the schema outside pytest
def test_logprobs_are_checked_finite_whatever_their_magnitude():
    """The check sums the squares: NaN or an infinity anywhere makes that non-finite, and so do huge
    finite values, which are then accepted after a test of each."""
    codec = WireCodec(1 << 20)
    one = SampleArrays.of([3], [-0.5], version_spans=[(0, 0, 1)], reward=1.0, finish_reason="stop")

    def group(logprobs):
        two = SampleArrays.of([3, 4], logprobs, version_spans=[(0, 0, 2)], reward=0.0, finish_reason="stop")
        return RolloutGroup.pack([one, two], group_id="g", prompt_id=1, actor_id="a", prompt_tokens=int32s([5]))

    huge = group([-3e38, -3e38])
    assert codec.decode(codec.encode(huge)) == huge
    for bad in ([-0.5, float("nan")], [float("-inf"), -0.5], [-3e38, float("inf")]):
        with pytest.raises(WireError, match=r"samples\[1\]: non-finite logprob"):
            codec.decode(codec.encode(group(bad)))


def test_unexpected_kind_is_rejected():
    codec = WireCodec(1 << 20)
    update = WeightUpdate(version=1, transport="file", location="/x", manifest=[], checksum="0")
    with pytest.raises(WireError) as err:
        codec.decode(codec.encode(update), expect=RolloutGroup)
    assert err.value.reason == "unexpected_kind"


def test_a_weight_update_carries_its_token_and_a_sha256_per_range_and_refuses_a_short_digest():
    from tidal.broker.schema import TOKEN_BYTES, WeightBucket

    codec = WireCodec(1 << 20)
    bucket = WeightBucket(offset=0, nbytes=4, sha256=bytes(range(32)))
    update = WeightUpdate(
        version=1, transport="tcp", location="h:1", manifest=[], checksum="", buckets=[bucket], token=b"t" * TOKEN_BYTES
    )
    assert codec.decode(codec.encode(update)) == update
    fields = msgspec.msgpack.decode(codec.encode(update))
    for bad, where in (
        ({"offset": 0, "nbytes": 4, "sha256": b"\x00" * 4}, r"buckets\[0\]\.sha256"),
        ({"offset": 0, "nbytes": 4, "crc32": 7}, r"missing required field `sha256`"),
    ):
        with pytest.raises(WireError, match=rf"malformed: weight_update: .*{where}"):
            codec.decode(msgspec.msgpack.encode({**fields, "buckets": [bad]}))


def test_an_nccl_weight_update_carries_a_tag_per_tensor_and_refuses_a_short_one():
    from tidal.broker.schema import TAG_BYTES, TAG_KEY_BYTES, TensorSpec

    codec = WireCodec(1 << 20)
    update = WeightUpdate(
        version=1,
        transport="nccl",
        location="h:1",
        checksum="",
        token=b"t" * 32,
        manifest=[TensorSpec(name="w", dtype="F32", shape=(2,), offset=0, nbytes=8)],
        tag_key=b"k" * TAG_KEY_BYTES,
        tags=[b"x" * TAG_BYTES],
    )
    assert codec.decode(codec.encode(update)) == update
    fields = msgspec.msgpack.decode(codec.encode(update))
    for bad, where in (({"tags": [b"x" * (TAG_BYTES - 1)]}, r"tags\[0\]"), ({"tag_key": b"k" * 40}, "tag_key")):
        with pytest.raises(WireError, match=rf"malformed: weight_update: .*{where}"):
            codec.decode(msgspec.msgpack.encode({**fields, **bad}))


def interrupted(injected=((1, 2),), finish="interrupted", raw_reward=1.0):
    g = rollout(logprobs=(-0.5, 0.0, -0.1), reward=0.5)
    g.samples[0].injected_spans = [tuple(s) for s in injected]
    g.samples[0].finish_reason = finish
    g.samples[0].raw_reward = raw_reward
    return g


def test_injected_spans_and_raw_reward_round_trip():
    codec = WireCodec(1 << 20)
    s = codec.decode(codec.encode(interrupted()), expect=RolloutGroup).samples[0]
    assert s.injected_spans == [(1, 2)] and s.finish_reason == "interrupted"
    assert (s.reward, s.raw_reward, s.task_reward) == (0.5, 1.0, 1.0)
    assert s.injected_mask().tolist() == [False, True, False]


def test_frames_without_length_control_fields_still_decode():
    codec = WireCodec(1 << 20)
    frame = msgspec.msgpack.decode(codec.encode(rollout()))  # plain dicts, as an older actor would send
    for sample in frame["samples"]:
        del sample["injected_spans"], sample["raw_reward"]
    s = codec.decode(msgspec.msgpack.encode(frame), expect=RolloutGroup).samples[0]
    assert s.injected_spans == [] and s.raw_reward is None and s.task_reward == 1.0
    assert not s.injected_mask().any()


@pytest.mark.parametrize(
    "bad, reason",
    [
        (dict(injected=((2, 1),)), "bad_spans"),  # reversed
        (dict(injected=((1, 1),)), "bad_spans"),  # empty
        (dict(injected=((2, 4),)), "bad_spans"),  # past the completion's 3 tokens
        (dict(injected=((-1, 1),)), "malformed"),  # out of the type's bounds: rejected by the decoder itself
        (dict(injected=((0, 2), (1, 3))), "bad_spans"),  # overlapping
        (dict(injected=((2, 3), (0, 1))), "bad_spans"),  # unsorted
    ],
)
def test_bad_injected_spans_are_rejected(bad, reason):
    codec = WireCodec(1 << 20)
    with pytest.raises(WireError, match="injected_spans") as err:
        codec.decode(codec.encode(interrupted(**bad)))
    assert err.value.reason == reason


@pytest.mark.parametrize("bad", [dict(injected=(), finish="interrupted"), dict(raw_reward=float("inf"))])
def test_inconsistent_length_control_fields_are_rejected(bad):
    codec = WireCodec(1 << 20)
    with pytest.raises(WireError) as err:
        codec.decode(codec.encode(interrupted(**bad)))
    assert err.value.reason == "bad_value"


def prompt_group(sampling):
    return PromptGroup(
        run_id="r",
        group_id="r-0",
        prompt_id=1,
        prompt_tokens=int32s([1, 2]),
        task="arithmetic",
        payload={"answer": "3"},
        n=4,
        sampling=sampling,
        min_version=3,
    )


def test_prompt_group_with_length_control_round_trips():
    codec = WireCodec(1 << 20)
    g = prompt_group(
        SamplingParams(1.0, 1.0, 32, (1,), InterruptParams((5, 6), "ok", 8, 16, 8), overlong_buffer_tokens=4)
    )
    assert codec.decode(codec.encode(g)) == g


@pytest.mark.parametrize(
    "sampling, words",
    [
        # 16 thinking + 2 interruption + 8 answer = 26 > 24
        (SamplingParams(max_tokens=24, interrupt=InterruptParams((5, 6), "ok", 8, 16, 8)), "26 > max_tokens 24"),
        (SamplingParams(max_tokens=24, interrupt=InterruptParams((5, 6), "ok", 9, 8, 8)), "think budget"),
        (SamplingParams(max_tokens=24, interrupt=InterruptParams((), "", 1, 2, 3)), "0 tokens"),
        (SamplingParams(max_tokens=24, overlong_buffer_tokens=24), "overlong_buffer_tokens 24"),
    ],
)
def test_impossible_length_control_is_rejected(sampling, words):
    codec = WireCodec(1 << 20)
    with pytest.raises(WireError, match=words) as err:
        codec.decode(codec.encode(prompt_group(sampling)))
    assert err.value.reason == "bad_value"


@pytest.mark.parametrize("shape", [(-2, -2), (2**62, 4), (1,) * 65, (2**40, 2**40)])
def test_arrays_that_lie_about_their_shape_are_wire_errors(shape):
    """Once a plain ValueError in the decoder that killed the learner's I/O thread."""
    codec = WireCodec(1 << 20)
    frame = msgspec.msgpack.decode(codec.encode(rollout()))
    frame["prompt_tokens"]["shape"] = list(shape)
    with pytest.raises(WireError):
        codec.decode(msgspec.msgpack.encode(frame))


@pytest.mark.parametrize(
    "change",
    [
        lambda f: f["prompt_tokens"].update(shape=[1, 2]),  # a 2-D prompt
        lambda f: f["samples"][0].update(version_spans=[[2**63 - 1, 0, 3]]),  # a version no learner reaches
        lambda f: f.update(actor_id="x" * 1_000_000),  # a 1 MB id
    ],
)
def test_values_no_rollout_can_hold_are_wire_errors(change):
    codec = WireCodec(1 << 22)
    frame = msgspec.msgpack.decode(codec.encode(rollout(tokens=(3, 4), logprobs=(-0.5, -1.0), spans=((0, 0, 2),))))
    change(frame)
    with pytest.raises(WireError):
        codec.decode(msgspec.msgpack.encode(frame))


def test_reward_components_round_trip_and_default_to_none():
    codec = WireCodec(1 << 20)
    g = rollout()
    g.samples[0].reward_components = {"accuracy": 1.0, "format": -0.5}
    s = codec.decode(codec.encode(g), expect=RolloutGroup).samples[0]
    assert s.reward_components == {"accuracy": 1.0, "format": -0.5}
    frame = msgspec.msgpack.decode(codec.encode(rollout()))
    for sample in frame["samples"]:
        sample.pop("reward_components", None)  # a sample of a task without reward functions
    assert codec.decode(msgspec.msgpack.encode(frame), expect=RolloutGroup).samples[0].reward_components == {}


@pytest.mark.parametrize(
    "components, reason",
    [
        ({"accuracy": float("nan")}, "bad_value"),
        ({"accuracy": 1e30}, "bad_value"),  # past any score: its square would swamp the component's metrics
        ({"accuracy": -2e9}, "bad_value"),
        ({"": 1.0}, "malformed"),  # a component needs a name
        ({f"f{i}": 1.0 for i in range(65)}, "malformed"),  # past the bound on components
    ],
)
def test_bad_reward_components_are_rejected(components, reason):
    codec = WireCodec(1 << 20)
    g = rollout()
    g.samples[0].reward_components = components
    with pytest.raises(WireError, match="reward_components") as err:
        codec.decode(codec.encode(g))
    assert err.value.reason == reason
