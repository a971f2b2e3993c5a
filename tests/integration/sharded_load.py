"""A sharded learner built empty and loaded from a model folder, as `tidal learner` builds one, for
the sharded-load test. Run it under `torchrun --nproc-per-node N` (gloo on CPU): `python
sharded_load.py MODEL_DIR OUT_JSON [--lora]` builds the policy on the meta device, shards it over the
ranks, loads MODEL_DIR's weights and has rank 0 write whether every tensor equals transformers' own load;
with --lora the policy carries an adapter (LORA) too, and rank 0 also writes whether its starting values
are an unsharded policy's."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the step builders live in conftest.py
from tidal.config import LoraConfig  # noqa: E402

# an adapter on some linear layers of the second decoder layer: base layers adapted and not, side by side
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"), layers=(1,))


def main() -> None:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from conftest import learner_config, leave_ranks
    from tidal.config import Aggregation, FsdpConfig, LoraConfig, LossType
    from tidal.learner.every_rank.trainer import Trainer, load_policy

    model_dir, out = sys.argv[1], Path(sys.argv[2])
    lora = LORA if "--lora" in sys.argv[3:] else LoraConfig()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    cfg = dataclasses.replace(
        learner_config(LossType.cispo, Aggregation.prompt_mean, 10_000, 1), fsdp=FsdpConfig(enabled=True), lora=lora
    )
    trainer = Trainer(
        cfg, load_policy(model_dir, "float32", "sdpa", empty=True), accelerator, temperature=1.0, model_path=model_dir
    )
    loaded = trainer.export_state("float32")  # a LoRA policy's: merged (B = 0: the base), and the adapter
    if accelerator.is_main_process:
        expected = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        adapter = unsharded_adapter(model_dir, lora, cfg.seed) if lora.enabled else {}
        wrong = sorted(k for k, v in (expected | adapter).items() if k not in loaded or not torch.equal(loaded[k], v))
        out.write_text(
            json.dumps(
                {"tensors": len(expected), "adapter_tensors": len(adapter), "wrong": wrong, "names": sorted(loaded)}
            )
        )
    accelerator.wait_for_everyone()
    leave_ranks(accelerator)


def unsharded_adapter(model_dir: str, lora, seed: int) -> dict:
    """The adapter an unsharded policy starts with, under PEFT's names."""
    from tidal.learner.every_rank import lora as adapters
    from tidal.learner.every_rank.trainer import load_policy

    policy = load_policy(model_dir, "float32")
    adapters.attach(policy, lora, "float32")
    adapters.initialize(policy, seed)
    return {adapters.peft_name(k): v for k, v in policy.state_dict().items() if adapters.is_adapter(k)}


if __name__ == "__main__":
    main()
