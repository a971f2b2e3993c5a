"""The learner on CUDA: a bf16 mixed-precision step moves every weight that has a gradient (fp32
master weights), matches the same step in fp32 on the CPU closely, and two ranks over NCCL make the
update one rank does."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import ALPHABET, CASES, TINY, gpu_check_report, learner_config, run_step
from tidal.ops.reachable import free_port
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
    agree = sum(
        int((torch.sign(params[k] - v) == torch.sign(reference_params[k] - v)).sum()) for k, v in initial.items()
    )
    assert agree > 0.9 * total  # each weight moves the way the fp32 step on the CPU moves it


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_ranks_over_nccl_make_the_same_update_as_one(tmp_path):
    port = free_port()  # outside the ephemeral range: a child binds it later
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
        str(SCRIPT),
        str(tmp_path),
        "--cuda",
    ]
    done = subprocess.run(cmd, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    from accelerate import Accelerator

    for name, case in CASES.items():
        expected, _ = run_step(learner_config(*case), Accelerator())
        params = torch.load(tmp_path / f"{name}.pt")
        assert json.loads((tmp_path / f"{name}.json").read_text())["world_size"] == 2
        for key, value in expected.items():
            torch.testing.assert_close(params[key].cpu(), value.cpu(), atol=1e-4, rtol=0, msg=f"{name}: {key}")


def one_gpu_fsdp(mode: str, tmp_path: Path) -> dict:
    """fsdp_one_gpu.py's numbers for `mode`, run under torchrun with one rank."""
    port = free_port()  # outside the ephemeral range: a child binds it later
    out = tmp_path / f"{mode}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        "--master-port",
        str(port),
        str(Path(__file__).with_name("fsdp_one_gpu.py")),
        mode,
        str(out),
    ]
    tests = str(Path(__file__).parents[1])
    env = os.environ | {"PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_fsdp_mixed_precision_keeps_no_half_precision_copy_of_the_model(tmp_path):
    """F9: under autocast with its cast cache, every gathered layer's bf16 copy outlives the layer;
    FSDP2's mixed precision gathers each unit in bf16 and frees it. The peak of one step, both ways."""
    mixed, autocast = one_gpu_fsdp("mixed", tmp_path), one_gpu_fsdp("autocast", tmp_path)
    saved = autocast["peak_bytes"] - mixed["peak_bytes"]
    gpu_check_report(
        "F9-peak-memory",
        params=mixed["params"],
        mixed_precision_peak_gib=mixed["peak_bytes"] / 2**30,
        autocast_peak_gib=autocast["peak_bytes"] / 2**30,
        saved_bytes_per_param=saved / mixed["params"],
    )
    assert mixed["peak_bytes"] < autocast["peak_bytes"]


def test_a_sharded_learner_offloading_to_host_memory_takes_a_step(tmp_path):
    """F6: the shards' gradient norm is reduced over CPU tensors: the group has a CPU backend beside NCCL."""
    offload = one_gpu_fsdp("offload", tmp_path)
    gpu_check_report("F6-cpu-offload-step", grad_norm=offload["grad_norm"], peak_gib=offload["peak_bytes"] / 2**30)
    assert offload["grad_norm"] > 0 and offload["grad_norm"] == offload["grad_norm"]
    assert offload["pushed_on_gpu"] == offload["tensors"]  # every shard gathered on the GPU, none over gloo


def test_auto_attention_takes_flash_attn_only_for_half_precision():
    """F8: flash-attn has no fp32 kernels: a learner computing in fp32 runs sdpa."""
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    from tidal.learner.every_rank.trainer import PolicyLogprobs, attention_implementation, load_policy
    from tidal.tiny import build_tiny_model

    assert attention_implementation("auto", "float32") == "sdpa"
    assert attention_implementation("auto", "bfloat16") == "flash_attention_2"
    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / "tidal-f8-model"
    model.save_pretrained(folder)
    policy = load_policy(str(folder), "float32", "auto").cuda()
    ids = torch.tensor([[2, 3, 4, 5]], device="cuda")
    logp, _ = PolicyLogprobs(policy, 1.0, "auto")(
        ids, torch.ones_like(ids), torch.arange(3, device="cuda"), torch.tensor([3, 4, 5], device="cuda")
    )
    assert torch.isfinite(logp).all()


def test_the_fp32_head_and_fp32_sums_track_each_other_and_bf16_logits_do_not():
    """N1 at 7B's head shape: logprobs from (a) fp32 weights and hidden states (the learner's fp32 head),
    (b) bf16 logits (vLLM's head in bf16), (c) bf16 weights and hidden states summed in fp32 (vLLM's
    head_dtype float32; the learner's model.head = served). (c) is (a) rounded once; (b) is far off."""
    torch.manual_seed(0)
    tokens, dim, vocab = 2048, 3584, 152064
    hidden = torch.randn(tokens, dim, device="cuda").bfloat16().float()  # the body computes in bf16
    weight = torch.randn(vocab, dim, device="cuda") * dim**-0.5 * 3  # logits of magnitude ~10-30
    targets = torch.randint(0, vocab, (tokens,), device="cuda")

    def logprobs(logits):
        return torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)

    exact = logprobs(hidden.double() @ weight.double().T)
    fp32 = logprobs(hidden @ weight.T)
    bf16_logits = logprobs(torch.nn.functional.linear(hidden.bfloat16(), weight.bfloat16()))
    fp32_sums = logprobs(torch.mm(hidden.bfloat16(), weight.bfloat16().T, out_dtype=torch.float32))
    gaps = {
        name: float((value - exact).abs().max())
        for name, value in (("fp32_head", fp32), ("bf16_logits", bf16_logits), ("bf16_weights_fp32_sums", fp32_sums))
    }
    gpu_check_report("N1-head-gaps", **{f"max_abs_logprob_gap_{k}": v for k, v in gaps.items()})
    assert gaps["fp32_head"] < 1e-3 and gaps["bf16_weights_fp32_sums"] < gaps["bf16_logits"] / 4
