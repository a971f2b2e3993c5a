"""A version's payload: every tensor of the policy, in the dtype the actors serve, in one aligned
buffer in the learner's host memory, described by a manifest (name, dtype, shape, byte range).
The network channels serve it; the actors load views of it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from tidal.broker.schema import TensorSpec, WeightBucket, WeightUpdate
from tidal.broker.weights.base import digest

ALIGN_BYTES = 64  # each tensor starts on a 64-byte boundary of the payload, as CPU kernels like
# safetensors' dtype names, as the file channel's manifest writes them
DTYPE_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
WIRE_NAMES = {v: k for k, v in DTYPE_NAMES.items()}


def torch_dtype(name: str):
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"weight tensor dtype {name!r} is not one the weight channels carry: {', '.join(DTYPE_NAMES)}")
    return getattr(torch, DTYPE_NAMES[name])


def layout(tensors) -> tuple[list[TensorSpec], int]:
    """(manifest, payload bytes) of one aligned buffer holding `tensors`, (name, dtype name as the
    manifest writes it, shape) each, in order."""
    specs, offset = [], 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * torch_dtype(dtype).itemsize
        specs.append(TensorSpec(name=name, dtype=dtype, shape=tuple(shape), offset=offset, nbytes=nbytes))
        offset += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return specs, offset


def wire_name(name: str, dtype) -> str:
    """The manifest's name of `dtype` (a torch dtype), the weight named `name` travelling in it."""
    short = str(dtype).removeprefix("torch.")
    if short not in WIRE_NAMES:
        raise ValueError(f"weight tensor {name!r} is {short}, which the weight channels do not carry")
    return WIRE_NAMES[short]


def pack(named_tensors: Mapping | Iterable, dtype: str | None = None, buffer_for=None, entries=None, tag=None):
    """(payload [total] uint8, manifest): every tensor copied once, in `dtype` (None: as it is), into
    one aligned buffer: `buffer_for(total)` (default: fresh host memory). Tied tensors (lm_head =
    embed_tokens) travel under each name. `named_tensors` is a mapping, or (name, tensor) pairs made
    one at a time (a sharded learner gathers each just before it is copied) when `entries`,
    [(name, torch dtype, shape)], describes them beforehand. `tag(tensor)`, where given, sees each
    tensor as it travels (in `dtype`, where it lies: on the training device, not in host memory)."""
    import torch

    if isinstance(named_tensors, Mapping):
        entries = [(name, t.dtype, tuple(t.shape)) for name, t in named_tensors.items()]
        named_tensors = named_tensors.items()
    target = getattr(torch, dtype) if dtype else None
    specs, total = layout((name, wire_name(name, target or t_dtype), shape) for name, t_dtype, shape in entries)
    payload = buffer_for(total) if buffer_for is not None else torch.empty(total, dtype=torch.uint8)
    for spec, (name, tensor) in zip(specs, named_tensors, strict=True):
        if name != spec.name:
            raise ValueError(f"weights packed out of order: {name!r} where {spec.name!r} was announced")
        view = payload[spec.offset : spec.offset + spec.nbytes].view(torch_dtype(spec.dtype)).view(spec.shape)
        if tag is not None:  # cast where it lies first, so that the tag is of the very bytes copied
            tensor = tensor.detach().to(view.dtype)
            tag(tensor)
        view.copy_(tensor.detach())  # converts dtype and device on the way
        end = spec.offset + spec.nbytes
        payload[end : -(-end // ALIGN_BYTES) * ALIGN_BYTES] = 0  # padding
    return payload, specs


def without_aliases(named: Mapping) -> dict:
    """`named` with each tensor under its first name only: a tied weight (lm_head = embed_tokens) once.
    A sharded tensor is told by its own shard's storage."""
    seen, out = set(), {}
    for name, tensor in named.items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


def payload_bytes(update: WeightUpdate) -> int:
    """The payload's size, after checking that the buckets tile it and every tensor lies inside it."""
    return checked_size(update.version, update.manifest, update.buckets)


def checked_size(version: int, manifest: list[TensorSpec], buckets: list[WeightBucket]) -> int:
    """The size of the payload `buckets` tile (the manifest's end where there are none), after checking
    that they do and that every tensor of `manifest` lies inside it, laid out as `layout` lays it."""
    end = 0
    for i, bucket in enumerate(buckets):
        if bucket.offset != end:
            raise ValueError(f"weights v{version}: bucket {i} starts at byte {bucket.offset}, expected {end}")
        end += bucket.nbytes
    specs, total = layout((s.name, s.dtype, s.shape) for s in manifest)
    end = end if buckets else total
    for spec, expected in zip(manifest, specs):
        if (spec.offset, spec.nbytes) != (expected.offset, expected.nbytes) or spec.offset + spec.nbytes > end:
            raise ValueError(
                f"weights v{version}: tensor {spec.name!r} ({spec.dtype} {list(spec.shape)}) at bytes "
                f"[{spec.offset}, {spec.offset + spec.nbytes}) does not fit a {end}-byte payload laid "
                "out as tidal lays one out"
            )
    return end


def tensors_of(manifest: list[TensorSpec], payload, base: int = 0):
    """(name, view into `payload`) per tensor of the manifest, made as they are asked for (a
    replayed copy plan asks for none): nothing is copied. `payload` starts at byte `base` of the
    version's payload (a bucket of it)."""
    return (
        (s.name, payload[s.offset - base : s.offset - base + s.nbytes].view(torch_dtype(s.dtype)).view(s.shape))
        for s in manifest
    )


def tensor_buckets(payload, manifest: list[TensorSpec], bucket_bytes: int) -> list[WeightBucket]:
    """`payload` cut into ranges of whole tensors, each closed once it holds `bucket_bytes` or more
    (or ends the payload), with the sha256 of its bytes: what a collective channel sends and loads
    at once."""
    view = memoryview(payload.numpy())
    ends = [spec.offset for spec in manifest[1:]] + [len(view)]  # each tensor's padding goes with it
    buckets, start = [], 0
    for i, end in enumerate(ends):
        if end - start >= bucket_bytes or i + 1 == len(ends):
            buckets.append(WeightBucket(offset=start, nbytes=end - start, sha256=digest(view[start:end])))
            start = end
    return buckets


def in_bucket(manifest: list[TensorSpec], bucket: WeightBucket) -> list[TensorSpec]:
    """The tensors lying in `bucket` (a range of whole tensors)."""
    return [s for s in manifest if bucket.offset <= s.offset < bucket.offset + bucket.nbytes]
