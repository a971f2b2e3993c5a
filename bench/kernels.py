"""Benchmark tidal.kernels backends: forward + backward time, peak extra memory, max error.

Prints one JSON object per line per (backend, shape, dtype): backend, device, T, D, V, dtype,
time_ms (median over --reps after one warm-up), peak_mem_bytes, max_err (and the per-output
errors), or skipped with the reason; then one "ratios" line per shape and dtype comparing
each backend with naive.

How memory is measured (peak_mem_bytes = extra bytes over the inputs during forward +
backward, counting the dhidden/dweight gradients the backend returns):
  cuda: torch.cuda.max_memory_allocated() minus memory_allocated() before the step.
  cpu:  every case runs in a fresh subprocess; before each step we free the previous grads,
        malloc_trim(0) so freed heap pages leave the resident set, read VmRSS, and reset the
        kernel's resident high-water mark (write "5" to /proc/self/clear_refs); after the step,
        peak = VmHWM - that VmRSS. This sees every page torch (or anything) touched, which
        tracemalloc would not; untouched allocations do not count, as they cost no RAM.
max_err: max abs difference against the naive backend evaluated in fp64 on the same input
values, over logprob, entropy, dhidden and dweight, for a separate run on the first
--err-tokens tokens (an fp64 reference at full T would need several times naive's memory).

  python bench/kernels.py --quick
  python bench/kernels.py --shapes 1024x896x151936 --dtypes float32 --backends torch --samplers none,p0.9,k50
  TRITON_INTERPRET=1 python bench/kernels.py --shapes 16x32x151936 --dtypes float32 --backends triton \
      --samplers none,p0.9 --reps 1                         (the Triton kernels on a CPU, through the interpreter)

--samplers adds a top-k / top-p cut (`p0.9`, `k50`, `k50p0.95`): each step finds the kept set
(tidal.kernels.sampler_floor) and the kernel takes its softmax over it, as the learner does for an actor
that samples so; a "ratios" line then gives each cut's time against the same backend's without one.
  python bench/kernels.py --shapes 4096x896x151936 --dtypes float32 --backends naive,torch
"""

import argparse
import ctypes
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import torch

DEFAULT_SHAPES = "4096x896x151936,8192x4096x151936"
QUICK_SHAPES = "512x256x32000"
CPU_BACKENDS = "naive,torch"  # torch_compile also runs on cpu when asked for
GPU_BACKENDS = "naive,torch,torch_compile,triton"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=None, help=f"TxDxV list (default {DEFAULT_SHAPES})")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--backends", default=None, help=f"default {CPU_BACKENDS} on cpu, {GPU_BACKENDS} on cuda")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per case")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--chunk-size", default=None, help="torch backend tiles, e.g. 1024,8192")
    parser.add_argument(
        "--blocks",
        default=None,
        help="triton tile sizes to compare, tokens x vocab x dim x warps each, e.g. "
        "64x128x32x8,128x128x64x8 (default: the kernels' own per dtype)",
    )
    parser.add_argument("--err-tokens", type=int, default=128)
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=120.0,
        help="skip cpu cases whose estimated fwd+bwd time per rep exceeds this",
    )
    parser.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, 2 reps")
    parser.add_argument("--samplers", default="none", help="none, or top-k / top-p cuts: p0.9, k50, k50p0.95")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # subprocess mode
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.reps = args.shapes or QUICK_SHAPES, min(args.reps, 2)
    args.shapes = args.shapes or DEFAULT_SHAPES
    args.backends = args.backends or (GPU_BACKENDS if args.device == "cuda" else CPU_BACKENDS)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))), flush=True)
        return
    flops_per_s = measure_matmul_flops(args.device)
    results = []
    for shape in args.shapes.split(","):
        num_tokens, dim, vocab = (int(x) for x in shape.lower().split("x"))
        for dtype in args.dtypes.split(","):
            for (backend, blocks), sampler in itertools.product(backend_variants(args), args.samplers.split(",")):
                case = dict(
                    backend=backend,
                    device=args.device,
                    T=num_tokens,
                    D=dim,
                    V=vocab,
                    dtype=dtype,
                    reps=args.reps,
                    chunk_size=args.chunk_size,
                    blocks=blocks,
                    err_tokens=args.err_tokens,
                    sampler=sampler,
                )
                reason = skip_reason(case, flops_per_s, args.max_seconds)
                result = dict(case, skipped=reason) if reason else run_in_subprocess(case)
                print(json.dumps(result), flush=True)
                results.append(result)
    for line in ratio_lines(results):
        print(json.dumps(line), flush=True)


def backend_variants(args) -> list[tuple[str, str | None]]:
    """(backend, triton tile sizes or None) for every case of one shape and dtype."""
    variants = []
    for backend in args.backends.split(","):
        tiles = args.blocks.split(",") if backend == "triton" and args.blocks else [None]
        variants += [(backend, blocks) for blocks in tiles]
    return variants


def measure_matmul_flops(device: str) -> float:
    """Rough fp32 matmul throughput, used only to skip cpu cases that would take too long."""
    a = torch.randn(1024, 1024, device=device)
    b = torch.randn(1024, 4096, device=device)
    a @ b
    start = time.perf_counter()
    for _ in range(3):
        a @ b
    _sync(device)
    return 3 * 2 * a.shape[0] * a.shape[1] * b.shape[1] / (time.perf_counter() - start)


def skip_reason(case, flops_per_s, max_seconds) -> str | None:
    """Why a case cannot run here, or None."""
    backend, device = case["backend"], case["device"]
    if device == "cpu" and backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        return "triton on a cpu runs only under TRITON_INTERPRET=1 (the interpreter: slow, so small T)"
    num_tokens, dim, vocab = case["T"], case["D"], case["V"]
    # naive peaks at ~5 [T, V] fp32 arrays (measured 12.5 GB at T=4096, V=151936).
    extra = 5 * num_tokens * vocab * 4 if backend == "naive" else 0
    inputs = 2 * (vocab + num_tokens) * dim * (4 if case["dtype"] == "float32" else 2)
    available = _available_bytes(device)
    if extra + inputs > 0.9 * available:
        return f"needs ~{(extra + inputs) / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available"
    if device == "cpu":
        # fwd + bwd = 3 matmuls for naive, 4 for the recomputing chunked path.
        seconds = 4 * 2 * num_tokens * dim * vocab / flops_per_s
        if seconds > max_seconds:
            return f"estimated {seconds:.0f} s a rep on this cpu > --max-seconds {max_seconds:.0f}"
    return None


def _available_bytes(device: str) -> int:
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return free
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) * 1024


def run_in_subprocess(case) -> dict:
    """A fresh process per case, so one case's memory high-water mark never hides another's."""
    cmd = [sys.executable, os.path.abspath(__file__), "--case", json.dumps(case)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return dict(case, error=f"exit code {proc.returncode}: {' | '.join(tail)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_case(case) -> dict:
    """Subprocess body: time fwd+bwd, measure peak extra memory, then the error."""
    device, dtype = case["device"], getattr(torch, case["dtype"])
    inputs = make_inputs(case["T"], case["D"], case["V"], dtype, device)
    sampler = case.get("sampler", "none")
    fn = build_backend(case["backend"], case["chunk_size"], case.get("blocks"), sampler)
    probe = CudaMemoryProbe() if device == "cuda" else RssProbe()
    times_ms, peaks = [], []
    for rep in range(1 + case["reps"]):  # rep 0 warms up (and compiles torch_compile)
        inputs["hidden"].grad = inputs["weight"].grad = None
        probe.start()
        start = time.perf_counter()
        step(fn, **inputs)
        _sync(device)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        peaks.append(probe.stop())
        if rep > 0:
            times_ms.append(elapsed_ms)
    inputs["hidden"].grad = inputs["weight"].grad = None
    errors = measure_errors(fn, inputs, case["err_tokens"], build_backend("naive", None, None, sampler))
    return dict(
        case,
        time_ms=round(statistics.median(times_ms), 2),
        peak_mem_bytes=max(peaks),
        max_err=max(errors.values()),
        **errors,
    )


def make_inputs(num_tokens, dim, vocab, dtype, device) -> dict:
    """LM-head-like inputs: logits of std ~2, random upstream grads for both outputs."""
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(num_tokens, dim, generator=gen, device=device, dtype=dtype)
    weight = torch.randn(vocab, dim, generator=gen, device=device, dtype=dtype)
    weight.mul_(2.0 / dim**0.5)
    return dict(
        hidden=hidden.requires_grad_(),
        weight=weight.requires_grad_(),
        targets=torch.randint(0, vocab, (num_tokens,), generator=gen, device=device),
        grad_logp=torch.randn(num_tokens, generator=gen, device=device),
        grad_entropy=torch.randn(num_tokens, generator=gen, device=device),
    )


def build_backend(name: str, chunk_size, blocks=None, sampler: str = "none"):
    """fn(hidden, weight, targets) -> (logprob, entropy) for one benchmarked backend; with a `sampler` cut,
    over the tokens it keeps."""
    import re

    from tidal.kernels import sampler_floor

    plain = _plain_backend(name, chunk_size, blocks)
    if sampler == "none":
        return plain
    match = re.fullmatch(r"(?:k(\d+))?(?:p([0-9.]+))?", sampler)
    if match is None:
        raise SystemExit(f"--samplers: {sampler!r} is not none, pP, kK or kKpP")
    top_k, top_p = int(match[1] or 0), float(match[2] or 1.0)

    def cut(h, w, y):
        floor, _ = sampler_floor(h.detach(), w.detach(), y, 1.0, top_k, top_p)
        return plain(h, w, y, floor=floor)

    return cut


def _plain_backend(name: str, chunk_size, blocks=None):
    """fn(hidden, weight, targets, floor=None) -> (logprob, entropy)."""
    from tidal.kernels import logprobs

    if blocks:  # the triton kernels at other tile sizes, called directly (no mask to compact here)
        from tidal.kernels import triton_kernels

        tokens, vocab, dim, warps = (int(x) for x in blocks.lower().split("x"))
        tiles = triton_kernels.Blocks(tokens=tokens, vocab=vocab, dim=dim, num_warps=warps)
        return lambda h, w, y, floor=None: triton_kernels.logprobs(h, w, y, 1.0, w.shape[0], floor, blocks=tiles)

    chunks = tuple(int(c) for c in chunk_size.split(",")) if chunk_size else None
    if chunks and len(chunks) == 1:
        chunks = chunks[0]
    if name == "torch_compile":
        return torch.compile(
            lambda h, w, y, floor=None: logprobs(h, w, y, backend="torch", chunk_size=chunks, floor=floor)
        )
    return lambda h, w, y, floor=None: logprobs(h, w, y, backend=name, chunk_size=chunks, floor=floor)


def step(fn, hidden, weight, targets, grad_logp, grad_entropy) -> None:
    logp, entropy = fn(hidden, weight, targets)
    ((logp * grad_logp).sum() + (entropy * grad_entropy).sum()).backward()


def measure_errors(fn, inputs, num_tokens, reference) -> dict:
    """Max abs error of each output against `reference` (naive, the same cut) in fp64, on the first num_tokens
    tokens."""
    sub = {k: v[:num_tokens] for k, v in inputs.items() if k != "weight"}
    got, want = [], []
    for run_fn, dtype in ((fn, inputs["hidden"].dtype), (reference, torch.float64)):
        hidden = sub["hidden"].detach().to(dtype).requires_grad_()
        weight = inputs["weight"].detach().to(dtype).requires_grad_()
        logp, entropy = run_fn(hidden, weight, sub["targets"])
        (logp.double() @ sub["grad_logp"].double() + entropy.double() @ sub["grad_entropy"].double()).backward()
        outs = [logp, entropy, hidden.grad, weight.grad]
        (got if dtype != torch.float64 else want).append([o.detach() for o in outs])
        del hidden, weight, logp, entropy, outs
    names = ("err_logprob", "err_entropy", "err_dhidden", "err_dweight")
    return {name: float((g.double() - w).abs().max()) for name, g, w in zip(names, got[0], want[0])}


def ratio_lines(results) -> list[dict]:
    """Per shape and dtype: each backend's time and peak memory relative to naive (without a cut), and each
    cut's time relative to the same backend's without one."""
    done = [r for r in results if "time_ms" in r]
    lines = []
    for cut in (r for r in done if r.get("sampler", "none") != "none"):
        plain = next(
            (
                r
                for r in done
                if r.get("sampler", "none") == "none"
                and all(r[k] == cut[k] for k in ("backend", "blocks", "T", "D", "V", "dtype", "device"))
            ),
            None,
        )
        if plain is not None:
            lines.append(
                dict(
                    ratios=f"{cut['backend']} {cut['sampler']}/none",
                    device=cut["device"],
                    T=cut["T"],
                    D=cut["D"],
                    V=cut["V"],
                    dtype=cut["dtype"],
                    time_ratio=round(cut["time_ms"] / plain["time_ms"], 3),
                )
            )
    done = [r for r in done if r.get("sampler", "none") == "none"]
    for ref in (r for r in done if r["backend"] == "naive"):
        key = (ref["T"], ref["D"], ref["V"], ref["dtype"], ref["device"])
        for other in done:
            if other is ref or (other["T"], other["D"], other["V"], other["dtype"], other["device"]) != key:
                continue
            name = other["backend"] + (f"[{other['blocks']}]" if other.get("blocks") else "")
            lines.append(
                dict(
                    ratios=f"{name}/naive",
                    device=ref["device"],
                    T=ref["T"],
                    D=ref["D"],
                    V=ref["V"],
                    dtype=ref["dtype"],
                    time_ratio=round(other["time_ms"] / ref["time_ms"], 3),
                    peak_mem_ratio=round(other["peak_mem_bytes"] / ref["peak_mem_bytes"], 4),
                )
            )
    return lines


class CudaMemoryProbe:
    def start(self) -> None:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()

    def stop(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.base


class RssProbe:
    """Resident-set high-water mark of this process, reset before each step (Linux only)."""

    def start(self) -> None:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.base = _status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current VmRSS

    def stop(self) -> int:
        return _status_bytes("VmHWM") - self.base


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
