"""Three training steps of the tiny model with the policy sharded over every rank (FSDP2), for the
sharded-learner test. Run it under `torchrun --nproc-per-node N` (gloo on CPU).

Writes to OUT_DIR, from rank 0: `<case>.pt` (parameters after three steps, one run), `<case>-resumed.pt`
(one step, a checkpoint, a fresh sharded trainer restored from it, two more steps) and the
checkpoint itself under `<case>-checkpoint/` (for the test to resume on one unsharded rank); the
same with `-ddp` for the unsharded learner on the same ranks. The other ranks get checkpoint
folders of their own (`rank<r>-disk/`), as on machines that share no disk: they must stay empty.
With `--hsdp` (two torchrun "machines" of two ranks each: replicated over them, sharded within) the
first case alone, sharded, as `hsdp.pt` and `hsdp-resumed.pt`, and the mesh's shape in `hsdp.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the step builders live in conftest.py
from conftest import ALPHABET, STEP_VERSION, TINY, learner_config, leave_ranks, step_batch  # noqa: E402
from tidal.config import Aggregation, CheckpointConfig, FsdpConfig, LoraConfig, LossType  # noqa: E402

STEPS = 3
# name -> (learner_config arguments, FSDP settings, LoRA settings); five groups in 24-token micro-batches give
# the two ranks unequal numbers of micro-batches, so the weightless repeats that keep them in step are exercised;
# the LoRA case shards a frozen base beside an adapter on some of its layers' linear layers
CASES = {
    "cispo_uneven_micro_batches": (
        (LossType.cispo, Aggregation.prompt_mean, 24, 1, 5),
        FsdpConfig(enabled=True),
        LoraConfig(),
    ),
    "ppo_2updates_checkpointed": (
        (LossType.ppo, Aggregation.token_mean, 10_000, 2),
        FsdpConfig(enabled=True, reshard_after_forward=False, activation_checkpointing=True),
        LoraConfig(),
    ),
    "lora_cispo": (
        (LossType.cispo, Aggregation.prompt_mean, 10_000, 1),
        FsdpConfig(enabled=True),
        LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"), layers=(1,)),
    ),
}


def trainer_for(case: str, accelerator, sharded: bool):
    from tidal.learner.every_rank.trainer import Trainer
    from tidal.tiny import build_tiny_model

    args, fsdp, lora = CASES[case]
    cfg = dataclasses.replace(learner_config(*args), fsdp=fsdp if sharded else FsdpConfig(), lora=lora)
    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    return Trainer(cfg, model, accelerator, temperature=1.0)


def train(trainer, first: int, last: int) -> dict[str, torch.Tensor]:
    """Steps `first`..`last - 1` (step i trains on step batch i); the whole parameters on rank 0 after."""
    for i in range(first, last):
        groups, masks = step_batch(trainer.cfg.groups_per_step, seed=i)
        trainer.step(groups, masks, STEP_VERSION)
    return {k: v.clone() for k, v in trainer.export_state("float32").items()}


def checkpointer(trainer, accelerator, directory: Path):
    from tidal.learner.every_rank.checkpoint import Checkpointer

    return Checkpointer(CheckpointConfig(), directory, accelerator, trainer)


def main() -> None:
    from accelerate import Accelerator

    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--hsdp", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    runs = (
        [(next(iter(CASES)), True, "hsdp")]
        if args.hsdp
        else [(case, sharded, f"{case}{tag}") for case in CASES for sharded, tag in ((True, ""), (False, "-ddp"))]
    )
    for case, sharded, tag in runs:  # the same checks for the unsharded (DDP) learner
        straight = train(trainer_for(case, accelerator, sharded), 0, STEPS)
        first = trainer_for(case, accelerator, sharded)
        train(first, 0, 1)
        # each rank its own checkpoint folder, as on machines that share no disk: each writes its own part
        directory = args.out_dir / (f"{tag}-checkpoint" if rank == 0 else f"rank{rank}-disk-{tag}")
        saved = checkpointer(first, accelerator, directory).save(1, {})
        resumed = trainer_for(case, accelerator, sharded)
        checkpointer(resumed, accelerator, directory).load(directory / saved.name)
        after = train(resumed, 1, STEPS)
        if accelerator.is_main_process:
            torch.save(straight, args.out_dir / f"{tag}.pt")
            torch.save(after, args.out_dir / f"{tag}-resumed.pt")
            if args.hsdp:
                mesh = next(p for p in resumed.model.parameters()).device_mesh
                (args.out_dir / "hsdp.json").write_text(json.dumps({"mesh": list(mesh.shape)}))
    accelerator.wait_for_everyone()
    leave_ranks(accelerator)


if __name__ == "__main__":
    main()
