"""Several learner ranks (torchrun, `learner.num_ranks`): rank 0 runs the training loop, the
others follow it step by step.

Rank 0 owns the transport, the coordinator, the tracker and the weight channel. It collects each
step batch and broadcasts it to the other ranks, encoded with msgspec like everything else on a
wire (no pickle). Every rank then calls `trainer.step` on the same batch and trains its share;
DDP syncs the gradients and the trainer sums its counts over ranks, so N ranks make the update
one rank would. All ranks save checkpoints at the same versions, because saving is collective;
rank 0 alone reads and writes the files, so ranks on different machines need no shared disk.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import msgspec
import numpy as np

from tidal.broker.schema import RolloutGroup
from tidal.config import RunConfig
from tidal.health import HealthFile

log = logging.getLogger(__name__)


class _WireBatch(msgspec.Struct):
    groups: list[RolloutGroup]
    masks: list[list[bytes]]  # per sample: the token mask, bit-packed
    lengths: list[list[int]]  # per sample: tokens in the mask


class BatchBroadcast:
    """Rank 0 sends each step batch; the other ranks receive it. A no-op on one rank."""

    def __init__(self, accelerator):
        self.rank = accelerator.process_index
        self.world = accelerator.num_processes
        self.device = accelerator.device

    @property
    def active(self) -> bool:
        return self.world > 1

    def send(self, groups: list[RolloutGroup], masks: list[list[np.ndarray]]) -> None:
        if not self.active:
            return
        wire = _WireBatch(groups, [[np.packbits(m).tobytes() for m in ms] for ms in masks],
                          [[int(m.size) for m in ms] for ms in masks])
        self._broadcast(msgspec.msgpack.encode(wire))

    def recv(self) -> tuple[list[RolloutGroup], list[list[np.ndarray]]]:
        wire = msgspec.msgpack.decode(self._broadcast(None), type=_WireBatch)
        masks = [[np.unpackbits(np.frombuffer(b, dtype=np.uint8))[:n].astype(bool) for b, n in zip(bs, ns)]
                 for bs, ns in zip(wire.masks, wire.lengths)]
        return wire.groups, masks

    def _broadcast(self, frame: bytes | None) -> bytes:
        return broadcast_bytes(frame, self.device)


# ---- collectives from rank 0 (one process: no-ops) ------------------------------------------------
# The learner's ranks may sit on different machines with nothing shared on disk: what only rank 0
# reads (a checkpoint) reaches the others through these, and what every rank holds (its random
# state) reaches rank 0 for writing. Tensors travel on the process group's device (NCCL: CUDA).

class _TensorHeader(msgspec.Struct):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


def broadcast_bytes(frame: bytes | None, device) -> bytes:
    """Rank 0's `frame` on every rank (the others pass None)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return frame
    size = torch.tensor([len(frame) if frame is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buf = (torch.from_numpy(np.frombuffer(frame, dtype=np.uint8).copy()).to(device) if frame is not None
           else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    dist.broadcast(buf, src=0)
    return buf.cpu().numpy().tobytes()


@dataclass(frozen=True)
class WeightPush:
    """What every learner rank gathers at a weight push, taken from the config alone (`of`), so that
    rank 0, which holds the publisher, and the others gather the same tensors in the same order: the
    policy in `dtype`, what the actors serve."""

    dtype: str

    @classmethod
    def of(cls, cfg) -> WeightPush:
        return cls(cfg.model.dtype)

    def __call__(self, trainer, publisher, version: int):
        """A new version onto the weight channel: every rank calls this at the same point, and rank 0
        (`publisher`) gets the announcement, None the others (which pass none). The tensors reach rank
        0's host memory one at a time, a sharded model's each gathered in `dtype` just before it is
        copied, so no rank ever holds the whole model on its device."""
        entries, tensors = trainer.weights(self.dtype)
        if publisher is None:
            for _ in tensors:  # a sharded model's gathers are collectives: take part in each
                pass
            return None
        entries, tensors = checkpoint_format(trainer.policy, entries, tensors)  # names as vLLM's loaders read
        return publisher.publish(tensors, version, entries)


def checkpoint_format(policy, entries: list, tensors):
    """(entries, pairs) under the names and shapes of the model's checkpoint files, which vLLM's loaders
    read: transformers fuses some weights once loaded (a MoE layer's experts into one tensor per
    projection) and its `revert_weight_conversion` splits them back, as save_pretrained does. A model
    without such conversions passes through untouched."""
    from transformers.core_model_loading import revert_weight_conversion

    def split(name: str, tensor) -> list:
        return list(revert_weight_conversion(policy, {name: tensor}).items())

    converted = _converted_entries(policy, tuple(entries), split)
    if converted is None:
        return entries, tensors
    return converted, (pair for name, tensor in tensors for pair in split(name, tensor))


_conversions: dict = {}  # (the policy, its entries) -> their checkpoint entries, or None where they are the same


def _converted_entries(policy, entries: tuple, split) -> list | None:
    """`entries` in the checkpoint's format (worked out on the meta device, once per model: about 0.1 s
    for 350 tensors), or None where nothing changes."""
    import torch

    key = (id(policy), entries)
    if key not in _conversions:
        converted = [pair for name, dtype, shape in entries
                     for pair in split(name, torch.empty(shape, dtype=dtype, device="meta"))]
        same = [name for name, _ in converted] == [name for name, _, _ in entries]
        _conversions[key] = None if same else [(name, t.dtype, tuple(t.shape)) for name, t in converted]
    return _conversions[key]


def broadcast_tensors(named: dict | None, device) -> dict:
    """Rank 0's named tensors on every rank, in host memory, one tensor at a time (the others pass None)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return named
    frame = None if named is None else msgspec.msgpack.encode(_TensorHeader(
        list(named), [str(t.dtype).removeprefix("torch.") for t in named.values()],
        [list(t.shape) for t in named.values()]))
    header = msgspec.msgpack.decode(broadcast_bytes(frame, device), type=_TensorHeader)
    out = {}
    for name, dtype, shape in zip(header.names, header.dtypes, header.shapes):
        t = (named[name].contiguous().to(device) if named is not None
             else torch.empty(shape, dtype=getattr(torch, dtype), device=device))
        dist.broadcast(t, src=0)
        out[name] = t.cpu()
    return out


def follow(cfg: RunConfig) -> int:
    """A rank other than 0: the same trainer and checkpoints, batches from rank 0, nothing else.
    Rank 0 chooses the checkpoint to continue from and sends it: this rank reads no file of the run."""
    from tidal.learner.main import setup_trainer

    accelerator, trainer, checkpointer, checkpoint = setup_trainer(cfg)
    version = checkpointer.load(checkpoint)["version"] if checkpoint else 0
    ranks = BatchBroadcast(accelerator)
    log.info("rank %d of %d follows rank 0 from version %d", ranks.rank, ranks.world, version)
    # Wherever rank 0 reads the whole model (each weight push, checkpoint and the final export), a
    # sharded model is gathered, so this rank takes part in the same calls in the same order.
    push = partial(WeightPush.of(cfg), trainer, None)
    push(version=version)  # the starting weights
    health = HealthFile(cfg.learner.health_file, every_s=0.0)  # a pod's probe: a step went by (or began)
    while version < cfg.learner.max_steps:
        health.touch()
        groups, masks = ranks.recv()
        if not groups:  # rank 0 ended the run early (the curriculum ran out of prompts)
            break
        trainer.step(groups, masks, version)
        version += 1
        push(version=version)
        if checkpointer.due(version):
            checkpointer.save(version, {})
    checkpointer.save(version, {})  # rank 0's final save, after its last evaluation
    trainer.export_state(cfg.model.dtype)  # the final export
    return 0
