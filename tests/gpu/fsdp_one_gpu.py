"""A sharded learner on one GPU (FSDP2 over a world of one, under `torchrun --nproc-per-node 1`), for the
GPU checks of its memory and precision: `python fsdp_one_gpu.py MODE OUT_JSON`, MODE one of

    mixed     learner.mixed_precision bf16: FSDP2's mixed precision (bf16 gathers, fp32 reduction)
    autocast  fp32 units stepped under torch.autocast with its cast cache on (how the learner once ran)
    offload   learner.fsdp.cpu_offload: shards in host memory, the group with a CPU backend beside NCCL;
              built empty and loaded from a saved folder as `tidal learner` does, and its weights
              gathered for a push after the step (each shard gathered on the GPU)

Each takes one step of a random Qwen2 of SHAPE and writes its peak CUDA memory and gradient norm."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}


def main() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from conftest import STEP_VERSION, learner_config, step_batch
    from tidal.config import Aggregation, FsdpConfig, LossType
    from tidal.learner.build import build_accelerator
    from tidal.learner.every_rank.trainer import Trainer, load_policy

    mode, out = sys.argv[1], Path(sys.argv[2])
    base = learner_config(LossType.cispo, Aggregation.prompt_mean, 4096, 1, num_groups=4)
    cfg = dataclasses.replace(
        base,
        kernel_backend="auto",
        mixed_precision="bf16" if mode == "mixed" else "no",
        fsdp=FsdpConfig(enabled=True, cpu_offload=mode == "offload"),
    )
    accelerator = build_accelerator(cfg)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, max_position_embeddings=512, attn_implementation="sdpa"))
    folder = None
    if mode == "offload":
        folder = out.with_suffix(".model")
        model.save_pretrained(folder)
        model = load_policy(str(folder), "float32", "sdpa", empty=True)
    trainer = Trainer(cfg, model, accelerator, temperature=1.0, model_path=str(folder) if folder else None)
    groups, masks = step_batch(4, seed=0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with torch.autocast("cuda", torch.bfloat16, enabled=mode == "autocast"):
        metrics = trainer.step(groups, masks, STEP_VERSION)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    entries, pairs = trainer.weights("bfloat16")
    pushed = sum(1 for _, tensor in pairs if tensor.dtype == torch.bfloat16 and tensor.is_cuda)
    out.write_text(
        json.dumps(
            {
                "mode": mode,
                "params": sum(math.prod(shape) for _, _, shape in entries),
                "peak_bytes": peak,
                "grad_norm": metrics["learner/grad_norm"],
                "pushed_on_gpu": pushed,
                "tensors": len(entries),
            }
        )
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
