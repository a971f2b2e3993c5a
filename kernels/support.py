"""The support of a truncated sampler: per token, the lowest logit that top-k and then top-p keep.

An actor that samples with top-k or top-p (nucleus) draws from the softmax renormalised over the
tokens they keep, and reports that probability. The learner's probability of the same sampler is
over the same kind of set, computed from its own logits: `sampler_floor` finds, per token, the logit
(after temperature) at and above which the kept tokens lie, and `tidal.kernels.logprobs(...,
floor=)` takes its softmax over those alone. The rules are the engine's: top-k keeps the k largest
logits (ties at the k-th included); top-p then keeps, on the top-k distribution renormalised, every
token whose strictly larger neighbours hold less than p of the mass, so at least the largest.

Finding the floor needs each token's logits sorted near their top, so they are formed here a few
token rows at a time ([rows, V], a bounded buffer, never [T, V]), without gradients: the kept set is
piecewise constant in the weights. Top-p looks among the largest `first_candidates` logits first, then
16 times as many, and sorts the whole row only where the nucleus is wider still (a flat distribution).
"""

from __future__ import annotations

import torch

# rows of logits formed at once: [rows, V] fp32 is at most this many bytes
BUFFER_BYTES = 64 << 20
FIRST_CANDIDATES = 256  # the nucleus of a trained model rarely holds more; rows that need more are widened


@torch.no_grad()
def sampler_floor(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    *,
    vocab_size: int | None = None,
    first_candidates: int = FIRST_CANDIDATES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(floor [T] fp32, inside [T] bool): each token's lowest kept logit (after temperature) under
    top_k (0: off) then top_p (1: off), and whether its target is kept. hidden [T, D], weight [V, D]
    (rows >= vocab_size are padding), targets [T]."""
    if not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"top_k={top_k!r}: expected an int >= 0 (0 turns it off)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}: expected a float in (0, 1]")
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    num_tokens = hidden.shape[0]
    floor = torch.full((num_tokens,), float("-inf"), dtype=torch.float32, device=hidden.device)
    inside = torch.ones(num_tokens, dtype=torch.bool, device=hidden.device)
    if (top_k == 0 or top_k >= vocab_size) and top_p >= 1.0:
        return floor, inside
    w = weight[:vocab_size].float()  # [V, D]
    rows = max(1, min(BUFFER_BYTES // (4 * vocab_size), num_tokens))
    # one buffer for every chunk of rows: on a CPU each fresh 64 MiB tensor costs ~20 ms of page faults
    buffer, scratch = torch.empty(2, rows * vocab_size, dtype=torch.float32, device=hidden.device)
    for t0 in range(0, num_tokens, rows):
        t1 = min(t0 + rows, num_tokens)
        logits = buffer[: (t1 - t0) * vocab_size].view(t1 - t0, vocab_size)  # [rows, V]
        torch.mm(hidden[t0:t1].float(), w.T, out=logits)
        logits.mul_(1.0 / temperature)
        floor[t0:t1] = _row_floor(logits, top_k, top_p, first_candidates, scratch[: logits.numel()].view_as(logits))
        inside[t0:t1] = logits.gather(1, targets[t0:t1, None].long()).squeeze(1) >= floor[t0:t1]
    return floor, inside


def _log_norm(logits: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """log sum exp of each row of logits [rows, V], scratch of its shape. Each term is held at or above e^-80
    (1.8e-35, a normal float32; its error is below V * 1e-35): torch.logsumexp over a trained model's
    logits, which span hundreds, computes millions of subnormal floats, which x86 cores do ten times slower."""
    top = logits.amax(dim=1, keepdim=True)  # [rows, 1]
    torch.sub(logits, top, out=scratch).clamp_(min=-80.0).exp_()
    return top.squeeze(1) + scratch.sum(dim=1).log()


def _row_floor(
    logits: torch.Tensor, top_k: int, top_p: float, first_candidates: int, scratch: torch.Tensor
) -> torch.Tensor:
    """The floor [rows] of logits [rows, V]: half-way between the smallest kept logit and the largest
    dropped one, so that a kernel forming the same logits with another rounding keeps the same tokens."""
    vocab_size = logits.shape[1]
    k = top_k if 0 < top_k < vocab_size else vocab_size
    if k < vocab_size:  # top-k keeps what lies above the mid-point of the k-th and (k+1)-th largest
        top = logits.topk(k + 1, dim=1).values  # [rows, k + 1], descending
        k_floor = (top[:, k - 1] + top[:, k]) / 2
        log_norm = torch.logsumexp(top[:, :k], dim=1)  # top-p renormalises over the top-k set
    else:
        k_floor = logits.new_full((logits.shape[0],), float("-inf"))
        log_norm = _log_norm(logits, scratch)  # [rows]
    if top_p >= 1.0:
        return k_floor
    floor = k_floor.clone()
    pending = torch.arange(logits.shape[0], device=logits.device)
    width = min(first_candidates, k)
    while pending.numel():
        candidates = logits if pending.numel() == logits.shape[0] else logits[pending]  # a copy only when fewer
        values = candidates.topk(min(width + 1, vocab_size), dim=1).values  # descending, one beyond
        # in float64: summed in float32 over thousands of candidates, the mass near the boundary errs by ~1e-5
        probs = torch.exp((values[:, :width] - log_norm[pending, None]).double())  # [rows, width]
        above = torch.cumsum(probs, dim=1) - probs  # mass strictly above each candidate
        kept = above < top_p  # a prefix of each row
        last = kept.sum(dim=1, keepdim=True) - 1  # the smallest kept candidate
        beyond = values.gather(1, (last + 1).clamp(max=values.shape[1] - 1))  # the largest dropped one
        mid = ((values.gather(1, last) + beyond) / 2).squeeze(1)
        # every candidate kept: the nucleus may reach past them (widen), or it holds all of top-k
        whole = kept[:, -1]
        settled = ~whole | (width == k)
        floor[pending[settled]] = torch.where(whole, k_floor[pending], mid)[settled]
        pending = pending[~settled]
        # once more 16 times as wide, then the whole top-k set: a topk of tens of thousands of logits costs
        # half a full sort, so a nucleus wider than 16 x first_candidates is found by sorting its rows
        width = min(width * 16, k) if width == min(first_candidates, k) else k
    return floor
