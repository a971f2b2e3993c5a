"""The policy sharded over the learner's ranks with torch FSDP2 (`learner.fsdp`).

Each decoder layer is one FSDP unit and the rest of the model (embeddings, final norm, the tied LM
head) the root unit: a layer's parameters are gathered just before it runs and freed after, so no
rank holds more than its shard plus one layer. `fully_shard` is called directly rather than through
Accelerate's plugin, so the same code shards on CPU (gloo) and on GPUs (NCCL); Accelerate still
launches the ranks, sets up the process group and supplies the autocast of mixed precision.

Everything that reads the whole model (a checkpoint, the final export, a weight push) goes through
the collectives below, which every rank must call at the same point: a weight push gathers one
tensor at a time, in the dtype the actors serve, for rank 0 to copy into its payload. Checkpoints keep the
unsharded layout (parameters under the model's own names, optimizer state by parameter index), so a
run saved sharded resumes unsharded and back.
"""
from __future__ import annotations

import logging

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tidal.config import FsdpConfig

log = logging.getLogger(__name__)

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered whole, on rank 0, in host memory
PREFIX = "policy."  # the policy's names inside the module the trainer shards (PolicyLogprobs)


def shard(module: torch.nn.Module, layers: torch.nn.ModuleList, cfg: FsdpConfig, device: torch.device):
    """Shard `module` in place over every rank: each of `layers` its own unit, the rest the root's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    offload = cfg.cpu_offload and device.type == "cuda"
    if cfg.cpu_offload and not offload:
        log.info("learner.fsdp.cpu_offload ignored: the learner already runs on the CPU")
    kwargs = {"mesh": mesh, **({"offload_policy": CPUOffloadPolicy()} if offload else {})}
    for layer in layers:
        if cfg.activation_checkpointing:
            checkpoint_activations(layer)
        fully_shard(layer, reshard_after_forward=cfg.reshard_after_forward, **kwargs)
    fully_shard(module, **kwargs)
    return module


def checkpoint_activations(layer: torch.nn.Module) -> None:
    """Recompute `layer`'s activations in the backward pass instead of keeping them."""
    from torch.distributed._composable import checkpoint

    checkpoint(layer)


def full_model_state(module) -> dict[str, torch.Tensor]:
    """Collective: the policy's whole state dict (its own names) on rank 0, empty on the others."""
    state = get_model_state_dict(module, options=FULL)
    return {k.removeprefix(PREFIX): v for k, v in state.items()}


def gathered_weights(module, dtype: str | None, with_aliases: bool = True):
    """Collective, every rank iterating: (entries [(name, dtype, shape)], (name, tensor) pairs) of the
    policy's state (a tied tensor under each name, or once), each tensor cast to `dtype` (None: as it
    is) on its shard and gathered whole just before it is yielded: a rank holds one whole tensor at a time."""
    from torch.distributed.tensor import DTensor

    from tidal.broker.weights.payload import without_aliases

    target = getattr(torch, dtype) if dtype else None
    state = module.state_dict() if with_aliases else without_aliases(module.state_dict())

    def cast(value):
        return value.to(target) if target is not None and value.is_floating_point() else value

    entries = [(name.removeprefix(PREFIX), target if target is not None and value.is_floating_point() else value.dtype,
                tuple(value.shape)) for name, value in state.items()]

    def pairs():
        for name, value in state.items():
            value = cast(value)
            yield name.removeprefix(PREFIX), value.full_tensor() if isinstance(value, DTensor) else value
    return entries, pairs()


def full_optimizer_state(module, optimizer) -> dict:
    """Collective: AdamW's whole state on rank 0 as `optimizer.state_dict()` of an unsharded
    model gives it (keyed by parameter index); empty on the others."""
    state = get_optimizer_state_dict(module, optimizer, options=FULL)
    if not state:
        return {}
    index = _parameter_index(module)
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [g | {"params": [index[name] for name in g["params"]]} for g in state["param_groups"]]}


def load_full_state(module, optimizer, model_state: dict | None, optimizer_state: dict | None) -> None:
    """Collective: rank 0 passes a whole state in the layout of full_*_state (the others None) and
    every rank keeps its shard of it; rank 0 sends each tensor, so no other rank reads a file."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    if model_state is None:
        set_model_state_dict(module, {}, options=options)
        set_optimizer_state_dict(module, optimizer, {}, options=options)
        return
    set_model_state_dict(module, {PREFIX + k: v for k, v in model_state.items()}, options=options)
    name = {i: n for n, i in _parameter_index(module).items()}
    groups = optimizer_state["param_groups"]
    by_name = {"state": {name[i]: value for i, value in optimizer_state["state"].items()},
               "param_groups": [g | {"params": [name[i] for i in g["params"]]} for g in groups]}
    set_optimizer_state_dict(module, optimizer, by_name, options=options)


def _parameter_index(module) -> dict[str, int]:
    """Each parameter's name and its index in `module.parameters()`, the optimizer's order."""
    return {name: i for i, (name, _) in enumerate(module.named_parameters())}


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
