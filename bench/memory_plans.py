"""Memory plans (tidal/ops/memory.py) of real models on one node of 8 GPUs, with the scalerl preset's
settings: for each model and GPU size, the layouts below in order (the most GPUs for generation
first), the first that fits chosen. Nothing is downloaded: the models' shapes come from the
config.json files in bench/models.

    python bench/memory_plans.py                    (the table of docs/gpu.md)
    python bench/memory_plans.py --gpus "80 GB" --models Qwen2.5-7B

Prints one JSON line per plan (every budget's total, capacity and terms, in bytes), then a Markdown
table of the chosen layouts, then the refusal of the first layout that did not fit.
"""

import argparse
import json
from pathlib import Path

from tidal.config import ConfigError, load_config
from tidal.ops.memory import Cluster, GiB, MiB, ModelShape, kv_cache_tokens, plan

MODELS = Path(__file__).parent / "models"
# every layout: sharded learner with activation checkpointing, engines limited to the preset's
# longest sample (sampling.max_tokens 14336 and a prompt) instead of the model's whole context
COMMON = ("learner.fsdp.enabled=true", "learner.fsdp.activation_checkpointing=true", "actor.vllm.max_model_len=16384")
LAYOUTS = {
    "learner 2 + 6 actors": ("learner.num_ranks=2", "actor.replicas=6"),
    "learner 4 + 4 actors": ("learner.num_ranks=4", "actor.replicas=4"),
    "learner 6 + 2 actors": ("learner.num_ranks=6", "actor.replicas=2"),
    "learner 4 (CPU offload) + 2 actors x TP 2": (
        "learner.num_ranks=4",
        "learner.fsdp.cpu_offload=true",
        "actor.replicas=2",
        "actor.vllm.tensor_parallel_size=2",
    ),
}
HOST_GIB = 2048  # one node's host memory
# GPU memory as the driver reports it (nvidia-smi, MiB): what the learner and vLLM can take, a little
# less than the GB on the box
GPU_MIB = {"80 GB": 81559, "141 GB": 143771}


def plans_for(shape: ModelShape, cluster: Cluster):
    """(layout, config, plan, refusal or None) per layout, in order."""
    for layout, overrides in LAYOUTS.items():
        cfg = load_config("scalerl", [*COMMON, *overrides])
        result = plan(cfg, shape, cluster)
        try:
            result.check()
            yield layout, cfg, result, None
        except ConfigError as err:
            yield layout, cfg, result, str(err)


def row(shape: ModelShape, gpu: str, chosen, refused: list) -> str:
    """One Markdown row: the chosen layout's budgets, used of capacity in GiB, and what was refused."""
    layout, cfg, result, _ = chosen
    cells = [shape.name, f"8 x {gpu}", layout]
    for device in ("learner GPU", "actor GPU, vLLM's share", "actor GPU, outside vLLM's share", "learner host, node 0"):
        b = result.budget(device)
        cells.append(f"{b.total_bytes / GiB:.1f} / {b.capacity_bytes / GiB:.1f}")
    cells.append(f"{kv_cache_tokens(result, cfg):,}")
    cells.append(
        "; ".join(
            f"{name}: {res.budgets[[b.fits for b in res.budgets].index(False)].device}" for name, _, res, _ in refused
        )
        or "-"
    )
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| model | GPUs | layout | learner GPU | actor GPU, vLLM's share | actor GPU, outside | host, node 0 | "
    "KV cache tokens an engine | refused first (over) |\n|" + " --- |" * 9
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="Qwen2.5-7B,Qwen2.5-14B,Qwen2.5-32B,Qwen3-30B-A3B")
    parser.add_argument("--gpus", default=",".join(GPU_MIB), help=f"GPU kinds, comma-separated: {', '.join(GPU_MIB)}")
    args = parser.parse_args()
    rows, refusals = [], []
    for name in args.models.split(","):
        shape = ModelShape.from_config(MODELS / name)
        print(
            json.dumps(
                {
                    "model": name,
                    "num_params": shape.num_params,
                    "active_params": shape.active_params,
                    "largest_tensor_params": shape.largest_tensor_params,
                }
            )
        )
        for gpu in args.gpus.split(","):
            evaluated = list(plans_for(shape, Cluster(GPU_MIB[gpu] * MiB, 8, HOST_GIB * GiB)))
            for layout, _, result, refusal in evaluated:
                print(
                    json.dumps(
                        {
                            "layout": layout,
                            "overrides": [*COMMON, *LAYOUTS[layout]],
                            **result.to_json(),
                            "refusal": refusal,
                        }
                    )
                )
            fitting = [e for e in evaluated if e[3] is None]
            refused = evaluated[: evaluated.index(fitting[0])] if fitting else evaluated
            refusals += [(name, gpu, e[0], e[3]) for e in refused]
            rows.append(
                row(shape, gpu, fitting[0], refused) if fitting else f"| {name} | 8 x {gpu} | nothing fits |" + " |" * 6
            )
    print(f"\n{HEADER}\n" + "\n".join(rows))
    if refusals:
        name, gpu, layout, text = refusals[0]
        print(f"\n{name}, {layout}, on 8 x {gpu}:\n\n    {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
