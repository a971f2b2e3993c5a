"""The Triton kernels on a real GPU, at real tile sizes, against the naive reference."""

import pytest
import torch

from conftest import assert_kernel_matches_reference, kernel_inputs, run_kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_triton_matches_reference_at_real_tile_sizes(dtype):
    hidden, weight, targets = kernel_inputs(300, 256, 5003, dtype, "cuda")
    mask = torch.rand(300, device="cuda") > 0.2
    assert_kernel_matches_reference("triton", hidden, weight, targets, 0.7, mask=mask, vocab_size=5000)


def test_gpu_triton_gradients_are_deterministic():
    hidden, weight, targets = kernel_inputs(512, 256, 8192, torch.bfloat16, "cuda")
    first, second = (run_kernel("triton", hidden, weight, targets) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_gpu_triton_uses_far_less_memory_than_naive():
    hidden, weight, targets = kernel_inputs(2048, 512, 32768, torch.bfloat16, "cuda")
    peaks = {}
    for backend in ("naive", "triton"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run_kernel(backend, hidden, weight, targets)
        peaks[backend] = torch.cuda.max_memory_allocated() - base
    assert peaks["triton"] < 0.25 * peaks["naive"]


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, "triton"), (torch.float32, "torch")])
def test_gpu_auto_takes_triton_in_bf16_and_the_chunked_backend_in_fp32(dtype, expected):
    hidden, weight, targets = kernel_inputs(300, 256, 5003, dtype, "cuda")
    picked, auto = (run_kernel(backend, hidden, weight, targets) for backend in (expected, "auto"))
    assert all(torch.equal(a, b) for a, b in zip(picked, auto))
