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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (logprob [T], entropy [T]) in fp32, or fp64 when the inputs are fp64."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    logits = hidden.to(acc) @ weight[:vocab_size].to(acc).T / temperature  # [T, V]
    log_probs = torch.log_softmax(logits, dim=-1)  # [T, V]
    logp = log_probs.gather(1, targets[:, None]).squeeze(1)  # [T]
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)  # [T]
    return logp, entropy
