"""What one logprobs call holds at its peak (forward, then backward) beyond its inputs, its [T] outputs and
the weight gradient it returns: the memory a plan adds per micro-batch. Stated from each backend's own
allocations and tile sizes, so a plan follows the kernels when they change.

T tokens, D the hidden size, V the vocabulary, `itemsize` the bytes of the hidden states and weight (2 in
bf16/fp16, 4 in fp32); every backend accumulates in fp32.
"""

from tidal.kernels.chunked import DEFAULT_TOKEN_CHUNK, DEFAULT_VOCAB_CHUNK

FP32 = 4


def auto_backend(on_gpu: bool, half: bool) -> str:
    """What backend "auto" runs: on a GPU the Triton kernels in half precision; in fp32 their exact dots run
    on the FMA units, several times slower than the chunked backend's cuBLAS matmuls ("torch")."""
    return "triton" if on_gpu and half else "torch"


def working_set_bytes(
    backend: str, tokens: int, hidden_size: int, vocab_size: int, itemsize: int, weight_grad: bool = True
) -> int:
    """The peak bytes of one call of `backend` (naive, torch or triton, as resolved); `weight_grad`: the
    LM head is trained (not under LoRA)."""
    half = itemsize < FP32
    t, d, v = tokens, hidden_size, vocab_size
    if backend == "naive":
        # fp32 logits, log-probs, probs and the entropy's product kept for the backward, and the gradient
        # of one of them at a time; the half weight cast to fp32
        return 5 * t * v * FP32 + (v * d * FP32 if half else 0)
    if backend == "torch":
        tc, vc = max(1, min(DEFAULT_TOKEN_CHUNK, t)), min(DEFAULT_VOCAB_CHUNK, v)
        tiles = 2 * tc * vc * FP32 + tc * vc  # two fp32 tiles and a floor's mask tile
        chunk = vc * d * FP32 * ((2 if weight_grad else 1) if half else 0)  # the fp32 weight rows, their grad
        # the fp32 dhidden and its cast to the hidden states' dtype, and a token chunk's fp32 hidden states
        return tiles + chunk + t * d * (FP32 + itemsize) + tc * d * FP32
    if backend == "triton":
        # the fp32 dhidden, cast when done; then, for half weights, an fp32 accumulator of the whole
        # [V, D] weight gradient, while dhidden is held
        dhidden = t * d * (FP32 + itemsize)
        return max(dhidden, t * d * itemsize + (v * d * FP32 if half and weight_grad else 0))
    raise ValueError(f"backend={backend!r}: expected naive, torch or triton (as resolved)")
