"""A version sent as what changed since one the actor holds (`weights.delta`), for the channels that
carry whole payloads (tcp, file).

One byte range (a bucket) at a time, from the XOR of the new bytes and the base's, in one of two forms,
then zstd: where few words changed (a small learning rate in bf16: a few percent), the changed words
listed, each as its distance from the last one and its XOR; where many did (fp32, a large learning
rate), every word's XOR with its bytes regrouped by place (every low byte, then every next byte: the
high bytes of a small change become long runs of zeros). A bucket whose encoding is not clearly
smaller travels whole. The actor XORs the decoded words into the copy of the base it holds, and the
result is checked by the same sha256 as a whole version's bucket: a base the actor does not hold
exactly (a torn staging copy, another learner's version) fails that check and the bucket is fetched
whole. Decoding is bounded by the bucket's size (a list of at most a quarter of its words), checked
before anything is allocated.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import zstandard

from tidal.broker.schema import TensorSpec

MAGIC = b"TDX2"
HEADER = struct.Struct("<4sBBQQ")  # magic, form, word width in bytes, the bucket's size, words listed (SPARSE)
SPARSE, PLANES = 1, 2
WIDTHS = (1, 2, 4, 8)
LEVEL = 1  # zstd's fastest levels lose little on XORs that are mostly zeros
SPARSE_SHARE = 0.25  # changed words up to this share of a bucket's are listed, not sent every one
SMALLER = 0.9  # a bucket travels as a delta only when that is at most this share of its bytes
NO_BASE = 2**64 - 1  # a tcp request that names no base: the whole bucket
MAX_GAP = 2**32 - 1  # a listed word's distance from the last one travels in 4 bytes
# threads encoding a version's buckets at once: numpy and zstd let go of the GIL (two take 0.6x the time of one)
ENCODERS = min(4, os.cpu_count() or 1)


class DeltaError(ValueError):
    """An encoded delta that cannot be applied: not tidal's, or for another size."""


def word_width(manifest: list[TensorSpec]) -> int:
    """The byte width of the payload's words: that of the dtype holding the most bytes."""
    from tidal.broker.weights.payload import torch_dtype

    by_dtype: dict[str, int] = {}
    for spec in manifest:
        by_dtype[spec.dtype] = by_dtype.get(spec.dtype, 0) + spec.nbytes
    if not by_dtype:
        return 1
    width = torch_dtype(max(by_dtype, key=by_dtype.get)).itemsize
    return width if width in WIDTHS else 1


def encode(new, base, width: int) -> bytes | None:
    """`new` as a delta from `base` (bytes-like, of one size), or None where that would not be clearly
    smaller than `new` itself."""
    new_bytes, base_bytes = np.frombuffer(new, np.uint8), np.frombuffer(base, np.uint8)
    if len(new_bytes) != len(base_bytes):
        raise DeltaError(f"a delta between {len(new_bytes)} and {len(base_bytes)} bytes")
    xor = np.bitwise_xor(new_bytes, base_bytes)
    count = len(xor) // width
    words, tail = xor[: count * width].view(f"<u{width}"), xor[count * width :]
    changed = np.flatnonzero(words)
    if len(changed) <= SPARSE_SHARE * count and count <= MAX_GAP:
        form, listed = SPARSE, len(changed)
        gaps = np.diff(changed, prepend=0).astype("<u4")
        body = np.concatenate((gaps.view(np.uint8), words[changed].view(np.uint8), tail))
    else:
        form, listed = PLANES, 0
        planes = [(words >> (8 * k)).astype(np.uint8) for k in range(width)] if width > 1 else [words]
        body = np.concatenate((*planes, tail))
    packed = zstandard.ZstdCompressor(level=LEVEL).compress(body.data)
    encoded = HEADER.pack(MAGIC, form, width, len(xor), listed) + packed
    return encoded if len(encoded) <= SMALLER * len(xor) else None


def apply(encoded, into) -> None:
    """XOR the delta `encoded` into `into` (a writable buffer holding the base), which then holds the
    new bytes. Raises DeltaError for a delta that is not tidal's or not of `into`'s size."""
    target = np.frombuffer(into, np.uint8)
    if len(encoded) < HEADER.size:
        raise DeltaError(f"a {len(encoded)}-byte delta is shorter than its header")
    magic, form, width, size, listed = HEADER.unpack_from(encoded)
    count = size // width if width in WIDTHS else 0
    most = SPARSE_SHARE * count if form == SPARSE else 0  # what tidal's encoder lists, at most
    if magic != MAGIC or form not in (SPARSE, PLANES) or not count or size != len(target) or listed > most:
        raise DeltaError(
            f"not a delta for these {len(target)} bytes (magic {magic!r}, form {form}, word width {width}, "
            f"size {size}, {listed} words listed)"
        )
    tail_bytes = size - count * width
    expected = listed * (4 + width) + tail_bytes if form == SPARSE else size
    xor = np.frombuffer(decompressed(memoryview(encoded)[HEADER.size :], expected), np.uint8)
    kind = f"<u{width}"
    words = target[: count * width].view(kind)
    if form == SPARSE:
        at = np.cumsum(xor[: 4 * listed].view("<u4"), dtype=np.int64)
        if listed and at[-1] >= count:
            raise DeltaError(f"a delta that lists word {at[-1]} of {count}")
        words[at] ^= xor[4 * listed : listed * (4 + width)].view(kind)
    elif width == 1:
        np.bitwise_xor(words, xor[:count], out=words)
    else:
        planes = xor[: count * width].reshape(width, -1)
        changed = planes[0].astype(kind)
        for k in range(1, width):
            changed |= planes[k].astype(kind) << (8 * k)
        np.bitwise_xor(words, changed, out=words)
    np.bitwise_xor(target[count * width :], xor[expected - tail_bytes :], out=target[count * width :])


def decompressed(frame, expected: int) -> bytes:
    """The zstd `frame`, which must declare and hold exactly `expected` bytes."""
    try:
        declared = zstandard.frame_content_size(frame)
        body = zstandard.ZstdDecompressor().decompress(frame, max_output_size=expected) if declared == expected else b""
    except zstandard.ZstdError as err:
        raise DeltaError(f"a delta that does not decode: {err}") from err
    if len(body) != expected:
        raise DeltaError(f"a delta that decodes to {len(body)} bytes, not {expected}")
    return body
