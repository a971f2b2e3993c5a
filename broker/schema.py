"""The wire schema: every message between learner and actors, defined once.

Encoding is msgpack (msgspec) with numpy arrays as raw little-endian buffers plus dtype and
shape. No pickle and no eval on any network path. Every message carries `schema_version`;
`WireCodec.decode` rejects unknown versions, wrong dtypes, mismatched lengths and oversized
frames with a `WireError` that names the problem, and counts each rejection by reason.
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from typing import Annotated, Literal, NamedTuple

import msgspec
import numpy as np
from msgspec import Meta

SCHEMA_VERSION = 11  # 2: eval groups carry eval_version; grants no longer carry weights. 3: a rollout's
# token ids and logprobs are one buffer per group. 4: a weight update comes from one learner rank (no sources).
# 5: a sample may carry its episode's counts (turns, tool calls). 6: a weight update carries the channel's
# token, and each byte range its sha256 (was a crc32). 7: a sample carries each reward function's value
# (reward_components). 8: an nccl weight update carries a keyed tag per tensor and the version's tag key;
# a weight update may be a LoRA adapter alone (adapter). 9: sampling carries top_k (an actor that ignored it
# would sample from another distribution than the learner scores). 10: a rollout carries when its generation
# ended (finished_at); a heartbeat, where the actor's time went (its flow seconds). 11: a file weight update
# may name a delta from an earlier version (delta_of, delta_location, delta_parts)


# Bounds every decoded value must keep: a frame that breaks one is rejected at decode ("malformed",
# naming the field), before any code sees it.
MAX_DIMS = 8
Dim = Annotated[int, Meta(ge=0, le=2**40)]  # an array dimension
Count = Annotated[int, Meta(ge=0, le=2**62)]  # a count or byte offset
Version = Annotated[int, Meta(ge=0, le=2**31 - 1)]  # a policy version: optimizer steps
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Id = Annotated[str, Meta(min_length=1, max_length=256)]  # run and group ids
ActorId = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@-]*$")]
Text = Annotated[str, Meta(max_length=65_536)]
Seconds = Annotated[float, Meta(ge=0, le=1e9)]  # NaN and inf fail these bounds too
Timestamp = Annotated[float, Meta(ge=0, le=1e11)]  # wall-clock seconds since the epoch (time.time())
# A reward component's name becomes a metric name (rewards/<name>/mean): letters, digits and _ . : -, as a
# Python function or an entry point is named, so no name is a path or a character a tracking store refuses.
# Checked by the learner (tidal.learner.rank0.validation), which says which name, rather than here at decode.
COMPONENT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*")
MAX_COMPONENT = 1e9  # a reward component's magnitude: well past any score, short of squares that overflow a sum
Info = Annotated[dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=1024)]], Meta(max_length=32)]
F4 = np.dtype("<f4")
# RolloutGroup.check's dot product overflows on absurd logprobs (then tested one by one): not worth a warning
warnings.filterwarnings("ignore", r"(overflow|invalid value) encountered in dot", RuntimeWarning, re.escape(__name__))
ITEMSIZE = {"i4": 4, "f4": 4, "i8": 8, "f8": 8, "u1": 1, "f2": 2}


class WireError(ValueError):
    """A frame that cannot be accepted; `reason` is a short key for counting."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Array(msgspec.Struct, frozen=True):
    """A numpy array as raw little-endian bytes."""

    dtype: Annotated[str, Meta(max_length=8)]
    shape: Annotated[tuple[Dim, ...], Meta(max_length=MAX_DIMS)]
    data: bytes

    @classmethod
    def of(cls, arr: np.ndarray) -> Array:
        arr = np.ascontiguousarray(arr)
        le = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        return cls(le.dtype.str.lstrip("<|"), tuple(arr.shape), le.tobytes())

    @property
    def num_elements(self) -> int:
        """Elements the bytes hold (checked against the shape by `numpy`)."""
        return len(self.data) // ITEMSIZE.get(self.dtype, 1)

    def numpy(self, expect: str, field: str) -> np.ndarray:
        """Decode, checking the dtype is `expect` (e.g. 'i4') and the byte count fits the shape
        before anything is reshaped (dimensions are non-negative and few, by type)."""
        if self.dtype != expect:
            raise WireError("bad_dtype", f"{field}: dtype {self.dtype!r}, expected {expect!r}")
        count = math.prod(self.shape)  # Python ints: no wrap-around
        if count * ITEMSIZE[expect] != len(self.data):
            raise WireError("bad_length", f"{field}: {len(self.data)} bytes for shape {self.shape}")
        return np.frombuffer(self.data, dtype=np.dtype("<" + expect)).reshape(self.shape)

    def vector_length(self, expect: str, field: str, reason: str = "bad_length") -> int:
        """The checks of `numpy` for a 1-D array, without building one (rollouts carry thousands of
        them); `reason` is the error when it is not 1-D. Returns its length."""
        if self.dtype != expect:
            raise WireError("bad_dtype", f"{field}: dtype {self.dtype!r}, expected {expect!r}")
        if len(self.shape) != 1:
            raise WireError(reason, f"{field}: shape {self.shape}, expected one dimension")
        if self.shape[0] * ITEMSIZE[expect] != len(self.data):
            raise WireError("bad_length", f"{field}: {len(self.data)} bytes for shape {self.shape}")
        return self.shape[0]


def int32s(values) -> Array:
    return Array.of(np.asarray(values, dtype=np.int32))


def float32s(values) -> Array:
    return Array.of(np.asarray(values, dtype=np.float32))


class Message(msgspec.Struct, tag_field="kind", kw_only=True):
    schema_version: Annotated[int, Meta(ge=0, le=2**31)] = SCHEMA_VERSION

    def check(self) -> None:
        """Field-level invariants that types alone do not express."""


class InterruptParams(msgspec.Struct, frozen=True):
    """ScaleRL forced interruption: a sample still going at its thinking budget gets `tokens`
    appended and continues for at most `answer_tokens` more."""

    tokens: Annotated[tuple[TokenId, ...], Meta(max_length=4096)]  # the interruption text, tokenized by the learner
    text: Text  # the same text, so the reward sees the completion as the model read it
    min_think_tokens: Count  # each sample's thinking budget is drawn uniformly from
    max_think_tokens: Count  # [min_think_tokens, max_think_tokens]
    answer_tokens: Count  # generation budget after the interruption


class SamplingParams(msgspec.Struct, frozen=True):
    temperature: Annotated[float, Meta(gt=0, le=100)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    max_tokens: Annotated[int, Meta(ge=1, le=2**24)] = 16  # cap on every completion's length, all included
    stop_token_ids: Annotated[tuple[TokenId, ...], Meta(max_length=256)] = ()
    interrupt: InterruptParams | None = None  # None: no forced interruptions (eval groups by default)
    overlong_buffer_tokens: Count = 0  # DAPO's L_cache; 0: no overlong penalty on the reward
    top_k: Annotated[int, Meta(ge=0, le=2**24)] = 0  # keep the k most likely tokens before top_p; 0: all

    def check(self) -> None:
        """Length-control settings that could not be honoured; reasons name the field and value."""
        if not 0 <= self.overlong_buffer_tokens < self.max_tokens:
            raise WireError(
                "bad_value",
                f"sampling.overlong_buffer_tokens {self.overlong_buffer_tokens} "
                f"not in [0, max_tokens {self.max_tokens})",
            )
        it = self.interrupt
        if it is None:
            return
        if not (it.tokens and 1 <= it.min_think_tokens <= it.max_think_tokens and it.answer_tokens >= 1):
            raise WireError(
                "bad_value",
                f"sampling.interrupt: {len(it.tokens)} tokens, think budget "
                f"[{it.min_think_tokens}, {it.max_think_tokens}], answer_tokens {it.answer_tokens}",
            )
        longest = it.max_think_tokens + len(it.tokens) + it.answer_tokens
        if longest > self.max_tokens:
            raise WireError(
                "bad_value",
                f"sampling.interrupt: max_think_tokens {it.max_think_tokens} + "
                f"{len(it.tokens)} interruption tokens + answer_tokens {it.answer_tokens} = "
                f"{longest} > max_tokens {self.max_tokens}",
            )


class PromptGroup(Message, tag="prompt_group"):
    run_id: Id
    group_id: Id  # unique; the idempotency key
    prompt_id: Count
    prompt_tokens: Array  # int32 [prompt_len]
    task: Annotated[str, Meta(max_length=256)]  # the task's name (task.name)
    # what the reward needs, e.g. {"answer": "85"}
    payload: Annotated[dict[Annotated[str, Meta(max_length=256)], Text], Meta(max_length=64)]
    n: Annotated[int, Meta(ge=1, le=4096)]  # samples to generate
    sampling: SamplingParams
    min_version: Version  # start only once the actor runs weights of at least this version
    eval_version: Version | None = None  # set on eval groups: the policy version evaluated (never trained on)

    @property
    def is_eval(self) -> bool:
        return self.eval_version is not None

    def check(self) -> None:
        if self.prompt_tokens.vector_length("i4", "prompt_tokens", reason="bad_shape") == 0:
            raise WireError("bad_shape", f"prompt_tokens shape {self.prompt_tokens.shape}")
        if self.n < 1:
            raise WireError("bad_value", f"n = {self.n}")
        self.sampling.check()


class Episode(msgspec.Struct, frozen=True, gc=False):
    """How a sample's episode went (environments of several turns; None for a single-turn task)."""

    turns: Annotated[int, Meta(ge=1, le=65_536)]  # model turns
    tool_calls: Annotated[int, Meta(ge=0, le=2**20)] = 0
    tool_errors: Annotated[int, Meta(ge=0, le=2**20)] = 0  # answered with an error: unknown tool, bad arguments, raised
    tool_timeouts: Annotated[int, Meta(ge=0, le=2**20)] = 0
    env_seconds: Seconds = 0.0  # time in the environment's start and steps and in tools
    # why the environment failed the episode (raised or timed out; its reward is then 0.0); "" when it did not
    env_error: Annotated[str, Meta(max_length=512)] = ""


class Sample(msgspec.Struct, kw_only=True, gc=False):
    """One completion's own fields. Its token ids and logprobs are a slice of its group's buffers
    (`RolloutGroup.tokens`, `.logprobs`): one buffer per group costs a decoder a fraction of one per
    sample, at thousands of groups a second. gc=False: a sample refers to nothing that refers back."""

    num_tokens: Count  # completion tokens: its slice of the group's buffers, in sample order
    # (version, start, end) over completion tokens
    version_spans: Annotated[list[tuple[Version, Count, Count]], Meta(max_length=65_536)]
    reward: float  # what the learner trains on: the task reward plus any overlong penalty
    # stop: ended by a stop token, never interrupted. interrupted: interrupted, then ended by a stop
    # token. length: reached the completion's final budget without a stop token (a truncation).
    finish_reason: Literal["stop", "length", "interrupted"]
    # [start, end) ranges of completion tokens the actor injected (interruption text): part of the
    # sequence the model read, never trained on; their behavior logprobs are 0.0
    injected_spans: Annotated[list[tuple[Count, Count]], Meta(max_length=1024)] = []
    raw_reward: float | None = None  # the task's reward before length shaping; None: equal to `reward`
    episode: Episode | None = None  # environments of several turns: how the episode went
    # task.reward_funcs: each function's own (unweighted) value, by the function's name; empty otherwise
    reward_components: Annotated[
        dict[Annotated[str, Meta(min_length=1, max_length=128)], float], Meta(max_length=64)
    ] = {}

    @property
    def task_reward(self) -> float:
        """The task's own reward (pass rates are computed from it, not from the shaped one)."""
        return self.reward if self.raw_reward is None else self.raw_reward

    def injected_mask(self) -> np.ndarray:
        """bool [completion_len]: True where the actor injected the token."""
        out = np.zeros(self.num_tokens, dtype=bool)
        for start, end in self.injected_spans:
            out[start:end] = True
        return out

    def spans_several_versions(self) -> bool:
        """True when a weight update landed while this sample was being generated."""
        return len({version for version, _, _ in self.version_spans}) > 1

    def check(self) -> None:
        """Spans and finish reason; errors name fields within the sample (the group adds which one).
        Its buffers' lengths and finiteness are the group's checks, over all its samples at once."""
        size, covered = self.num_tokens, 0
        for version, start, end in self.version_spans:
            if start != covered or end < start or version < 0:
                raise WireError("bad_spans", f"version_spans {self.version_spans}")
            covered = end
        if covered != size:
            raise WireError("bad_spans", f"spans cover {covered} of {size} tokens")
        previous_end = 0  # injected spans: sorted, disjoint, non-empty and inside the completion
        for start, end in self.injected_spans:
            if not previous_end <= start < end <= size:
                raise WireError("bad_spans", f"injected_spans {self.injected_spans} (completion of {size} tokens)")
            previous_end = end
        if self.episode is not None and self.episode.tool_errors + self.episode.tool_timeouts > self.episode.tool_calls:
            raise WireError(
                "bad_value",
                f"episode: {self.episode.tool_errors} errors and "
                f"{self.episode.tool_timeouts} timeouts of {self.episode.tool_calls} tool calls",
            )
        if self.finish_reason == "interrupted" and not self.injected_spans:
            raise WireError("bad_value", "finish_reason 'interrupted' without injected_spans")
        if not math.isfinite(self.reward) or (self.raw_reward is not None and not math.isfinite(self.raw_reward)):
            raise WireError("bad_value", f"non-finite reward {self.reward} (raw_reward {self.raw_reward})")
        bad = [name for name, value in self.reward_components.items() if not abs(value) <= MAX_COMPONENT]
        if bad:  # NaN fails the comparison too
            raise WireError(
                "bad_value",
                f"reward_components[{bad[0]!r}] {self.reward_components[bad[0]]} is not "
                f"a finite number within +-{MAX_COMPONENT:g}",
            )

    def versions(self) -> np.ndarray:
        """int64 [completion_len]: the weight version that produced each token."""
        out = np.empty(self.num_tokens, dtype=np.int64)
        for version, start, end in self.version_spans:
            out[start:end] = version
        return out


class SampleArrays(NamedTuple):
    """A sample with its completion's token ids (int32) and behavior logprobs (float32): how a
    group is built (`RolloutGroup.pack`) and read (`RolloutGroup.unpack`)."""

    sample: Sample
    tokens: np.ndarray
    logprobs: np.ndarray

    @classmethod
    def of(cls, tokens, logprobs, **fields) -> SampleArrays:
        """From any array-likes and the sample's other fields (its num_tokens is counted here)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        return cls(Sample(num_tokens=len(tokens), **fields), tokens, np.asarray(logprobs, dtype=np.float32))


class RolloutGroup(Message, tag="rollout_group"):
    group_id: Id
    prompt_id: Count
    actor_id: ActorId
    prompt_tokens: Array  # int32 [prompt_len]
    samples: Annotated[list[Sample], Meta(min_length=1, max_length=4096)]
    tokens: Array  # int32 [sum of num_tokens]: every sample's completion token ids, in sample order
    logprobs: Array  # float32, the same layout: behavior logprobs after temperature
    eval_version: Version | None = None  # copied from the PromptGroup: the policy version being evaluated
    gen_seconds: Seconds = 0.0  # wall time from the first request to the last sample
    queue_seconds: Seconds = 0.0  # wall time the group waited at the actor before starting
    # the actor's wall clock when the group's generation ended (0: not said): how old a sample is when it
    # trains; the learner bounds it by its own release time, so a skewed or lying clock cannot age a group
    # past it
    finished_at: Timestamp = 0.0

    @classmethod
    def pack(cls, samples: list[SampleArrays], **fields) -> RolloutGroup:
        """A group of `samples`, each one's arrays laid end to end in the group's buffers."""
        for i, (s, tokens, logprobs) in enumerate(samples):
            if not len(tokens) == len(logprobs) == s.num_tokens:
                raise ValueError(
                    f"samples[{i}]: {len(tokens)} tokens, {len(logprobs)} logprobs, num_tokens {s.num_tokens}"
                )
        return cls(
            samples=[s.sample for s in samples],
            tokens=int32s(np.concatenate([s.tokens for s in samples])),
            logprobs=float32s(np.concatenate([s.logprobs for s in samples])),
            **fields,
        )

    def unpack(self) -> list[SampleArrays]:
        """Each sample with read-only views of its slice of the group's buffers."""
        tokens, logprobs = self.tokens.numpy("i4", "tokens"), self.logprobs.numpy("f4", "logprobs")
        out, start = [], 0
        for s in self.samples:
            end = start + s.num_tokens
            out.append(SampleArrays(s, tokens[start:end], logprobs[start:end]))
            start = end
        return out

    @property
    def is_eval(self) -> bool:
        return self.eval_version is not None

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_tokens.num_elements

    def check(self) -> None:
        if self.prompt_tokens.vector_length("i4", "prompt_tokens", reason="bad_shape") == 0:
            raise WireError("bad_shape", f"prompt_tokens shape {self.prompt_tokens.shape}")
        size = self.tokens.vector_length("i4", "tokens")
        if self.logprobs.vector_length("f4", "logprobs") != size:
            raise WireError("bad_length", f"{self.tokens.shape} tokens, {self.logprobs.shape} logprobs")
        total = 0
        for i, s in enumerate(self.samples):
            try:
                s.check()
            except WireError as err:
                raise WireError(err.reason, f"samples[{i}]: {err.detail}") from None
            total += s.num_tokens
        if total != size:
            raise WireError("bad_length", f"samples count {total} tokens, the group's buffers hold {size}")
        # one dot product over every logprob of the group: NaN or an infinity anywhere makes it
        # non-finite. So do magnitudes no logprob has (beyond ~1e19, squared past float32's range):
        # only then is each value tested
        logprobs = np.frombuffer(self.logprobs.data, dtype=F4)
        if not math.isfinite(logprobs.dot(logprobs)) and not np.isfinite(logprobs).all():
            bad = next(i for i, (_, _, mine) in enumerate(self.unpack()) if not np.isfinite(mine).all())
            raise WireError("bad_value", f"samples[{bad}]: non-finite logprob")


class TensorSpec(msgspec.Struct, frozen=True):
    name: Annotated[str, Meta(max_length=1024)]
    dtype: Annotated[str, Meta(max_length=16)]
    shape: Annotated[tuple[Dim, ...], Meta(max_length=MAX_DIMS)]
    offset: Count  # byte offset of the data inside the file (the network channels: the payload)
    nbytes: Count


DIGEST_BYTES = 32  # a sha256
TOKEN_BYTES = 32  # a weight channel's token: random bytes the learner draws once per process
TAG_KEY_BYTES = TAG_BYTES = 16  # an nccl tensor tag's key and the tag: two 61-bit field elements each


class WeightBucket(msgspec.Struct, frozen=True):
    """One byte range of a version's payload (or file), fetched and checked on its own. Its digest
    travels over the broker, whose peers are authenticated: whoever can write the weights folder
    or sit on the data path cannot make altered bytes match it."""

    offset: Count  # where the range starts in the payload
    nbytes: Count
    sha256: Annotated[bytes, Meta(min_length=DIGEST_BYTES, max_length=DIGEST_BYTES)]  # of the range's bytes


class DeltaPart(msgspec.Struct, frozen=True):
    """Where one bucket's delta lies in a delta file (the file channel's `weights.delta`): nbytes 0 where
    the bucket did not shrink and is read whole from the version's own file."""

    offset: Count
    nbytes: Count


class AdapterSpec(msgspec.Struct, frozen=True):
    """A weight update that is a LoRA adapter: its manifest holds the adapter's tensors alone, under
    PEFT's names (base_model.model.<module>.lora_A.weight / lora_B.weight), served over the engine's
    own base model."""

    rank: Annotated[int, Meta(ge=1, le=65_536)]
    alpha: Annotated[float, Meta(gt=0, le=1e6)]
    target_modules: Annotated[tuple[Annotated[str, Meta(max_length=128)], ...], Meta(min_length=1, max_length=256)]


class WeightUpdate(Message, tag="weight_update"):
    version: Version
    transport: Annotated[str, Meta(max_length=32)]  # "file" | "tcp" | "gloo" | "nccl"
    # file: path of the safetensors file; the network channels: the learner's host:port
    location: Annotated[str, Meta(max_length=4096)]
    manifest: Annotated[list[TensorSpec], Meta(max_length=1_000_000)]  # network channels: offsets inside the payload
    checksum: Annotated[str, Meta(max_length=128)]  # unused ("", see buckets); kept for the wire's sake
    # which learner process announced it: a resumed learner counts versions again from its
    # checkpoint, and actors that outlived the crash must load those over higher, abandoned ones
    incarnation: Annotated[str, Meta(max_length=64)] = ""
    # the payload's (tcp, gloo) or file's (file) byte ranges in order, each with its own sha256; gloo's
    # hold whole tensors. None for nccl, whose chunks vLLM's packing cuts from the manifest
    buckets: Annotated[list[WeightBucket], Meta(max_length=1_000_000)] = []
    # the network channels (tcp, gloo, nccl): the secret every request to the learner's weight port
    # must carry (TOKEN_BYTES); it travels only in this announcement, over the authenticated broker
    token: Annotated[bytes, Meta(max_length=TOKEN_BYTES)] = b""
    # nccl, whose bytes land in device memory: a keyed tag per manifest tensor (weights/tags.py), under a
    # key drawn for this version alone; both travel only here, over the authenticated broker
    tag_key: Annotated[bytes, Meta(max_length=TAG_KEY_BYTES)] = b""
    tags: Annotated[
        list[Annotated[bytes, Meta(min_length=TAG_BYTES, max_length=TAG_BYTES)]], Meta(max_length=1_000_000)
    ] = []
    adapter: AdapterSpec | None = None  # a LoRA adapter's tensors alone (learner.lora), not the whole policy
    # file: the version this one is also written as a delta from (-1: none), that delta's file, and where each
    # bucket's part of it lies (one per bucket); what the parts rebuild is checked by the buckets' sha256s
    delta_of: Annotated[int, Meta(ge=-1, le=2**62)] = -1
    delta_location: Annotated[str, Meta(max_length=4096)] = ""
    delta_parts: Annotated[list[DeltaPart], Meta(max_length=1_000_000)] = []


class Heartbeat(Message, tag="heartbeat"):
    """Sent at start (hello) and every actor.heartbeat_s seconds."""

    actor_id: ActorId
    version: Version  # the weight version the engine runs
    engine: Info  # engine info: model, device, vllm version, pid
    outstanding: Annotated[list[Id], Meta(max_length=65_536)]  # group ids accepted and not yet published
    num_generated_tokens: Count = 0
    weight_swap_paused_s: Seconds = 0.0  # how long the engine was paused by the latest weight swap
    hello: bool = False
    # where the actor's time went since it started (its flow metrics): seconds in all, holding no work,
    # with every group it held waiting for newer weights, and paused for weight swaps; the latest update's
    # seconds from taking it up to loaded
    uptime_s: Seconds = 0.0
    work_wait_s: Seconds = 0.0
    weights_wait_s: Seconds = 0.0
    weight_pause_s: Seconds = 0.0
    weight_pulls_s: Seconds = 0.0  # every update's seconds from taking it up to loaded, in all
    weight_pull_s: Seconds = 0.0


class WorkRequest(Message, tag="work_request"):
    actor_id: ActorId
    max_samples: Annotated[int, Meta(ge=0, le=2**24)]  # free generation slots; groups are granted while their n fit


class WorkGrant(Message, tag="work_grant"):
    groups: Annotated[list[PromptGroup], Meta(max_length=65_536)]

    def check(self) -> None:
        for group in self.groups:
            group.check()


class Shutdown(Message, tag="shutdown"):
    reason: Annotated[str, Meta(max_length=4096)]


AnyMessage = PromptGroup | RolloutGroup | WeightUpdate | Heartbeat | WorkRequest | WorkGrant | Shutdown


class _Header(msgspec.Struct):
    schema_version: int = -1
    kind: str = "?"


class WireCodec:
    """Encodes messages and decodes frames, counting every rejected frame by reason."""

    def __init__(self, max_message_bytes: int):
        self.max_message_bytes = max_message_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(AnyMessage)
        self._header = msgspec.msgpack.Decoder(_Header)
        self.rejected: Counter[str] = Counter()

    def encode(self, msg: Message) -> bytes:
        frame = self._encoder.encode(msg)
        if len(frame) > self.max_message_bytes:
            raise WireError(
                "oversized",
                f"{type(msg).__name__} is {len(frame)} bytes > broker.max_message_bytes {self.max_message_bytes}",
            )
        return frame

    def decode(self, frame: bytes | memoryview, expect: type | tuple[type, ...] = Message) -> AnyMessage:
        try:
            msg = self._decode(frame)
            if not isinstance(msg, expect):
                raise WireError("unexpected_kind", f"got {type(msg).__name__}")
            msg.check()
            return msg
        except WireError as err:
            self.rejected[err.reason] += 1
            raise

    def _decode(self, frame) -> AnyMessage:
        if len(frame) > self.max_message_bytes:
            raise WireError(
                "oversized", f"frame of {len(frame)} bytes > broker.max_message_bytes {self.max_message_bytes}"
            )
        try:
            msg = self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            try:
                header = self._header.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError):
                raise WireError("malformed", f"not a tidal message ({err})") from None
            if header.schema_version != SCHEMA_VERSION:
                raise WireError(
                    "schema_version", f"schema_version {header.schema_version} (this build speaks {SCHEMA_VERSION})"
                ) from None
            raise WireError("malformed", f"{header.kind}: {err}") from None
        if msg.schema_version != SCHEMA_VERSION:
            raise WireError(
                "schema_version", f"schema_version {msg.schema_version} (this build speaks {SCHEMA_VERSION})"
            )
        return msg
