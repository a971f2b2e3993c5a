"""A sharded learner built empty and loaded from a model folder, as `tidal learner` builds one, for
the sharded-load test. Run it under `torchrun --nproc-per-node N` (gloo on CPU): `python
sharded_load.py MODEL_DIR OUT_JSON` builds the policy on the meta device, shards it over the ranks,
loads MODEL_DIR's weights and has rank 0 write whether every tensor equals transformers' own load."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the step builders live in conftest.py


def main() -> None:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from conftest import learner_config
    from tidal.config import Aggregation, FsdpConfig, LossType
    from tidal.learner.trainer import Trainer, load_policy

    model_dir, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    cfg = dataclasses.replace(learner_config(LossType.cispo, Aggregation.prompt_mean, 10_000, 1),
                              fsdp=FsdpConfig(enabled=True))
    trainer = Trainer(cfg, load_policy(model_dir, "float32", "sdpa", empty=True), accelerator, temperature=1.0,
                      model_path=model_dir)
    loaded = trainer.export_state("float32")
    if accelerator.is_main_process:
        expected = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        wrong = sorted(k for k, v in expected.items() if k not in loaded or not torch.equal(loaded[k], v))
        out.write_text(json.dumps({"tensors": len(expected), "wrong": wrong, "names": sorted(loaded)}))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
