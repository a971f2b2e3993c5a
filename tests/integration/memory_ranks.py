"""Each learner rank's peak host memory while a sharded learner builds, steps and checkpoints, against
its shard's size. Run it under `torchrun --nproc-per-node N` (gloo on CPU): `python memory_ranks.py
MODEL_DIR OUT_DIR` builds the learner as `tidal learner` does (the policy empty, each rank reading its
own rows of MODEL_DIR's weights), takes one step, saves a checkpoint, and writes every rank's numbers
to OUT_DIR/memory-rank<r>.json. The model folder comes from `write_model` (a Qwen2 of `SHAPE`)."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch

SHAPE = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 8000,
    "tie_word_embeddings": False,
}


def write_model(folder: Path) -> int:
    """A Qwen2 of SHAPE saved in bf16 to `folder` (with the tiny model's tokenizer); its fp32 bytes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, max_position_embeddings=512))
    model.to(torch.bfloat16).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters()) * 4


class PeakMemory:
    """The process's own memory (resident, less the pages it shares with files: a model file mapped by
    every rank of a machine is in its page cache once), sampled every few milliseconds."""

    def __init__(self):
        import psutil

        self.process = psutil.Process()
        self.peak = 0
        self.done = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def now(self) -> int:
        info = self.process.memory_info()
        return info.rss - info.shared

    def _sample(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, self.now())

    def phase(self, fn):
        """(peak growth over the memory at the start, fn's result)."""
        start = self.peak = self.now()
        result = fn()
        self.peak = max(self.peak, self.now())
        return self.peak - start, result


def check_loaded(trainer, model_dir: Path) -> None:
    """Collective: rank 0 finds every tensor of the policy as the model folder holds it (each rank
    having read only its own rows)."""
    from safetensors.torch import load_file

    loaded = trainer.export_state("float32")
    if loaded:
        saved = load_file(str(model_dir / "model.safetensors"))
        assert loaded.keys() == saved.keys(), sorted(set(loaded) ^ set(saved))
        wrong = [k for k, v in saved.items() if not torch.equal(loaded[k], v.float())]
        assert not wrong, f"loaded otherwise than saved: {wrong}"


def main() -> None:
    import dataclasses

    from accelerate import Accelerator

    from conftest import STEP_VERSION, learner_config, step_batch
    from tidal.config import Aggregation, CheckpointConfig, FsdpConfig, LossType
    from tidal.learner.every_rank.checkpoint import Checkpointer
    from tidal.learner.every_rank.trainer import Trainer, load_policy

    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    import torch.distributed.checkpoint  # noqa: F401  imported before the phases: they measure the work alone
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    rss = PeakMemory()
    # what every rank did before building empty: the whole model, in fp32, before sharding it
    whole_bytes, whole = rss.phase(
        lambda: AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=torch.float32)
    )
    del whole
    cfg = dataclasses.replace(
        learner_config(LossType.cispo, Aggregation.prompt_mean, 64, 1, num_groups=2), fsdp=FsdpConfig(enabled=True)
    )
    # AdamW's state, which the trainer takes as it starts, measured as a phase of its own
    from tidal.learner.every_rank import trainer as trainer_module

    allocate, optimizers = trainer_module.allocate_state, []
    trainer_module.allocate_state = optimizers.append
    build_bytes, trainer = rss.phase(
        lambda: Trainer(
            cfg,
            load_policy(str(args.model_dir), "float32", empty=True),
            accelerator,
            1.0,
            model_path=str(args.model_dir),
        )
    )
    state_bytes, _ = rss.phase(lambda: allocate(*optimizers))
    shard_bytes = sum(p.to_local().numel() * 4 for p in trainer.model.parameters())
    check_loaded(trainer, args.model_dir)
    groups, masks = step_batch(2, seed=0)
    step_bytes, _ = rss.phase(lambda: trainer.step(groups, masks, STEP_VERSION))
    checkpointer = Checkpointer(CheckpointConfig(), args.out_dir / "checkpoints", accelerator, trainer)
    save_bytes, _ = rss.phase(lambda: checkpointer.save(1, {}))
    rss.done.set()
    (args.out_dir / f"memory-rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "shard_bytes": shard_bytes,
                "whole_load_peak_bytes": whole_bytes,
                "build_peak_bytes": build_bytes,
                "state_peak_bytes": state_bytes,
                "step_peak_bytes": step_bytes,
                "checkpoint_peak_bytes": save_bytes,
                "at": time.time(),
            }
        )
    )
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
