"""tidal.kernels: the torch and Triton backends against the naive autograd reference in fp64.

The Triton kernels run on CPU under TRITON_INTERPRET=1 (tests/conftest.py sets it when no
GPU is present, before triton is imported); shapes stay small because the interpreter is slow.
"""

import math
import os

import pytest
import torch

from conftest import assert_kernel_matches_reference, kernel_inputs, run_kernel
from tidal.kernels import logprobs


def _triton_skip_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device and TRITON_INTERPRET != 1 (tests/conftest.py sets it)"
    return None


TRITON_SKIP = _triton_skip_reason()
HAS_CUDA = torch.cuda.is_available()
TRITON = pytest.param("triton", marks=pytest.mark.skipif(TRITON_SKIP is not None, reason=str(TRITON_SKIP)))
FAST_BACKENDS = ["torch", TRITON]


def _device(backend: str) -> str:
    return "cuda" if backend == "triton" and HAS_CUDA else "cpu"


# Shapes chosen to cross tile edges: Triton interpreter tiles are 16 tokens x 32 vocab x 32 dim,
# the torch chunks below are 8 tokens x 32 vocab. The largest has three token tiles (the last ragged),
# two dim tiles and five vocab tiles (the last ragged) in two uneven vocab splits; the interpreter's
# time grows with the tiles, so no more of them than that.
LARGE = (40, 64, 150)
SHAPES = [LARGE, (1, 40, 97), (17, 24, 33)]


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_matches_reference(backend, shape, temperature):
    hidden, weight, targets = kernel_inputs(*shape, torch.float32, _device(backend))
    assert_kernel_matches_reference(backend, hidden, weight, targets, temperature, chunk_size=(8, 32))


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_match_reference_and_return_fp32(backend, dtype):
    hidden, weight, targets = kernel_inputs(*LARGE, dtype, _device(backend))
    logp, entropy = logprobs(hidden, weight, targets, 0.7, backend=backend)
    assert logp.dtype == entropy.dtype == torch.float32
    assert_kernel_matches_reference(backend, hidden, weight, targets, 0.7, chunk_size=(8, 32))


def _integer_inputs(num_tokens, dim, vocab, device, seed=0):
    """Small-integer hidden and weight: logits up to a few 1e4 that fp32 holds exactly."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-100, 101, (num_tokens, dim), generator=gen).float()
    weight = torch.randint(-100, 101, (vocab, dim), generator=gen).float()
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    return hidden.to(device), weight.to(device), targets.to(device)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_huge_logits_do_not_overflow(backend):
    hidden, weight, targets = _integer_inputs(24, 16, 200, _device(backend))
    assert (hidden @ weight.T).abs().max() > 1e4
    # Tie one token's top logit so its entropy is log 2, not just 0.
    top = (hidden[0] @ weight.T).argmax()
    weight[(top + 1) % 200] = weight[top]
    got, want = assert_kernel_matches_reference(backend, hidden, weight, targets, chunk_size=(8, 32))
    assert got[1][0] == pytest.approx(math.log(2), abs=1e-6)
    assert got[0].min() < -1e3  # the unlikely targets really are ~1e4 below the max


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_padded_vocab_columns_are_excluded(backend):
    hidden, weight, targets = kernel_inputs(*LARGE, torch.float32, _device(backend))
    targets = targets % 120  # the vocabulary ends inside the fourth tile; the fifth is all padding
    got, _ = assert_kernel_matches_reference(backend, hidden, weight, targets, vocab_size=120, chunk_size=(8, 32))
    sliced = run_kernel("naive", hidden, weight[:120], targets, dtype=torch.float64)
    torch.testing.assert_close(got[0], sliced[0], atol=1e-5, rtol=1e-5)
    assert got[3].shape == (150, 64)
    assert (got[3][120:] == 0).all()


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_token_mask_zeroes_outputs_and_gradients(backend):
    device = _device(backend)
    hidden, weight, targets = kernel_inputs(*LARGE, torch.float32, device)
    mask = torch.arange(LARGE[0], device=device) % 3 != 0
    targets = torch.where(mask, targets, -100)  # masked slots may hold an ignore index
    got, _ = assert_kernel_matches_reference(backend, hidden, weight, targets, 0.7, mask=mask, chunk_size=(8, 32))
    logp, entropy, dhidden, _ = got
    assert (logp[~mask] == 0).all() and (entropy[~mask] == 0).all()
    assert (dhidden[~mask] == 0).all() and (dhidden[mask] != 0).any()
    # The active tokens see exactly what they would see alone.
    alone = run_kernel(backend, hidden[mask], weight, targets[mask], 0.7)
    torch.testing.assert_close(logp[mask], alone[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_all_tokens_masked(backend):
    device = _device(backend)
    hidden, weight, targets = kernel_inputs(5, 16, 40, torch.float32, device)
    logp, entropy, dhidden, dweight = run_kernel(
        backend, hidden, weight, targets, mask=torch.zeros(5, dtype=torch.bool, device=device)
    )
    assert not logp.any() and not entropy.any() and not dhidden.any() and not dweight.any()


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_gradient_of_one_output_only(backend):
    hidden, weight, targets = kernel_inputs(20, 32, 70, torch.float32, _device(backend))
    hidden.requires_grad_()
    logp, _ = logprobs(hidden, weight, targets, backend=backend)  # entropy unused: grad is None
    logp.sum().backward()
    ref_hidden = hidden.detach().double().requires_grad_()
    ref_logp, _ = logprobs(ref_hidden, weight.double(), targets, backend="naive")
    ref_logp.sum().backward()
    torch.testing.assert_close(hidden.grad.double(), ref_hidden.grad, atol=1e-5, rtol=1e-5)


def test_torch_backend_saves_no_logits_sized_tensor():
    """The chunked path keeps only inputs and per-token stats for the backward."""
    num_tokens, dim, vocab = 64, 16, 512
    hidden, weight, targets = kernel_inputs(num_tokens, dim, vocab, torch.float32)
    hidden.requires_grad_()
    saved_numels = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_numels.append(t.numel()) or t, lambda t: t):
        logp, entropy = logprobs(hidden, weight, targets, backend="torch", chunk_size=(16, 64))
    assert max(saved_numels) <= vocab * dim  # the weight itself; [T, V] would be 4x that
    (logp + entropy).sum().backward()


@pytest.mark.parametrize("chunk_size", [1, (3, 7), (1000, 1000)])
def test_torch_backend_any_chunking(chunk_size):
    hidden, weight, targets = kernel_inputs(11, 8, 50, torch.float32)
    assert_kernel_matches_reference("torch", hidden, weight, targets, chunk_size=chunk_size)


def test_auto_is_torch_on_cpu():
    hidden, weight, targets = kernel_inputs(9, 8, 20, torch.float32)
    auto = logprobs(hidden, weight, targets, backend="auto")
    chunked = logprobs(hidden, weight, targets, backend="torch")
    assert all(torch.equal(a, c) for a, c in zip(auto, chunked))


@pytest.mark.parametrize(
    "dtype, expected", [(torch.bfloat16, "triton"), (torch.float16, "triton"), (torch.float32, "torch")]
)
def test_auto_on_a_gpu_is_triton_in_half_precision_and_torch_in_fp32(dtype, expected):
    from types import SimpleNamespace

    from tidal.kernels.api import _resolve_backend

    assert _resolve_backend("auto", SimpleNamespace(is_cuda=True, dtype=dtype)) == expected


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(hidden=torch.zeros(4, 8, 2)), "hidden"),
        (dict(hidden=[[0.0] * 8] * 4), "hidden"),
        (dict(weight=torch.zeros(10, 7)), "weight"),
        (dict(targets=torch.zeros(5, dtype=torch.long)), "targets"),
        (dict(targets=torch.zeros(4)), "targets.dtype"),
        (dict(weight=torch.zeros(10, 8, dtype=torch.float64)), "weight.dtype"),
        (dict(hidden=torch.zeros(4, 8, dtype=torch.int32)), "hidden.dtype"),
        (dict(mask=torch.ones(4)), "mask.dtype"),
        (dict(mask=torch.ones(3, dtype=torch.bool)), "mask"),
        (dict(temperature=0.0), "temperature"),
        (dict(vocab_size=11), "vocab_size"),
        (dict(targets=torch.full((4,), 9)), "targets"),
        (dict(backend="cuda"), "backend"),
        (dict(chunk_size=(0, 8)), "chunk_size"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(change, name):
    args = dict(
        hidden=torch.zeros(4, 8),
        weight=torch.zeros(10, 8),
        targets=torch.zeros(4, dtype=torch.long),
        temperature=1.0,
        mask=None,
        vocab_size=9,
        backend="torch",
        chunk_size=None,
    )
    args.update(change)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        logprobs(args.pop("hidden"), args.pop("weight"), args.pop("targets"), args.pop("temperature"), **args)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        logprobs(torch.zeros(2, 8), torch.zeros(10, 8), torch.zeros(2, dtype=torch.long), backend="triton")


def _floors_between_logits(hidden, weight, temperature, seed=2):
    """A floor [T] per token half-way between two of its neighbouring sorted logits (rounding never
    decides which side a logit falls), keeping 1 to V/2 tokens; every fourth token keeps them all."""
    logits = (hidden.double() @ weight.double().T / temperature).sort(dim=1, descending=True).values  # [T, V]
    gen = torch.Generator().manual_seed(seed)
    kept = torch.randint(1, weight.shape[0] // 2, (hidden.shape[0], 1), generator=gen).to(hidden.device)
    floor = (logits.gather(1, kept - 1) + logits.gather(1, kept)).squeeze(1) / 2
    floor[::4] = float("-inf")
    return floor.float()


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("shape", [LARGE, (17, 24, 33)], ids=lambda s: "x".join(map(str, s)))
def test_floor_keeps_the_softmax_to_the_support(backend, shape):
    """With a floor the softmax runs over the logits at or above it: values and gradients match the
    reference, a target below its floor included (its logprob finite, the caller's to discard)."""
    hidden, weight, targets = kernel_inputs(*shape, torch.float32, _device(backend))
    floor = _floors_between_logits(hidden, weight, 0.7)
    got, _ = assert_kernel_matches_reference(backend, hidden, weight, targets, 0.7, floor=floor, chunk_size=(8, 32))
    below = (hidden @ weight.T / 0.7).gather(1, targets[:, None]).squeeze(1) < floor
    assert below.any() and (~below).any()
    plain = run_kernel(backend, hidden, weight, targets, 0.7, chunk_size=(8, 32))
    kept = ~below & torch.isfinite(floor) & (floor > (hidden @ weight.T / 0.7).amin(1))
    assert (got[0][kept] > plain[0][kept]).all()  # renormalised over fewer tokens: more likely
    assert (got[1][kept] < plain[1][kept]).all()  # and less spread


def test_floor_of_minus_infinity_changes_nothing():
    hidden, weight, targets = kernel_inputs(*LARGE, torch.float32)
    floor = torch.full((LARGE[0],), float("-inf"))
    plain = run_kernel("torch", hidden, weight, targets)
    for a, b in zip(run_kernel("torch", hidden, weight, targets, floor=floor), plain):
        assert torch.equal(a, b)


def _kept_by_sorting(logits, top_k, top_p):
    """(bool [T, V], bool [T]): the tokens a top-k then top-p sampler keeps, the straightforward way: sort each
    row, cut at the k-th logit, renormalise, and drop from the bottom while the mass dropped stays <= 1 - p; and
    whether each row's cut is clear, its nearest candidate's mass above more than 1e-7 from top_p (closer, the
    rounding of the logits themselves decides)."""
    kept = torch.ones_like(logits, dtype=torch.bool)
    clear = torch.ones(len(logits), dtype=torch.bool)
    for t, row in enumerate(logits.double()):
        order = row.argsort(descending=True)
        keep = torch.zeros(len(row), dtype=torch.bool)
        keep[order[: top_k or len(row)]] = True
        probs = torch.where(keep, row, float("-inf")).softmax(0)[order]
        mass_above = probs.cumsum(0) - probs
        cut = int((mass_above < top_p).sum())  # a prefix of the sorted row
        kept[t] = torch.zeros(len(row), dtype=torch.bool).index_fill(0, order[:cut], True) & keep
        clear[t] = bool((mass_above[keep[order]] - top_p).abs().min() > 1e-7) if top_p < 1 else True
    return kept, clear


@pytest.mark.parametrize("top_k, top_p", [(0, 0.7), (5, 1.0), (12, 0.9), (0, 0.999), (0, 0.05)])
def test_sampler_floor_keeps_what_the_sampler_keeps(top_k, top_p):
    hidden, weight, targets = kernel_inputs(64, 32, 300, torch.float32, logit_scale=3.0)
    from tidal.kernels import sampler_floor

    # few first candidates, so rows whose nucleus is wider are widened
    floor, inside = sampler_floor(hidden, weight, targets, 0.8, top_k, top_p, first_candidates=4)
    logits = hidden @ weight.T / 0.8
    want, clear = _kept_by_sorting(logits, top_k, top_p)
    assert int(clear.sum()) >= 56
    assert torch.equal((logits >= floor[:, None])[clear], want[clear])
    assert torch.equal(inside[clear], want.gather(1, targets[:, None]).squeeze(1)[clear])


def test_sampler_floor_off_and_bad_arguments():
    from tidal.kernels import sampler_floor

    hidden, weight, targets = kernel_inputs(8, 16, 40, torch.float32)
    floor, inside = sampler_floor(hidden, weight, targets, 1.0, 0, 1.0)
    assert torch.isneginf(floor).all() and inside.all()
    for top_k, top_p, name in ((-1, 1.0, "top_k"), (0, 0.0, "top_p"), (0, 1.5, "top_p")):
        with pytest.raises(ValueError, match=name):
            sampler_floor(hidden, weight, targets, 1.0, top_k, top_p)
