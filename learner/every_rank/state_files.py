"""The policy and AdamW's state as files, every learner rank writing its own part and reading what
its own part needs (torch.distributed.checkpoint, in its safetensors layout: nothing pickled).

    <dir>/model/shard-0000<r+1>-model-00001-of-00001.safetensors      the policy's trained parameters (under
                                                                      learner.lora its adapter alone), by name
    <dir>/optimizer/shard-0000<r+1>-model-00001-of-00001.safetensors  AdamW's tensors, by parameter name

A sharded learner's rank writes its shards; a tensor every rank holds whole is written once, by rank
0 (so an unsharded learner's rank 0 writes it all); replicated over machines (HSDP), the first
machine's ranks write the shards, and on resume send them to the other machines. The tensors' whole
shapes travel beside the files (in the JSON `save` returns), so a rank can load from a folder that
holds only its own machine's parts, as long as the layout is the one it was saved with; any other
layout (a sharded run resumed unsharded, or on other ranks) reads from a folder with every rank's
part, and a part missing for what a rank holds is an error naming the tensor, never a tensor loaded
in part.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tidal.broker.weights import without_aliases
from tidal.learner.every_rank.ranks import broadcast_tensors
from tidal.learner.every_rank.sharding import PREFIX

OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)  # AdamW's state keyed by parameter name


def save(module, optimizer, directory: Path) -> dict:
    """Collective: the policy and AdamW's tensors into `directory`, every rank its own part. Returns
    the rest as JSON values for rank 0 to keep: AdamW's hyperparameters by parameter name, and every
    tensor's whole shape."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    model, optim = _model_state(module), get_optimizer_state_dict(module, optimizer, options=OPTIMIZER)
    tensors = {k: v for k, v in optim.items() if torch.is_tensor(v)}
    for part, state in (("model", model), ("optimizer", tensors)):
        dcp.save(
            state,
            storage_writer=dcp.HuggingFaceStorageWriter(str(directory / part), save_distributed=True),
            planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
            no_dist=not _distributed(),
        )
    hyper = {k: list(v) if isinstance(v, tuple) else v for k, v in optim.items() if not torch.is_tensor(v)}
    return {"optimizer": hyper, "shapes": {k: list(v.shape) for k, v in (model | tensors).items()}}


def load(module, optimizer, directory: Path, rest: dict) -> None:
    """Collective: the policy and AdamW's state from what `save` wrote (`rest` as it returned it),
    each rank reading what its own part needs."""
    model = _model_state(module)
    _load(model, directory / "model", rest["shapes"])
    set_model_state_dict(module, {PREFIX + k: v for k, v in model.items()}, options=StateDictOptions(strict=False))
    optim = get_optimizer_state_dict(module, optimizer, options=OPTIMIZER)  # makes AdamW's state to load into
    tensors = {k: v for k, v in optim.items() if torch.is_tensor(v)}
    _load(tensors, directory / "optimizer", rest["shapes"])
    hyper = {k: tuple(v) if k.endswith(".betas") else v for k, v in rest["optimizer"].items()}
    set_optimizer_state_dict(module, optimizer, {**tensors, **hyper}, options=OPTIMIZER)


def trained_state(policy) -> dict:
    """The policy's state as a checkpoint holds it, under the model's names: every tensor once, the frozen
    parameters left out (under learner.lora the whole base)."""
    return _trained(policy.state_dict(), policy)


def _model_state(module) -> dict:
    return {k.removeprefix(PREFIX): v for k, v in _trained(get_model_state_dict(module), module).items()}


def _trained(state: dict, module) -> dict:
    """`state` without aliases (a tied head is the embedding: stored once, as safetensors wants) and without
    frozen parameters, which are never updated: they come from model.path. Each frozen parameter goes under
    every name it has (StateDictOptions' ignore_frozen_params would keep a tied head's second one)."""
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in without_aliases(state).items() if k not in frozen}


def _load(state: dict, path: Path, shapes: dict) -> None:
    """`state`'s tensors in place from the folder `path`: a sharded tensor's part by every rank from its
    own folder (replicated over machines, HSDP: by the first machine's ranks, which wrote it, each
    sending its part to its replicas); a tensor every rank holds whole (all of an unsharded learner's,
    a sharded one's step counts) by rank 0, which wrote it, and sent to the others."""
    sharded = {k: v for k, v in state.items() if hasattr(v, "to_local")}
    whole = {k: v for k, v in state.items() if k not in sharded}
    mesh = next(iter(sharded.values())).device_mesh if sharded else None
    if mesh is not None and mesh.ndim > 1:
        if mesh.get_local_rank("replicate") == 0:
            _read(sharded, path, shapes, alone=False, group=mesh.get_group("shard"))
        for value in sharded.values():
            torch.distributed.broadcast(value.to_local(), group=mesh.get_group("replicate"), group_src=0)
    elif sharded:
        _read(sharded, path, shapes, alone=False)
    rank0 = not _distributed() or torch.distributed.get_rank() == 0
    if rank0 and whole:
        _read(whole, path, shapes, alone=True)
    if _distributed() and whole:
        device = next(iter(sharded.values())).device if sharded else _device()
        for name, value in broadcast_tensors(whole if rank0 else None, device).items():
            whole[name].copy_(value)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _read(state: dict, path: Path, shapes: dict, alone: bool, group=None) -> None:
    """`state` (all ranks together, the ranks of `group`, or `alone` this one) from the parts in
    `path`, refusing a plan that would leave part of a tensor unread."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class WholeShapes(dcp.HuggingFaceStorageReader):
        """The folder's parts, with each tensor's whole shape (a folder may hold only some parts)."""

        def read_metadata(self):
            metadata = super().read_metadata()
            for name, meta in metadata.state_dict_metadata.items():
                meta.size = torch.Size(shapes.get(name, meta.size))
            return metadata

    class Complete(DefaultLoadPlanner):
        """Refuses a plan that would leave part of a tensor this rank holds unread."""

        def create_local_plan(self):
            plan = super().create_local_plan()
            read: dict[str, int] = {}
            for item in plan.items:
                read[item.dest_index.fqn] = read.get(item.dest_index.fqn, 0) + math.prod(item.lengths)
            for name, value in state.items():
                local = value.to_local() if hasattr(value, "to_local") else value
                if read.get(name, 0) != local.numel():
                    raise ValueError(
                        f"{path}: the parts here hold {read.get(name, 0)} of the {local.numel()} elements "
                        f"this rank needs of {name!r}; resuming on another layout (or machines) needs "
                        "every rank's part of the checkpoint in one folder"
                    )
            return plan

    dcp.load(
        state,
        storage_reader=WholeShapes(str(path)),
        planner=Complete(),
        process_group=group,
        no_dist=alone or not _distributed(),
    )


def _distributed() -> bool:
    """Whether the learner runs several ranks (else torch.distributed.checkpoint works in this process
    alone, and is told so: it would warn at every checkpoint)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    return distributed
