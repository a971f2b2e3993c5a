"""Decoding never crashes: mutated frames of every message type, seeded, are either decoded into
a message that passes its checks or rejected with a counted WireError, nothing else. And the
mutated rollouts that decode and pass the learner's validator train: a bounded number of them go
through a real `Trainer.step` of the tiny model, which must not raise nor give a non-finite metric.

Mutations come in two kinds: bytes (flips, truncation, insertion, splices of two frames) and
structure (the frame decoded to plain msgpack values, one leaf replaced by a hostile value: huge
or negative integers, NaN, deep nesting, wrong types, long strings, then encoded again)."""

import copy
import math
import random
import time
from collections import Counter

import msgspec
import pytest

from conftest import ALPHABET, TINY, prompt_group, rollout
from tidal.broker.schema import (
    Episode,
    Heartbeat,
    InterruptParams,
    PromptGroup,
    RolloutGroup,
    SampleArrays,
    SamplingParams,
    Shutdown,
    TensorSpec,
    WeightUpdate,
    WireCodec,
    WireError,
    WorkGrant,
    WorkRequest,
    int32s,
)
from tidal.config import LearnerConfig, LossConfig, LossType
from tidal.learner.every_rank.trainer import Trainer
from tidal.learner.rank0.coordinator import release_of
from tidal.learner.rank0.validation import Validator
from tidal.tiny import build_tiny_model

FRAMES_PER_KIND = 10_000
MAX_REPLAYED_ROLLOUTS = 32  # distinct accepted rollouts trained on (tens of ms a step)
REPLAY_VERSION = 3  # the learner's version: the valid rollout's newest tokens are of it
INTERRUPT = InterruptParams((3, 4), "==", 1, 2, 2)


def valid_messages() -> dict[str, object]:
    group = prompt_group(1)
    group.sampling = SamplingParams(0.9, 1.0, 8, (1,), INTERRUPT, 2)
    sample = SampleArrays.of(
        [3, 4, 5, 1],
        [-0.1, 0.0, 0.0, -0.3],
        version_spans=[(2, 0, 1), (3, 1, 4)],
        reward=1.0,
        finish_reason="interrupted",
        injected_spans=[(1, 3)],
        raw_reward=1.0,
    )
    # a sample of an episode: two model turns around a tool's reply (injected), and how the episode went
    episode = SampleArrays.of(
        [3, 4, 7, 7, 5, 1],
        [-0.1, -0.2, 0.0, 0.0, -0.4, -0.3],
        version_spans=[(2, 0, 6)],
        reward=1.0,
        finish_reason="stop",
        injected_spans=[(2, 4)],
        episode=Episode(turns=2, tool_calls=1, tool_errors=0, tool_timeouts=1, env_seconds=0.25, env_error=""),
    )
    one = rollout()
    two = RolloutGroup.pack(
        [*one.unpack(), sample, episode],
        group_id=one.group_id,
        prompt_id=one.prompt_id,
        actor_id=one.actor_id,
        prompt_tokens=one.prompt_tokens,
        gen_seconds=1.0,
    )
    return {
        "prompt_group": group,
        "rollout_group": two,
        "weight_update": WeightUpdate(
            version=7,
            transport="file",
            location="/dev/shm/w/weights-v000007.safetensors",
            manifest=[TensorSpec("a.weight", "F32", (4, 8), 64, 128)],
            checksum="ab" * 32,
            incarnation="f00d",
        ),
        "heartbeat": Heartbeat(
            actor_id="actor-0",
            version=3,
            engine={"vllm": "0.32.0"},
            outstanding=["r-1", "r-2"],
            num_generated_tokens=12,
            weight_swap_paused_s=0.01,
            hello=True,
        ),
        "work_request": WorkRequest(actor_id="actor-0", max_samples=16),
        "work_grant": WorkGrant(groups=[prompt_group(2), prompt_group(3, n=2)]),
        "shutdown": Shutdown(reason="learner finished"),
    }


HOSTILE = [
    2**63,
    -(2**63),
    2**64 - 1,
    -1,
    0,
    2**31,
    float("nan"),
    float("inf"),
    -float("inf"),
    1e308,
    "",
    "x" * 5000,
    b"\x00" * 7,
    None,
    True,
    [],
    [[[[[[[[[[[]]]]]]]]]]],
    {},
    {"kind": "shutdown"},
    3.5,
    [-1, -2],
    [2**62, 4],
    list(range(70)),
]


def leaves(value, path=()):
    """(path, value) of every leaf of a msgpack tree."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, (*path, i))
    yield path, value


def replaced(tree, path, new):
    if not path:
        return new
    head, *rest = path
    copy = dict(tree) if isinstance(tree, dict) else list(tree)
    copy[head] = replaced(tree[head], rest, new)
    return copy


def mutate(frame: bytes, rng: random.Random, others: list[bytes]) -> bytes:
    kind = rng.choices(range(6), weights=(1, 1, 1, 1, 4, 2))[0]  # structural mutations reach the checks
    data = bytearray(frame)
    if kind == 0:  # flip bits
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == 1:  # truncate
        return bytes(data[: rng.randrange(len(data))])
    if kind == 2:  # insert random bytes
        i = rng.randrange(len(data) + 1)
        return bytes(data[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) + data[i:])
    if kind == 3:  # splice with another frame
        other = rng.choice(others)
        return bytes(data[: rng.randrange(len(data))] + other[rng.randrange(len(other)) :])
    tree = msgspec.msgpack.decode(frame)
    path, _ = rng.choice(list(leaves(tree)))
    if kind == 4:
        return msgspec.msgpack.encode(replaced(tree, path, rng.choice(HOSTILE)))
    # structure-aware: arrays whose shape lies about their bytes
    shape = rng.choice([(-2, -2), (2**62, 4), tuple([1] * 65), (0,), (3, 0, 5), (2**31, 2**31)])
    return msgspec.msgpack.encode(replaced(tree, path, {"dtype": "i4", "shape": list(shape), "data": b"\x01" * 16}))


# huge logprobs overflow the check's dot product (then each value is tested); the schema silences
# that warning itself, but pytest shows every warning
@pytest.mark.filterwarnings("ignore:overflow encountered in dot")
def test_every_mutated_frame_is_a_message_or_a_counted_wire_error(accelerator):
    codec = WireCodec(1 << 20)
    frames = {kind: codec.encode(msg) for kind, msg in valid_messages().items()}
    for frame in frames.values():  # the originals decode and pass their checks
        codec.decode(frame)
    rng = random.Random(0)
    crashes, outcomes, start = [], Counter(), time.monotonic()
    admitted = AdmittedRollouts()
    for kind, frame in frames.items():
        for _ in range(FRAMES_PER_KIND):
            bad = mutate(frame, rng, list(frames.values()))
            try:
                admitted.offer(bad, codec.decode(bad))
                outcomes["decoded"] += 1
            except WireError as err:
                outcomes[err.reason] += 1
            except Exception as err:  # noqa: BLE001 (any other exception is the failure this test looks for)
                crashes.append((kind, type(err).__name__, str(err)[:100], bad[:60]))
    elapsed = time.monotonic() - start
    print(
        f"\n{FRAMES_PER_KIND * len(frames)} mutated frames in {elapsed:.1f} s: {dict(outcomes)}; {len(crashes)} crashes"
    )
    assert crashes == [], Counter((k, t) for k, t, _, _ in crashes).most_common(10)
    assert sum(codec.rejected.values()) == sum(v for k, v in outcomes.items() if k != "decoded")
    print(
        f"{len(admitted.groups)} distinct mutated rollouts passed the validator (kept at most "
        f"{MAX_REPLAYED_ROLLOUTS}); refused: {dict(admitted.validator.rejected)}"
    )
    assert len(admitted.groups) >= 5  # the replay below is not vacuous
    failures = admitted.replay(accelerator)
    assert failures == [], failures


class AdmittedRollouts:
    """Decoded rollouts the learner's validator accepts against the valid rollout's release (distinct
    frames, at most MAX_REPLAYED_ROLLOUTS of them), and their replay through a real training step."""

    def __init__(self):
        released = PromptGroup(
            run_id="r",
            group_id="g1",
            prompt_id=7,
            prompt_tokens=int32s([5, 6]),
            task="arithmetic",
            payload={},
            n=3,
            sampling=SamplingParams(max_tokens=8, interrupt=INTERRUPT),
            min_version=0,
        )
        self.release = release_of(released, 0)
        self.validator = Validator(len(ALPHABET) + 2, 8, (-10.0, 10.0))  # the tiny vocabulary: the alphabet, bos, eos
        self.frames: set[bytes] = set()
        self.groups: list[RolloutGroup] = []

    def offer(self, frame: bytes, msg) -> None:
        if not isinstance(msg, RolloutGroup) or frame in self.frames or len(self.groups) >= MAX_REPLAYED_ROLLOUTS:
            return
        if self.validator.check(msg, self.release, REPLAY_VERSION) is None:
            self.frames.add(frame)
            self.groups.append(msg)

    def replay(self, accelerator) -> list[tuple[int, str]]:
        """(index, what went wrong) of each accepted rollout whose step raised or gave a non-finite metric;
        each trained by a fresh copy of the tiny model under the next loss type."""
        model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
        assert model.config.vocab_size == self.validator.vocab_size
        losses, failures = list(LossType), []
        for i, group in enumerate(self.groups):
            cfg = LearnerConfig(
                groups_per_step=1,
                micro_batch_tokens=16,
                kernel_backend="torch",
                loss=LossConfig(type=losses[i % len(losses)]),
            )
            masks = [[~s.injected_mask() for s in group.samples]]  # as admission leaves them: injected text untrained
            try:
                metrics = Trainer(cfg, copy.deepcopy(model), accelerator, temperature=0.9).step(
                    [group], masks, REPLAY_VERSION
                )
            except Exception as err:  # noqa: BLE001 (any exception is the failure this test looks for)
                failures.append((i, f"{type(err).__name__}: {err}"[:200]))
                continue
            failures += [(i, f"{key} = {value}") for key, value in metrics.items() if not math.isfinite(value)]
        return failures
