"""Public entry point: argument checks, token mask and padded-vocab handling, backend choice.

Every backend receives already-checked, mask-compacted inputs, so the masking rules (masked
tokens return 0 and get no gradient, and cost no compute) live here once.
"""

import os

import torch

from tidal.kernels.working_set import auto_backend

BACKENDS = ("auto", "naive", "torch", "triton")
_HALF_DTYPES = (torch.bfloat16, torch.float16)
# fp64 is accepted by the pure-torch backends so tests can build an fp64 reference.
_FLOAT_DTYPES = {
    "naive": (torch.float32, torch.float64, *_HALF_DTYPES),
    "torch": (torch.float32, torch.float64, *_HALF_DTYPES),
    "triton": (torch.float32, *_HALF_DTYPES),
}


def logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    backend: str = "auto",
    chunk_size: int | tuple[int, int] | None = None,
    floor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (logprob of target [T], entropy [T]) of softmax(hidden @ weight.T / temperature).

    hidden [T, D], weight [V, D] (rows >= vocab_size are padding and excluded), targets [T]
    integer. mask [T] bool: False tokens return 0 for both outputs and get zero gradient.
    chunk_size: vocab columns per tile, or (tokens, vocab columns), for backend "torch".
    floor [T] float32: token t's softmax runs over the logits (after temperature) >= floor[t] alone,
    a truncated sampler's support (`sampler_floor`); the logprob of a target below its floor is its
    logit less that support's log-sum-exp, finite and meaningless: the caller tells it apart.
    Outputs are fp32 (fp64 for fp64 inputs), accumulated in fp32 whatever the input dtype.
    """
    backend = _resolve_backend(backend, hidden)
    vocab_size = _check_args(hidden, weight, targets, temperature, mask, vocab_size, backend)
    if floor is not None:
        _check_per_token("floor", floor, hidden.shape[0], hidden.device)
        floor = floor.to(torch.promote_types(hidden.dtype, torch.float32))
    impl = _backend_impl(backend, chunk_size)
    if mask is None:
        return impl(hidden, weight, targets, float(temperature), vocab_size, floor)
    # Compact the active tokens so no backend spends work (or memory) on masked ones; the
    # index ops are autograd-aware, so masked rows of hidden get exactly zero gradient. The
    # price is one host sync (nonzero) on GPU, small next to the LM head itself.
    active = mask.nonzero().squeeze(1)  # [T_active]
    logp_active, entropy_active = impl(
        hidden.index_select(0, active),
        weight,
        targets.index_select(0, active),
        float(temperature),
        vocab_size,
        None if floor is None else floor.index_select(0, active),
    )
    num_tokens = hidden.shape[0]
    logp = logp_active.new_zeros(num_tokens).index_copy(0, active, logp_active)  # [T]
    entropy = entropy_active.new_zeros(num_tokens).index_copy(0, active, entropy_active)  # [T]
    return logp, entropy


def _resolve_backend(backend: str, hidden: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if backend == "auto":
        return auto_backend(getattr(hidden, "is_cuda", False), getattr(hidden, "dtype", None) in _HALF_DTYPES)
    on_cpu = not getattr(hidden, "is_cuda", True)
    if backend == "triton" and on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
            f"imported to run on CPU (hidden is on {hidden.device})"
        )
    return backend


def _check_args(hidden, weight, targets, temperature, mask, vocab_size, backend) -> int:
    """Raise ValueError naming the first bad argument; return the effective vocab size."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden: expected a [T, D] tensor, got {_describe(hidden)}")
    num_tokens, dim = hidden.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != dim:
        raise ValueError(f"weight: expected a [V, {dim}] tensor, got {_describe(weight)}")
    if hidden.dtype not in _FLOAT_DTYPES[backend]:
        raise ValueError(f"hidden.dtype={hidden.dtype}: backend {backend!r} supports {_FLOAT_DTYPES[backend]}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight.dtype={weight.dtype}: must equal hidden.dtype={hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight.device={weight.device}: must equal hidden.device={hidden.device}")
    _check_per_token("targets", targets, num_tokens, hidden.device)
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets.dtype={targets.dtype}: expected an integer dtype (int64)")
    if mask is not None:
        _check_per_token("mask", mask, num_tokens, hidden.device)
        if mask.dtype != torch.bool:
            raise ValueError(f"mask.dtype={mask.dtype}: expected torch.bool")
    is_number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    if not is_number or not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: expected a positive float")
    if vocab_size is None:
        vocab_size = weight.shape[0]
    if not isinstance(vocab_size, int) or not 0 < vocab_size <= weight.shape[0]:
        raise ValueError(f"vocab_size={vocab_size!r}: expected an int in [1, {weight.shape[0]}]")
    # A range check on GPU would force a host sync every call, and breaks torch.compile graphs.
    if not targets.is_cuda and not torch.compiler.is_compiling():
        _check_target_range(targets, mask, vocab_size)
    return vocab_size


def _check_per_token(name, tensor, num_tokens, device) -> None:
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != (num_tokens,):
        raise ValueError(f"{name}: expected a [{num_tokens}] tensor, got {_describe(tensor)}")
    if tensor.device != device:
        raise ValueError(f"{name}.device={tensor.device}: must equal hidden.device={device}")


def _check_target_range(targets, mask, vocab_size) -> None:
    active = targets if mask is None else targets[mask]
    if active.numel() and (int(active.min()) < 0 or int(active.max()) >= vocab_size):
        raise ValueError(
            f"targets: values must lie in [0, {vocab_size}) for unmasked tokens, got "
            f"[{int(active.min())}, {int(active.max())}]"
        )


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} dtype {value.dtype}"
    return type(value).__name__


def _backend_impl(backend: str, chunk_size):
    """Import lazily: triton reads TRITON_INTERPRET when its kernels are decorated."""
    if backend == "naive":
        from tidal.kernels import naive

        return naive.logprobs
    if backend == "torch":
        from tidal.kernels import chunked

        tokens, columns = chunked.resolve_chunks(chunk_size)
        return lambda *args: chunked.logprobs(*args, token_chunk=tokens, vocab_chunk=columns)
    from tidal.kernels import triton_kernels

    return triton_kernels.logprobs
