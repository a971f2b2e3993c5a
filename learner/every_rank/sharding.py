"""The policy sharded over the learner's ranks with torch FSDP2 (`learner.fsdp`).

Each decoder layer is one FSDP unit and the rest of the model (embeddings, final norm, the tied LM
head) the root unit: a layer's parameters are gathered just before it runs and freed after, so no
rank holds more than its shard plus one layer. `fully_shard` is called directly rather than through
Accelerate's plugin, so the same code shards on CPU (gloo) and on GPUs (NCCL); Accelerate still
launches the ranks, sets up the process group and supplies the autocast of mixed precision.

Everything that reads the whole model (the final export, a weight push) goes through the
collectives below, which every rank must call at the same point: a weight push gathers one tensor at
a time, in the dtype the actors serve, for rank 0 to copy into its payload. A checkpoint is written
by every rank, each its own shards (learner/every_rank/state_files.py), so no rank ever holds the whole model.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from tidal.config import FsdpConfig
from tidal.learner.every_rank import lora

log = logging.getLogger(__name__)

PREFIX = "policy."  # the policy's names inside the module the trainer shards (PolicyLogprobs)


def shard(
    module: torch.nn.Module,
    layers: torch.nn.ModuleList,
    head: torch.nn.Module | None,
    cfg: FsdpConfig,
    device: torch.device,
    mixed_precision: str = "no",
    head_dtype: torch.dtype | None = torch.float32,
):
    """Shard `module` in place over the ranks: each of `layers` its own unit, `head` (an untied LM head,
    or None) its own unit in `head_dtype`, the rest the root's. Under learner.mixed_precision bf16 the
    units gather their parameters in bf16 and reduce gradients in fp32 (the master weights stay fp32)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    offload = offloaded(cfg, device)
    if cfg.cpu_offload and not offload:
        log.info("learner.fsdp.cpu_offload ignored: the learner already runs on the CPU")
    half = torch.bfloat16 if mixed_precision == "bf16" else None
    kwargs = {"mesh": device_mesh(device, cfg), **({"offload_policy": CPUOffloadPolicy()} if offload else {})}
    body = {"mp_policy": MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)} if half else {}
    for i, layer in enumerate(layers):
        if cfg.activation_checkpointing:
            checkpoint_activations(layer)
        # the last layer's backward comes right after its forward: keeping it gathered saves a gather
        fully_shard(layer, reshard_after_forward=cfg.reshard_after_forward and i < len(layers) - 1, **kwargs, **body)
    if head is not None:
        policy = MixedPrecisionPolicy(param_dtype=head_dtype or half, reduce_dtype=torch.float32)
        fully_shard(head, reshard_after_forward=False, mp_policy=policy, **kwargs)
    # the root holds the embedding (and a tied head): under the fp32 head it stays fp32 too
    root = (
        {"mp_policy": MixedPrecisionPolicy(param_dtype=head_dtype, reduce_dtype=torch.float32)}
        if half and head is None and head_dtype is not None
        else body
    )
    fully_shard(module, **kwargs, **root)
    return module


def offloaded(cfg: FsdpConfig, device: torch.device) -> bool:
    """Whether the shards live in host memory (learner.fsdp.cpu_offload; on a GPU learner only)."""
    return cfg.cpu_offload and device.type == "cuda"


def head_dtype(head: str) -> torch.dtype | None:
    """The dtype an LM head unit gathers its weight in: fp32 for model.head = fp32, else the body's."""
    return torch.float32 if head == "fp32" else None


def device_mesh(device: torch.device, cfg: FsdpConfig):
    """Every rank in one dimension; with several machines (LOCAL_WORLD_SIZE ranks each) and
    learner.fsdp.replicate_over_nodes, two: replicated across machines, sharded within each (HSDP)."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if cfg.replicate_over_nodes and 1 < per_node < world and world % per_node == 0:
        return init_device_mesh(device.type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world,))


def load_pretrained(module: torch.nn.Module, model_path: str, device: torch.device, offload: bool = False) -> None:
    """Give an empty sharded `module` (parameters on the meta device, buffers real) storage on
    `device` (its parameters in host memory when `offload`) and its weights from the Hugging Face
    checkpoint in `model_path`: each rank reads only the rows of its own shards, so no rank ever
    holds the whole model. A checkpoint whose tensors transformers converts as it loads them (a MoE
    layer's experts, one file tensor each, fused into one tensor per projection) cannot be read by
    rows: rank 0 loads it whole, in host memory, and sends each rank its shards."""
    import torch.distributed.checkpoint as dcp

    from tidal.broker.weights import without_aliases

    buffers = {name: b for name, b in module.named_buffers() if b.device.type != "meta"}
    module.to_empty(device="cpu" if offload else device)  # FSDP's offload keeps the shards in host memory
    for name, buffer in buffers.items():  # to_empty leaves every buffer uninitialized: the computed ones back
        owner, _, attr = name.rpartition(".")
        module.get_submodule(owner)._buffers[attr] = buffer.to(device)
    # the base's tensors under the checkpoint's names (a LoRA-adapted layer's weight is its base_layer's);
    # a LoRA adapter is not in the checkpoint (lora.initialize gives it its values)
    own = get_model_state_dict(module)
    names = {lora.model_name(k.removeprefix(PREFIX)): k for k in without_aliases(own) if not lora.is_adapter(k)}
    state = {name: own[k] for name, k in names.items()}
    missing = sorted(set(state) - checkpoint_names(model_path))
    if missing:
        log.info(
            "%s names %d of the policy's tensors otherwise (e.g. %s): rank 0 loads it whole and sends each "
            "rank its shards",
            model_path,
            len(missing),
            missing[0],
        )
        whole = whole_on_rank0(model_path, next(iter(state.values())).dtype)
        set_model_state_dict(
            module,
            {names.get(k, PREFIX + k): v for k, v in whole.items()},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
        )
        return
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(model_path))
    set_model_state_dict(module, {names[k]: v for k, v in state.items()}, options=StateDictOptions(strict=False))


def checkpoint_names(model_path: str) -> set[str]:
    """The tensor names of the Hugging Face checkpoint in `model_path` (its safetensors files)."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    index = Path(model_path) / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in Path(model_path).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    return names


def whole_on_rank0(model_path: str, dtype: torch.dtype) -> dict:
    """Rank 0: the model's state dict as transformers loads it, in host memory, under the model's own
    names; the other ranks: nothing (they receive their shards)."""
    if torch.distributed.get_rank() != 0:
        return {}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return dict(model.state_dict())


def checkpoint_activations(layer: torch.nn.Module) -> None:
    """Recompute `layer`'s activations in the backward pass instead of keeping them."""
    from torch.distributed._composable import checkpoint

    checkpoint(layer)


def gathered_weights(module, dtype: str | None, select=None):
    """Collective, every rank iterating: (entries [(name, dtype, shape)], (name, tensor) pairs) of the
    policy's state (a tied tensor under each name; with `select`, the names it keeps), each tensor cast to
    `dtype` (None: as it is) on its shard and gathered whole just before it is yielded: a rank holds one
    whole tensor at a time."""
    from torch.distributed.tensor import DTensor

    target = getattr(torch, dtype) if dtype else None
    state = {k: v for k, v in module.state_dict().items() if select is None or select(k.removeprefix(PREFIX))}

    def cast(value):
        return value.to(target) if target is not None and value.is_floating_point() else value

    entries = [
        (
            name.removeprefix(PREFIX),
            target if target is not None and value.is_floating_point() else value.dtype,
            tuple(value.shape),
        )
        for name, value in state.items()
    ]

    def pairs():
        for name, value in state.items():
            value = cast(on_gpu(value))
            yield name.removeprefix(PREFIX), value.full_tensor() if isinstance(value, DTensor) else value

    return entries, pairs()


def on_gpu(value):
    """An offloaded shard (in host memory, its mesh on GPUs) copied to this rank's GPU, so that it is
    gathered by NCCL rather than over gloo; anything else as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor) or value.device.type != "cpu" or value.device_mesh.device_type == "cpu":
        return value
    local = value.to_local().to(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)
    return DTensor.from_local(local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride())


def clip_grad_norm(parameters, max_norm: float) -> float:
    """The 2-norm of every rank's gradient shards together, as one unsharded gradient would have it;
    with max_norm > 0 the gradients are scaled down to it, as torch.nn.utils.clip_grad_norm_ does."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    coef = max_norm / (norm + 1e-6)
    if max_norm > 0 and coef < 1:
        torch._foreach_mul_(grads, coef)
    return norm
