"""Reference backend: materialize the full [T, V] logits and let autograd differentiate.

Used by the tests and the benchmark as ground truth; it costs O(T * V) memory, several times.
"""

import torch


def logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    vocab_size: int,
    floor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (logprob [T], entropy [T]) in fp32, or fp64 when the inputs are fp64; with `floor` [T],
    token t's softmax runs over the logits >= floor[t] only (tidal.kernels.logprobs)."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    logits = hidden.to(acc) @ weight[:vocab_size].to(acc).T / temperature  # [T, V]
    target_logit = logits.gather(1, targets[:, None]).squeeze(1)  # [T]
    if floor is not None:
        logits = logits.masked_fill(logits < floor.to(acc)[:, None], float("-inf"))
    log_norm = torch.logsumexp(logits, dim=-1)  # [T]
    log_probs = logits - log_norm[:, None]  # [T, V]; -inf outside the support
    probs = log_probs.exp()
    # 0 * -inf is nan: a token outside the support adds nothing to the entropy
    entropy = -(probs * torch.where(probs > 0, log_probs, 0.0)).sum(dim=-1)  # [T]
    return target_logit - log_norm, entropy
