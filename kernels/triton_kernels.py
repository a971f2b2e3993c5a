"""Triton backend: fused logits -> (logprob, entropy) forward and backward, tiled over tokens
and vocab; the [T, V] logits exist only as [BLOCK_T, BLOCK_V] register tiles.

Kernels (same math as tidal.kernels.chunked, which is easier to read):
  forward   grid (token tiles, vocab splits): online (max, sum exp, sum exp * shifted logit)
            per token over the split's vocab range; a few [splits, T] partials are merged in
            torch, so short T still fills the GPU.
  dhidden   grid (token tiles): each program owns its rows of dhidden and walks the vocab.
  dweight   grid (vocab tiles): each program owns its rows of dweight and walks the tokens.
Each backward kernel recomputes its logits tiles. Owning the output rows, instead of atomically
adding into them, makes the gradients deterministic (bitwise reproducible) at the cost of one
extra logits recompute; the accumulators are fp32 in global memory because D (up to several
thousand) does not fit in registers.

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (the tests do this); tiles are
cast to fp32 before tl.dot there because the interpreter mishandles bf16 dots.
"""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Blocks:
    """Tile sizes; tl.dot needs every dimension >= 16."""

    tokens: int
    vocab: int
    dim: int
    num_warps: int = 4


# Small tiles under the interpreter so the tests cross many tile edges in small shapes.
INTERPRET_BLOCKS = Blocks(tokens=16, vocab=32, dim=32)
# Timed on an H200 (bench/kernels.py --blocks) at T x D x V = 8192 x 4096 x 151936 and
# 4096 x 896 x 151936: 64 x 256 x 64 with 8 warps took 0.62-0.64 of the time of the 64 x 128 x 32
# tiles first chosen offline in bf16 (0.69-0.71 of the naive backend's), with the same errors;
# in fp32, 128 x 128 x 32 took 0.70 of 64 x 64 x 32, still 6.7x the naive backend (whose cuBLAS
# matmuls beat exact-fp32 tl.dot), which is why backend "auto" takes the chunked torch one in fp32.
GPU_BLOCKS = {
    torch.bfloat16: Blocks(tokens=64, vocab=256, dim=64, num_warps=8),
    torch.float16: Blocks(tokens=64, vocab=256, dim=64, num_warps=8),
    torch.float32: Blocks(tokens=128, vocab=128, dim=32, num_warps=8),
}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _logits_tile(
    h_ptr, w_ptr, rows, cols, T, V, D, stride_h, stride_w, inv_temp, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr
):
    """z = h[rows] @ w[cols]^T * inv_temp as an fp32 [BLOCK_T, BLOCK_V] tile (out-of-range
    rows and columns read zeros)."""
    acc = tl.zeros((rows.shape[0], cols.shape[0]), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        h = tl.load(
            h_ptr + rows[:, None].to(tl.int64) * stride_h + ds[None, :],
            mask=(rows[:, None] < T) & (ds[None, :] < D),
            other=0.0,
        )  # [BT, BD]
        w = tl.load(
            w_ptr + cols[:, None].to(tl.int64) * stride_w + ds[None, :],
            mask=(cols[:, None] < V) & (ds[None, :] < D),
            other=0.0,
        )  # [BV, BD]
        if DOT_FP32:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
    return acc * inv_temp


@triton.jit
def _forward_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    floor_ptr,
    m_ptr,
    s_ptr,
    u_ptr,
    zt_ptr,
    T,
    V,
    D,
    stride_h,
    stride_w,
    inv_temp,
    tiles_per_split,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Partials for one (token tile, vocab split): running max m, s = sum exp(z - m),
    u = sum exp(z - m) * (z - m) over the logits at or above the token's floor (-inf: all of
    them), and the target's logit if it lies in this split. A split may hold none of a token's
    support: its m stays -inf and its s 0, which the merge weighs by 0."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tgt = tl.load(tgt_ptr + rows, mask=rows < T, other=-1)
    floor = tl.load(floor_ptr + rows, mask=rows < T, other=float("-inf"))
    m = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_T,), tl.float32)
    u = tl.zeros((BLOCK_T,), tl.float32)
    zt = tl.zeros((BLOCK_T,), tl.float32)
    v_start = tl.program_id(1) * tiles_per_split * BLOCK_V
    v_end = tl.minimum(v_start + tiles_per_split * BLOCK_V, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        valid = cols[None, :] < V  # [1, BV]
        z = _logits_tile(h_ptr, w_ptr, rows, cols, T, V, D, stride_h, stride_w, inv_temp, BLOCK_D, DOT_FP32)
        zt += tl.sum(tl.where(valid & (cols[None, :] == tgt[:, None]), z, 0.0), axis=1)
        keep = valid & (z >= floor[:, None])  # [BT, BV]
        z = tl.where(keep, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        # While no logit of the row has been kept (m_new = -inf, s = 0), -inf - -inf would be nan:
        # shift from 0 instead, which leaves s and u at 0.
        m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        shift = tl.where(s > 0, m - m_shift, 0.0) * s
        alpha = tl.exp(m - m_shift)
        zs = tl.where(keep, z - m_shift[:, None], float("-inf"))  # <= 0; -inf where e = 0
        e = tl.exp(zs)
        u = alpha * (u + shift) + tl.sum(tl.where(keep, zs, 0.0) * e, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new
    out = tl.program_id(1) * T + rows
    tl.store(m_ptr + out, m, mask=rows < T)
    tl.store(s_ptr + out, s, mask=rows < T)
    tl.store(u_ptr + out, u, mask=rows < T)
    tl.store(zt_ptr + out, zt, mask=rows < T)


@triton.jit
def _grad_tile(
    h_ptr,
    w_ptr,
    tgt,
    floor,
    row_max,
    log_s,
    ent,
    g_logp,
    g_ent,
    rows,
    cols,
    T,
    V,
    D,
    stride_h,
    stride_w,
    inv_temp,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """dL/dlogits tile [BT, BV]: (gL * (onehot - p) - gH * p * (log p + H)) / temperature, p = 0
    below the floor."""
    z = _logits_tile(h_ptr, w_ptr, rows, cols, T, V, D, stride_h, stride_w, inv_temp, BLOCK_D, DOT_FP32)
    log_p = (z - row_max[:, None]) - log_s[:, None]  # exact near the max, even at 1e4
    p = tl.where((cols[None, :] < V) & (z >= floor[:, None]), tl.exp(log_p), 0.0)
    g = -(g_ent[:, None] * (log_p + ent[:, None]) + g_logp[:, None]) * p
    g += tl.where(cols[None, :] == tgt[:, None], g_logp[:, None], 0.0)
    return g * inv_temp


@triton.jit
def _load_token_stats(rows, T, tgt_ptr, floor_ptr, max_ptr, log_s_ptr, ent_ptr, gl_ptr, ge_ptr):
    """Per-token inputs of the backward; rows past T read zero gradients, so their dz = 0."""
    inside = rows < T
    tgt = tl.load(tgt_ptr + rows, mask=inside, other=-1)
    floor = tl.load(floor_ptr + rows, mask=inside, other=float("-inf"))
    row_max = tl.load(max_ptr + rows, mask=inside, other=0.0)
    log_s = tl.load(log_s_ptr + rows, mask=inside, other=0.0)
    ent = tl.load(ent_ptr + rows, mask=inside, other=0.0)
    g_logp = tl.load(gl_ptr + rows, mask=inside, other=0.0)
    g_ent = tl.load(ge_ptr + rows, mask=inside, other=0.0)
    return tgt, floor, row_max, log_s, ent, g_logp, g_ent


@triton.jit
def _dhidden_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    floor_ptr,
    max_ptr,
    log_s_ptr,
    ent_ptr,
    gl_ptr,
    ge_ptr,
    dh_ptr,
    T,
    V,
    D,
    stride_h,
    stride_w,
    inv_temp,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """dhidden[rows] = sum over vocab tiles of dz @ W[cols]; dh_ptr is fp32 [T, D], zeroed."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tgt, floor, row_max, log_s, ent, g_logp, g_ent = _load_token_stats(
        rows, T, tgt_ptr, floor_ptr, max_ptr, log_s_ptr, ent_ptr, gl_ptr, ge_ptr
    )
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        dz = _grad_tile(
            h_ptr,
            w_ptr,
            tgt,
            floor,
            row_max,
            log_s,
            ent,
            g_logp,
            g_ent,
            rows,
            cols,
            T,
            V,
            D,
            stride_h,
            stride_w,
            inv_temp,
            BLOCK_D,
            DOT_FP32,
        )  # [BT, BV]
        if not DOT_FP32:
            dz = dz.to(w_ptr.dtype.element_ty)
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            w = tl.load(
                w_ptr + cols[:, None].to(tl.int64) * stride_w + ds[None, :],
                mask=(cols[:, None] < V) & (ds[None, :] < D),
                other=0.0,
            )  # [BV, BD]
            if DOT_FP32:
                w = w.to(tl.float32)
            dh_ptrs = dh_ptr + rows[:, None].to(tl.int64) * D + ds[None, :]
            dh_mask = (rows[:, None] < T) & (ds[None, :] < D)
            dh = tl.load(dh_ptrs, mask=dh_mask, other=0.0)  # [BT, BD] fp32
            dh = tl.dot(dz, w, dh, input_precision="ieee")
            tl.store(dh_ptrs, dh, mask=dh_mask)


@triton.jit
def _dweight_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    floor_ptr,
    max_ptr,
    log_s_ptr,
    ent_ptr,
    gl_ptr,
    ge_ptr,
    dw_ptr,
    T,
    V,
    D,
    stride_h,
    stride_w,
    inv_temp,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """dweight[cols] = sum over token tiles of dz^T @ h[rows]; dw_ptr is fp32 [V, D], zeroed."""
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        tgt, floor, row_max, log_s, ent, g_logp, g_ent = _load_token_stats(
            rows, T, tgt_ptr, floor_ptr, max_ptr, log_s_ptr, ent_ptr, gl_ptr, ge_ptr
        )
        dz = _grad_tile(
            h_ptr,
            w_ptr,
            tgt,
            floor,
            row_max,
            log_s,
            ent,
            g_logp,
            g_ent,
            rows,
            cols,
            T,
            V,
            D,
            stride_h,
            stride_w,
            inv_temp,
            BLOCK_D,
            DOT_FP32,
        )  # [BT, BV]
        if not DOT_FP32:
            dz = dz.to(h_ptr.dtype.element_ty)
        dz_t = tl.trans(dz)  # [BV, BT]
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            h = tl.load(
                h_ptr + rows[:, None].to(tl.int64) * stride_h + ds[None, :],
                mask=(rows[:, None] < T) & (ds[None, :] < D),
                other=0.0,
            )  # [BT, BD]
            if DOT_FP32:
                h = h.to(tl.float32)
            dw_ptrs = dw_ptr + cols[:, None].to(tl.int64) * D + ds[None, :]
            dw_mask = (cols[:, None] < V) & (ds[None, :] < D)
            dw = tl.load(dw_ptrs, mask=dw_mask, other=0.0)  # [BV, BD] fp32
            dw = tl.dot(dz_t, h, dw, input_precision="ieee")
            tl.store(dw_ptrs, dw, mask=dw_mask)


def logprobs(hidden, weight, targets, temperature, vocab_size, floor=None, *, blocks: Blocks | None = None):
    """Return (logprob [T], entropy [T]) in fp32; see tidal.kernels.logprobs."""
    if blocks is None:
        blocks = INTERPRET_BLOCKS if _interpreting() else GPU_BLOCKS[hidden.dtype]
    if floor is None:  # every logit in the softmax
        floor = torch.full((hidden.shape[0],), float("-inf"), dtype=torch.float32, device=hidden.device)
    return _TritonLogprobs.apply(hidden, weight, targets, floor, 1.0 / temperature, vocab_size, blocks)


class _TritonLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, floor, inv_temp, vocab_size, blocks):
        hidden, weight = hidden.contiguous(), weight.contiguous()
        targets, floor = targets.contiguous(), floor.float().contiguous()
        logp, entropy, row_max, log_s = _forward(hidden, weight, targets, floor, inv_temp, vocab_size, blocks)
        ctx.save_for_backward(hidden, weight, targets, floor, row_max, log_s, entropy)
        ctx.inv_temp, ctx.vocab_size, ctx.blocks = inv_temp, vocab_size, blocks
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, floor, row_max, log_s, entropy = ctx.saved_tensors
        # Autograd passes None for an output that did not reach the loss.
        grad_logp = torch.zeros_like(log_s) if grad_logp is None else grad_logp.float().contiguous()
        grad_entropy = torch.zeros_like(log_s) if grad_entropy is None else grad_entropy.float().contiguous()
        args = _KernelArgs(
            hidden,
            weight,
            targets,
            floor,
            row_max,
            log_s,
            entropy,
            grad_logp,
            grad_entropy,
            ctx.inv_temp,
            ctx.vocab_size,
            ctx.blocks,
        )
        dhidden = _dhidden(args) if ctx.needs_input_grad[0] else None
        dweight = _dweight(args) if ctx.needs_input_grad[1] else None
        return dhidden, dweight, None, None, None, None, None


def _dot_fp32(dtype: torch.dtype) -> bool:
    """fp32 inputs dot in exact fp32 ("ieee", not TF32): the LM head is an fp32 contract."""
    return dtype == torch.float32 or _interpreting()


def _num_splits(num_token_tiles: int, num_vocab_tiles: int, device: torch.device) -> int:
    """Vocab splits for the forward grid: enough programs to fill the GPU when T is short."""
    if _interpreting():
        return min(2, num_vocab_tiles)  # exercises the partial merge in the tests
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(4 * num_sms, num_token_tiles)
    # Keep >= 8 vocab tiles per split so the merge stays negligible.
    return max(1, min(wanted, num_vocab_tiles // 8))


def _forward(hidden, weight, targets, floor, inv_temp, vocab_size, blocks):
    num_tokens, dim = hidden.shape
    if num_tokens == 0:
        empty = hidden.new_empty(0, dtype=torch.float32)
        return empty, empty.clone(), empty.clone(), empty.clone()
    num_token_tiles = triton.cdiv(num_tokens, blocks.tokens)
    num_vocab_tiles = triton.cdiv(vocab_size, blocks.vocab)
    tiles_per_split = triton.cdiv(num_vocab_tiles, _num_splits(num_token_tiles, num_vocab_tiles, hidden.device))
    num_splits = triton.cdiv(num_vocab_tiles, tiles_per_split)
    m, s, u, target_logit = torch.empty(
        4, num_splits, num_tokens, dtype=torch.float32, device=hidden.device
    )  # each [splits, T]
    _forward_kernel[(num_token_tiles, num_splits)](
        hidden,
        weight,
        targets,
        floor,
        m,
        s,
        u,
        target_logit,
        num_tokens,
        vocab_size,
        dim,
        hidden.stride(0),
        weight.stride(0),
        inv_temp,
        tiles_per_split,
        BLOCK_T=blocks.tokens,
        BLOCK_V=blocks.vocab,
        BLOCK_D=blocks.dim,
        DOT_FP32=_dot_fp32(hidden.dtype),
        num_warps=blocks.num_warps,
    )
    return _merge_splits(m, s, u, target_logit)


def _merge_splits(m, s, u, target_logit):
    """Combine per-split partials [splits, T] into (logprob, entropy, row max, log sum exp
    (z - row max)) [T]. lse = max + log_s is never formed: at |logits| ~ 1e4 its fp32
    rounding would swamp log p."""
    m_max = m.amax(dim=0)  # [T]
    alpha = torch.exp(m - m_max)  # [splits, T]; 0 for an empty split (m = -inf)
    shift = torch.where(s > 0, m - m_max, 0.0) * s
    s_total = (alpha * s).sum(dim=0)
    u_total = (alpha * (u + shift)).sum(dim=0)
    log_s = s_total.log()
    return (target_logit.sum(dim=0) - m_max) - log_s, log_s - u_total / s_total, m_max, log_s


@dataclass
class _KernelArgs:
    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    floor: torch.Tensor
    row_max: torch.Tensor
    log_s: torch.Tensor
    entropy: torch.Tensor
    grad_logp: torch.Tensor
    grad_entropy: torch.Tensor
    inv_temp: float
    vocab_size: int
    blocks: Blocks

    def launch(self, kernel, grid, out):
        num_tokens, dim = self.hidden.shape
        kernel[grid](
            self.hidden,
            self.weight,
            self.targets,
            self.floor,
            self.row_max,
            self.log_s,
            self.entropy,
            self.grad_logp,
            self.grad_entropy,
            out,
            num_tokens,
            self.vocab_size,
            dim,
            self.hidden.stride(0),
            self.weight.stride(0),
            self.inv_temp,
            BLOCK_T=self.blocks.tokens,
            BLOCK_V=self.blocks.vocab,
            BLOCK_D=self.blocks.dim,
            DOT_FP32=_dot_fp32(self.hidden.dtype),
            num_warps=self.blocks.num_warps,
        )


def _dhidden(args: _KernelArgs) -> torch.Tensor:
    num_tokens = args.hidden.shape[0]
    dhidden = torch.zeros(args.hidden.shape, dtype=torch.float32, device=args.hidden.device)
    if num_tokens:
        args.launch(_dhidden_kernel, (triton.cdiv(num_tokens, args.blocks.tokens),), dhidden)
    return dhidden.to(args.hidden.dtype)


def _dweight(args: _KernelArgs) -> torch.Tensor:
    """fp32 weights accumulate in the output itself; half weights in an fp32 buffer."""
    dweight = torch.zeros_like(args.weight)  # [V, D]; padding rows stay 0
    used = dweight[: args.vocab_size]  # contiguous rows [vocab_size, D]
    acc = used if dweight.dtype == torch.float32 else torch.zeros_like(used, dtype=torch.float32)
    if args.hidden.shape[0]:
        args.launch(_dweight_kernel, (triton.cdiv(args.vocab_size, args.blocks.vocab),), acc)
    if acc is not used:
        used.copy_(acc)
    return dweight
