"""Keyed tags of weight tensors, for the channel whose bytes land in device memory (nccl): a sha256
there would mean copying every received byte back to the host and hashing it on the CPU inside the
engine's pause; these are computed on the device, by the kernels at hand, as each chunk lands.

A tag is a polynomial hash over the prime field P = 2^61 - 1 of the tensor's bytes, read as 16-bit
words w_0..w_{n-1} (little-endian, a zero byte after an odd last one):

    tag_k(w) = sum_i w_i * k^(i+1)  mod P          one per lane, each lane with a key k of its own

Two different byte strings of n words get the same tag under a random key with probability at most
n/P, for each lane (a difference polynomial of degree n has at most n roots), so LANES = 2 lanes of
a 1 GiB tensor are forged with probability below 2^-60, by someone who knows neither key. The keys
are drawn afresh for every version and travel, with the tags, only in the announcement, over the
authenticated broker; the bytes themselves travel over NCCL's own unauthenticated sockets.

Every step is exact int64 arithmetic (products of 31 bits by 30, sums that stay below 2^63), so
the learner's tags, computed as it packs a version, and a worker's, computed on its GPU as each
chunk arrives, agree bit for bit on any device.
"""

from __future__ import annotations

import secrets

from tidal.broker.schema import TAG_BYTES, TAG_KEY_BYTES

P = (1 << 61) - 1
LANES = 2  # field elements of 8 bytes in a key and in a tag
KEY_BYTES = TAG_KEY_BYTES
assert KEY_BYTES == TAG_BYTES == 8 * LANES
WORDS_PER_BLOCK = 1 << 15  # a block's sum of (16-bit word x 31-bit power) stays below 2^63
BLOCKS_AT_ONCE = 64  # 2M words (4 MiB of the tensor) a pass
# the device memory one pass takes beside the tensor: its words in int64, and a product per lane
SCRATCH_BYTES = (2 + LANES) * 8 * WORDS_PER_BLOCK * BLOCKS_AT_ONCE
M30, M31 = (1 << 30) - 1, (1 << 31) - 1


def new_key() -> bytes:
    """A fresh key: LANES field elements in [1, P)."""
    return b"".join((1 + secrets.randbelow(P - 1)).to_bytes(8, "little") for _ in range(LANES))


def lane_keys(key: bytes) -> list[int]:
    if len(key) != KEY_BYTES:
        raise ValueError(f"a tag key is {KEY_BYTES} bytes, not {len(key)}")
    keys = [int.from_bytes(key[8 * i : 8 * i + 8], "little") for i in range(LANES)]
    if not all(0 < k < P for k in keys):
        raise ValueError("a tag key's lanes must lie in [1, 2^61 - 1)")
    return keys


def _fold(x):
    """x mod P, nearly: x < 2^63 becomes a value below P + 4 congruent to it."""
    return (x & P) + (x >> 61)


def _reduce(x):
    x = _fold(_fold(x))
    return x - P * (x >= P)


def _mulmod(a, b):
    """a * b mod P for int64 tensors with 0 <= a, b < P, in products that fit 63 bits."""
    a0, a1 = a & M31, a >> 31  # a = a1 2^31 + a0, a1 < 2^30
    b0, b1 = b & M31, b >> 31
    mid = a1 * b0 + a0 * b1  # < 2^62, weight 2^31; and mid 2^31 = m1 2^61 + m0 2^31 = m1 + m0 2^31 (mod P)
    return _reduce(_fold(2 * (a1 * b1)) + _fold((mid >> 30) + ((mid & M30) << 31)) + _fold(a0 * b0))


def _sum_mod(x, dim: int = -1):
    """The sum mod P of values in [0, P) along `dim`, in two halves whose sums cannot overflow."""
    import torch

    low = (x & 0xFFFFFFFF).sum(dim)  # < 2^32 a term: fine for 2^31 terms
    high = _reduce((x >> 32).sum(dim))  # < 2^29 a term
    return _reduce(_mulmod(high, torch.full_like(high, 1 << 32)) + _reduce(low))


def _powers(base: int, count: int, device):
    """[base^1, ..., base^count] mod P, on `device`, by doubling (log2(count) steps)."""
    import torch

    out = torch.tensor([base % P], dtype=torch.int64, device=device)
    step = base % P  # base^len(out)
    while len(out) < count:
        out = torch.cat([out, _mulmod(out, torch.full_like(out, step))])
        step = step * step % P
    return out[:count]


def as_bytes(tensor):
    """The tensor's bytes, flat (uint8), without a copy where it is contiguous."""
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def words(data):
    """Bytes (uint8) as 16-bit words in int64, little-endian, a zero byte after an odd last one."""
    import torch

    if len(data) % 2:
        data = torch.cat([data, data.new_zeros(1)])
    if data.storage_offset() % 2 == 0:
        try:
            return data.view(torch.int16).to(torch.int64) & 0xFFFF
        except RuntimeError:  # a view the storage does not align: the slow way below
            pass
    return data[0::2].to(torch.int64) | (data[1::2].to(torch.int64) << 8)


class Tagger:
    """Tags under one key, on one device (the first tensor's, unless named): each `tag` is enqueued
    there (no wait for the device); `digests` waits once and gives the bytes of each."""

    def __init__(self, key: bytes, device=None):
        self.keys, self.device = lane_keys(key), None
        self.pending: list = []
        if device is not None:
            self._on(device)

    def _on(self, device) -> None:
        import torch

        self.device = device
        table = torch.stack([_powers(k, WORDS_PER_BLOCK, device) for k in self.keys])  # [LANES, block]
        self.low, self.high = (table & M31)[:, None, :], (table >> 31)[:, None, :]  # [LANES, 1, block]
        self.block_powers = torch.empty(LANES, 0, dtype=torch.int64, device=device)  # k^(block x b)

    def _block_powers(self, count: int):
        import torch

        if self.block_powers.shape[1] < count:
            count = max(count, 2 * self.block_powers.shape[1])
            self.block_powers = torch.stack(
                [
                    torch.cat(
                        [
                            torch.ones(1, dtype=torch.int64, device=self.device),
                            _powers(pow(k, WORDS_PER_BLOCK, P), count - 1, self.device),
                        ]
                    )
                    for k in self.keys
                ]
            )
        return self.block_powers[:, :count]

    def tag(self, tensor) -> None:
        """Enqueue the tag of `tensor`'s bytes; it is the next of `digests`."""
        import torch

        if self.device is None:
            self._on(tensor.device)
        data = as_bytes(tensor if tensor.device == self.device else tensor.to(self.device))
        step = 2 * WORDS_PER_BLOCK * BLOCKS_AT_ONCE  # bytes a pass: whole blocks, never the whole tensor at once
        sums = []
        for start in range(0, max(len(data), 1), step):
            w = words(data[start : start + step])
            blocks = max(1, -(-len(w) // WORDS_PER_BLOCK))
            w = torch.nn.functional.pad(w, (0, blocks * WORDS_PER_BLOCK - len(w)))[None].view(1, blocks, -1)
            low, high = (w * self.low).sum(-1), (w * self.high).sum(-1)  # [LANES, blocks]: < 2^62, < 2^61
            sums.append(_reduce(_mulmod(_reduce(high), torch.full_like(high, 1 << 31)) + _reduce(low)))
        per_block = torch.cat(sums, dim=1)  # [LANES, blocks]: each block's sum of w x k^(position in it + 1)
        self.pending.append(_sum_mod(_mulmod(per_block, self._block_powers(per_block.shape[1]))))  # [LANES]

    def digests(self) -> list[bytes]:
        """Each tag enqueued since the last call, as TAG_BYTES bytes, in order."""
        import torch

        if not self.pending:
            return []
        tags, self.pending = torch.stack(self.pending).cpu().tolist(), []
        return [b"".join(int(v).to_bytes(8, "little") for v in lanes) for lanes in tags]


def reference_tag(data: bytes, key: bytes) -> bytes:
    """The tag of `data` computed in Python integers, word by word: what `Tagger` must agree with."""
    if len(data) % 2:
        data += b"\0"
    out = b""
    for k in lane_keys(key):
        acc, power = 0, 1
        for i in range(0, len(data), 2):
            power = power * k % P
            acc = (acc + int.from_bytes(data[i : i + 2], "little") * power) % P
        out += acc.to_bytes(8, "little")
    return out
