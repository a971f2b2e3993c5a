"""Fused LM-head logprob and entropy kernels (docs/architecture.md, "The kernels").

`logprobs(hidden, weight, targets, temperature)` returns the per-token log-probability of
the target and the entropy of softmax(hidden @ weight.T / temperature), both in fp32 and
both differentiable w.r.t. hidden and weight. Backends: "triton" (GPU, or CPU under
TRITON_INTERPRET=1), "torch" (chunked, never holds [T, V] logits; the CPU path) and
"naive" (plain autograd over materialized logits; the reference for tests). With a `floor`
(`sampler_floor`), the softmax is a top-k / top-p sampler's: over the logits it keeps alone.
"""

from tidal.kernels.api import BACKENDS, logprobs
from tidal.kernels.support import sampler_floor
from tidal.kernels.working_set import auto_backend, working_set_bytes

__all__ = ["BACKENDS", "auto_backend", "logprobs", "sampler_floor", "working_set_bytes"]
