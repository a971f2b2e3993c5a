"""What an offloaded learner's optimizer step gains from the cores its rank owns: torch's AdamW (the
step FSDP's CPU offload runs on the host, with the gradient norm and the clip beside it) over fp32
parameters and gradients in host memory, at 1 thread and at each count up to this process's cores, in
one run, alternating, as ratios of the 1-thread time (medians of --repeats).

    python bench/offload_threads.py                    # 64M parameters in 64 tensors, 1..cores threads
    python bench/offload_threads.py --params 256e6 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def step_seconds(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, threads: int) -> float:
    torch.set_num_threads(threads)
    start = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=64e6)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    size = int(args.params) // args.tensors
    params = [torch.nn.Parameter(torch.randn(size)) for _ in range(args.tensors)]
    for p in params:
        p.grad = torch.randn(size)
    # foreach off: FSDP2's offloaded DTensors take the per-tensor path; fused kernels are CUDA-only here
    optimizer = torch.optim.AdamW(params, lr=1e-6, foreach=False)
    counts = sorted({1, *range(2, len(os.sched_getaffinity(0)) + 1)})
    step_seconds(params, optimizer, 1)  # the moment buffers are made on the first step
    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(args.repeats):
        for n in counts:
            times[n].append(step_seconds(params, optimizer, n))
    base = statistics.median(times[1])
    for n in counts:
        print(
            json.dumps(
                {
                    "threads": n,
                    "params": size * args.tensors,
                    "median_step_s": round(statistics.median(times[n]), 4),
                    "speedup_over_1": round(base / statistics.median(times[n]), 3),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
