"""One training step of the tiny model on a fixed step batch, on every rank, for the multi-rank test.

Run it under `torchrun --nproc-per-node N` (gloo on CPU; `--cuda`: NCCL, a GPU per rank): rank 0 writes the
parameters after each case's step (`<case>.pt`) and the metrics (`<case>.json`) to OUT_DIR;
every rank that refuses a step batch too small to share writes `too_few_groups_rank<r>.txt`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the step builders live in conftest.py
from conftest import CASES, learner_config, leave_ranks, run_step  # noqa: E402
from tidal.config import Aggregation, LossType  # noqa: E402


def main() -> None:
    from accelerate import Accelerator

    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--cuda", action="store_true", help="one GPU per rank, NCCL (default: CPU, gloo)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=not args.cuda)
    for name, case in CASES.items():
        params, metrics = run_step(learner_config(*case), accelerator)
        if accelerator.is_main_process:
            torch.save(params, args.out_dir / f"{name}.pt")
            (args.out_dir / f"{name}.json").write_text(json.dumps(metrics | {"world_size": accelerator.num_processes}))
    # one group cannot be shared by two ranks: every rank must raise (none may wait in a collective)
    try:
        run_step(learner_config(LossType.cispo, Aggregation.prompt_mean, 10_000, 1, num_groups=1), accelerator)
    except ValueError as err:
        (args.out_dir / f"too_few_groups_rank{accelerator.process_index}.txt").write_text(str(err))
    accelerator.wait_for_everyone()
    leave_ranks(accelerator)


if __name__ == "__main__":
    main()
