"""Chunked torch backend: the CPU path, and a readable statement of what the Triton kernels do.

Tiles the logits over vocab chunks (outer loop) and token chunks (inner loop) and keeps an
online log-sum-exp per token, so at most a few [token_chunk, vocab_chunk] tiles exist at
once, never [T, V]. The backward recomputes each tile from hidden, weight and the saved
per-token max, log-sum and entropy. The vocab-outer order lets each [vocab_chunk, D] slice of
dweight be finished (and cast to the weight dtype) before the next one starts, so no fp32
copy of the whole dweight is needed for bf16 weights.
"""

import torch

# Tuned on 2 x86 cores at T=4096, D=896, V=151936 (bench/kernels.py): tiles this size keep
# the matmuls near full speed while costing 64 MiB each (fp32); smaller ones ran ~10% slower.
DEFAULT_TOKEN_CHUNK = 1024
DEFAULT_VOCAB_CHUNK = 16384


def resolve_chunks(chunk_size: int | tuple[int, int] | None) -> tuple[int, int]:
    """Return (token_chunk, vocab_chunk) from the public chunk_size argument."""
    if chunk_size is None:
        return DEFAULT_TOKEN_CHUNK, DEFAULT_VOCAB_CHUNK
    if isinstance(chunk_size, int) and not isinstance(chunk_size, bool):
        chunk_size = (DEFAULT_TOKEN_CHUNK, chunk_size)
    ok = (
        isinstance(chunk_size, tuple)
        and len(chunk_size) == 2
        and all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in chunk_size)
    )
    if not ok:
        raise ValueError(
            f"chunk_size={chunk_size!r}: expected a positive int (vocab columns per tile) or "
            "a (tokens, vocab columns) pair of positive ints"
        )
    return chunk_size


def logprobs(hidden, weight, targets, temperature, vocab_size, floor=None, *, token_chunk, vocab_chunk):
    """Return (logprob [T], entropy [T]); see tidal.kernels.logprobs."""
    return _ChunkedLogprobs.apply(
        hidden, weight, targets, 1.0 / temperature, vocab_size, token_chunk, vocab_chunk, floor
    )


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, vocab_size, token_chunk, vocab_chunk, floor):
        tiling = _Tiling(hidden.shape[0], vocab_size, token_chunk, vocab_chunk)
        logp, entropy, row_max, log_s = _forward(hidden, weight, targets, inv_temp, tiling, floor)
        ctx.save_for_backward(hidden, weight, targets, row_max, log_s, entropy, floor)
        ctx.inv_temp, ctx.tiling = inv_temp, tiling
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, row_max, log_s, entropy, floor = ctx.saved_tensors
        acc = row_max.dtype
        # Autograd passes None for an output that did not reach the loss.
        grad_logp = _zeros_if_none(grad_logp, row_max).to(acc)
        grad_entropy = _zeros_if_none(grad_entropy, row_max).to(acc)
        dhidden, dweight = _backward(
            hidden,
            weight,
            targets,
            (row_max, log_s, entropy),
            grad_logp,
            grad_entropy,
            ctx.inv_temp,
            ctx.tiling,
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            floor,
        )
        return dhidden, dweight, None, None, None, None, None, None


class _Tiling:
    """Chunk bounds, and flat tile buffers reused across the loop: on CPU each fresh 64 MiB
    tile would be a new mmap paying ~20 ms of page faults."""

    def __init__(self, num_tokens, vocab_size, token_chunk, vocab_chunk):
        self.num_tokens, self.vocab_size = num_tokens, vocab_size
        self.token_chunk = max(1, min(token_chunk, num_tokens))
        self.vocab_chunk = min(vocab_chunk, vocab_size)

    def vocab_ranges(self):
        for v0 in range(0, self.vocab_size, self.vocab_chunk):
            yield v0, min(v0 + self.vocab_chunk, self.vocab_size)

    def token_ranges(self):
        for t0 in range(0, self.num_tokens, self.token_chunk):
            yield t0, min(t0 + self.token_chunk, self.num_tokens)

    def buffers(self, count, dtype, device):
        size = self.token_chunk * self.vocab_chunk
        return [torch.empty(size, dtype=dtype, device=device) for _ in range(count)]


def _tile(buffer, rows, cols):
    return buffer[: rows * cols].view(rows, cols)  # contiguous [rows, cols] view


def _zeros_if_none(grad, like):
    return torch.zeros_like(like) if grad is None else grad


def _target_columns(targets, v0, v1):
    """(in chunk [Tc] bool, column [Tc, 1]): whether each target lies in vocab chunk
    [v0, v1) and its column there (clamped, so always a valid index). Dense on purpose:
    nonzero() would force a host sync per tile on GPU and break torch.compile graphs."""
    in_chunk = (targets >= v0) & (targets < v1)
    return in_chunk, (targets - v0).clamp(0, v1 - v0 - 1)[:, None]


def _forward(hidden, weight, targets, inv_temp, tiling, floor=None):
    """Online log-sum-exp over vocab chunks. Per token we keep the running max m, the sum
    s = sum exp(z - m), and u = sum exp(z - m) * (z - m); then log p_y = (z_y - m) - log s
    and entropy = log s - u / s. Keeping u relative to m avoids the cancellation that
    lse - E[z] would suffer when logits are large (1e4). With a floor [T], logits below it add
    nothing to s and u; m may be one of them, harmlessly: the row's largest logit is never below."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    num_tokens, device = hidden.shape[0], hidden.device
    m = torch.full((num_tokens,), float("-inf"), dtype=acc, device=device)  # [T]
    s = torch.zeros(num_tokens, dtype=acc, device=device)  # [T]
    u = torch.zeros(num_tokens, dtype=acc, device=device)  # [T]
    target_logit = torch.zeros(num_tokens, dtype=acc, device=device)  # [T]
    z_buf, e_buf = tiling.buffers(2, acc, device)
    below_buf = None if floor is None else tiling.buffers(1, torch.bool, device)[0]
    for v0, v1 in tiling.vocab_ranges():
        w = weight[v0:v1].to(acc)  # [Vc, D]; a no-op view for fp32 weights
        for t0, t1 in tiling.token_ranges():
            z = _tile(z_buf, t1 - t0, v1 - v0)  # [Tc, Vc]
            # beta=0 ignores z's old contents; alpha applies the temperature inside the GEMM.
            torch.addmm(z, hidden[t0:t1].to(acc), w.T, beta=0, alpha=inv_temp, out=z)
            in_chunk, cols = _target_columns(targets[t0:t1], v0, v1)
            target_logit[t0:t1] += torch.where(in_chunk, z.gather(1, cols).squeeze(1), 0.0)
            below = None  # [Tc, Vc]: True outside the support
            if floor is not None:
                below = torch.lt(z, floor[t0:t1, None], out=_tile(below_buf, t1 - t0, v1 - v0))
            _online_update(z, _tile(e_buf, t1 - t0, v1 - v0), m[t0:t1], s[t0:t1], u[t0:t1], below)
    log_s = s.log()  # [T]
    # lse = m + log_s is never formed: at |logits| ~ 1e4 its fp32 rounding (~1e-3) would
    # swamp log p; (z - m) - log_s is exact near the max, like torch.log_softmax.
    return (target_logit - m) - log_s, log_s - u / s, m, log_s


def _online_update(z, e, m, s, u, below=None):
    """Fold tile z [Tc, Vc] into the running (m, s, u) [Tc], in place, leaving out the logits where
    `below` [Tc, Vc] is True; e is scratch of z's shape (a fresh 64 MiB tensor per tile would cost
    ~20 ms of page faults). Destroys z."""
    m_new = torch.maximum(m, z.amax(dim=1))  # [Tc]
    # The first tile sees m = -inf and s = 0: (m - m_new) * s would be -inf * 0 = nan.
    shift = torch.where(s > 0, m - m_new, 0.0) * s  # [Tc]
    alpha = torch.exp(m - m_new)  # [Tc]
    z.sub_(m_new[:, None])  # z - m_new, <= 0
    torch.exp(z, out=e)  # [Tc, Vc]
    if below is not None:
        e.masked_fill_(below, 0.0)
    s_tile = e.sum(dim=1)  # [Tc]
    u_tile = e.mul_(z).sum(dim=1)  # [Tc]
    u.copy_(alpha * (u + shift) + u_tile)
    s.copy_(alpha * s + s_tile)
    m.copy_(m_new)


def _backward(
    hidden, weight, targets, stats, grad_logp, grad_entropy, inv_temp, tiling, want_dhidden, want_dweight, floor=None
):
    """dz = grad_logp * (onehot - p) - grad_entropy * p * (log p + H), divided by the
    temperature; dhidden = dz @ W and dweight = dz^T @ h, accumulated in fp32 per tile.
    stats = (row max, log sum exp(z - max), entropy), each [T]."""
    acc, device = stats[0].dtype, hidden.device
    dhidden = torch.zeros(hidden.shape, dtype=acc, device=device) if want_dhidden else None
    dweight = torch.zeros_like(weight) if want_dweight else None  # [V, D]; padding rows stay 0
    # fp32 weights accumulate straight into dweight; half weights into an fp32 chunk.
    direct = weight.dtype == acc
    z_buf, p_buf = tiling.buffers(2, acc, device)
    below_buf = None if floor is None else tiling.buffers(1, torch.bool, device)[0]
    for v0, v1 in tiling.vocab_ranges():
        w = weight[v0:v1].to(acc)  # [Vc, D]
        dw = None
        if want_dweight:
            dw = dweight[v0:v1] if direct else torch.zeros(w.shape, dtype=acc, device=device)
        for t0, t1 in tiling.token_ranges():
            h = hidden[t0:t1].to(acc)  # [Tc, D]
            dz = _tile(z_buf, t1 - t0, v1 - v0)  # [Tc, Vc]
            _tile_grad(
                dz,
                _tile(p_buf, t1 - t0, v1 - v0),
                h,
                w,
                targets[t0:t1],
                v0,
                v1,
                [x[t0:t1] for x in stats],
                grad_logp[t0:t1],
                grad_entropy[t0:t1],
                inv_temp,
                None if floor is None else (floor[t0:t1], _tile(below_buf, t1 - t0, v1 - v0)),
            )
            if want_dhidden:
                dhidden[t0:t1].addmm_(dz, w)  # += [Tc, Vc] @ [Vc, D]
            if want_dweight:
                dw.addmm_(dz.T, h)  # += [Vc, Tc] @ [Tc, D]
        if want_dweight and not direct:
            dweight[v0:v1].copy_(dw)
    return (dhidden.to(hidden.dtype) if want_dhidden else None), dweight


def _tile_grad(dz, p, h, w, targets, v0, v1, stats, grad_logp, grad_entropy, inv_temp, floor=None):
    """Write dz = (gL * (onehot - p) - gH * p * (log p + H)) / temperature [Tc, Vc] into dz,
    recomputing the logits of h [Tc, D] and w [Vc, D]; p is scratch of the same shape, 0 outside
    the support of `floor` = (floor [Tc], bool scratch [Tc, Vc]).
    Tiles are far bigger than cache, so each elementwise pass costs memory bandwidth: the
    passes are fused where torch allows."""
    row_max, log_s, entropy = stats  # [Tc] each
    torch.addmm(row_max.neg()[:, None], h, w.T, alpha=inv_temp, out=dz)  # z - max
    dz.sub_(log_s[:, None])  # log p; not z - (max + log_s), which rounds badly at 1e4
    torch.exp(dz, out=p)
    if floor is not None:  # z < floor, in log p's terms
        floor, below = floor
        p.masked_fill_(torch.lt(dz, (floor - row_max - log_s)[:, None], out=below), 0.0)
    # dz = p * (slope * log p + offset), per-token slope = -gH / temp, offset = -(gH H + gL) / temp
    slope = grad_entropy * -inv_temp  # [Tc]
    offset = (grad_entropy * entropy + grad_logp) * -inv_temp  # [Tc]
    torch.addcmul(offset[:, None], dz, slope[:, None], out=dz).mul_(p)
    in_chunk, cols = _target_columns(targets, v0, v1)
    dz.scatter_add_(1, cols, torch.where(in_chunk, grad_logp * inv_temp, 0.0)[:, None])
