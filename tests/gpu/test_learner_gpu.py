"""The learner on CUDA: a bf16 mixed-precision step moves every weight that has a gradient (fp32
master weights), matches the same step in fp32 on the CPU closely, and two ranks over NCCL make the
update one rank does."""
import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import ALPHABET, CASES, TINY, learner_config, run_step
from tidal.tiny import build_tiny_model

SCRIPT = Path(__file__).parents[1] / "integration" / "multirank_step.py"


def test_a_bf16_step_on_cuda_moves_every_weight_and_tracks_fp32(fresh_accelerator):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # With a tiny Adam eps the first step moves every weight that has a gradient by about lr = 5e-7,
    # against its gradient's sign: a change fp32 master weights keep and bf16 ones (8 bits) would lose.
    base = learner_config(*CASES["cispo_prompt_mean"])
    cfg = replace(base, kernel_backend="auto", optim=replace(base.optim, lr=5e-7, eps=1e-8))
    params, metrics = run_step(cfg, Accelerator(mixed_precision="bf16"))
    AcceleratorState._reset_state(reset_partial_state=True)
    reference_params, reference = run_step(cfg, Accelerator(cpu=True))
    assert all(p.dtype == torch.float32 for p in params.values())
    assert metrics["learner/loss"] == pytest.approx(reference["learner/loss"], rel=2e-2, abs=1e-3)
    initial = build_tiny_model(TINY, ALPHABET, seed=0)[0].state_dict()
    total = sum(v.numel() for v in initial.values())
    moved = sum(int((params[k] != v).sum()) for k, v in initial.items())
    assert moved > 0.99 * total
    agree = sum(int((torch.sign(params[k] - v) == torch.sign(reference_params[k] - v)).sum())
                for k, v in initial.items())
    assert agree > 0.9 * total  # each weight moves the way the fp32 step on the CPU moves it


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_ranks_over_nccl_make_the_same_update_as_one(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           str(SCRIPT), str(tmp_path), "--cuda"]
    done = subprocess.run(cmd, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    from accelerate import Accelerator

    for name, case in CASES.items():
        expected, _ = run_step(learner_config(*case), Accelerator())
        params = torch.load(tmp_path / f"{name}.pt")
        assert json.loads((tmp_path / f"{name}.json").read_text())["world_size"] == 2
        for key, value in expected.items():
            torch.testing.assert_close(params[key].cpu(), value.cpu(), atol=1e-4, rtol=0, msg=f"{name}: {key}")
