"""Several learner ranks (torchrun, `learner.num_ranks`): what passes between them, and the guard
that keeps them in step.

Rank 0 owns the transport, the coordinator, the tracker and the weight channel. It collects each
step batch and broadcasts it to the other ranks, encoded with msgspec like everything else on a
wire (no pickle). Every rank then calls `trainer.step` on the same batch and trains its share;
DDP syncs the gradients and the trainer sums its counts over ranks, so N ranks make the update
one rank would. All ranks save checkpoints at the same versions, because saving is collective;
rank 0 alone reads and writes the files, so ranks on different machines need no shared disk.

Every rank issues these collectives from one place, the step runner (steps.py), each inside
`RankGroup.collective`: the ranks first swap which collective each is at, so a rank out of step
fails at once, naming what each rank called, instead of waiting in a collective no peer joins.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from tidal.broker.schema import AdapterSpec, RolloutGroup
from tidal.config import RunConfig

log = logging.getLogger(__name__)


class Collective(enum.Enum):
    """The step runner's collectives, as the guard names them; their order here is their code on the wire."""

    RESTORE = "checkpoint load"
    BATCH = "batch broadcast"
    TRAIN = "train step"
    PUSH = "weight push"
    SAVE = "checkpoint save"
    EXPORT = "final export"


COLLECTIVES = list(Collective)


class RanksOutOfStep(RuntimeError):
    """Learner ranks reached different collectives (or the same one at different points): each would
    wait in its own until the process group's timeout."""


class _WireBatch(msgspec.Struct):
    groups: list[RolloutGroup]
    masks: list[list[bytes]]  # per sample: the token mask, bit-packed
    lengths: list[list[int]]  # per sample: tokens in the mask


@dataclass(frozen=True)
class Position:
    """Where a rank is in the step runner's collectives."""

    count: int  # guarded collectives this rank has entered, this one included
    what: Collective
    version: int  # the policy version the rank is at

    def __str__(self) -> str:
        return f"{self.what.value} (collective #{self.count}, version {self.version})"


class RankGroup:
    """The learner's ranks seen from one of them: which it is, the step batch that rank 0 sends the
    others, and the guard around every collective. On one rank each of these is a no-op."""

    def __init__(self, accelerator):
        self.rank = accelerator.process_index
        self.world = accelerator.num_processes
        self.device = accelerator.device
        self.num_collectives = 0  # guarded collectives entered so far: the same count on every rank in step

    @property
    def active(self) -> bool:
        return self.world > 1

    def send(self, groups: list[RolloutGroup], masks: list[list[np.ndarray]]) -> None:
        if not self.active:
            return
        wire = _WireBatch(
            groups,
            [[np.packbits(m).tobytes() for m in ms] for ms in masks],
            [[int(m.size) for m in ms] for ms in masks],
        )
        broadcast_bytes(msgspec.msgpack.encode(wire), self.device)

    def recv(self) -> tuple[list[RolloutGroup], list[list[np.ndarray]]]:
        wire = msgspec.msgpack.decode(broadcast_bytes(None, self.device), type=_WireBatch)
        masks = [
            [np.unpackbits(np.frombuffer(b, dtype=np.uint8))[:n].astype(bool) for b, n in zip(bs, ns)]
            for bs, ns in zip(wire.masks, wire.lengths)
        ]
        return wire.groups, masks

    @contextlib.contextmanager
    def collective(self, what: Collective, version: int) -> Iterator[None]:
        """Around one collective of the step runner. Every rank must be at the same one (the same
        collective, as many in, at the same version), or every rank raises RanksOutOfStep naming what
        each called. An error inside, or while waiting for the others (a peer gone, the process group's
        timeout), keeps its type and gets a note naming the collective."""
        if not self.active:
            yield
            return
        self.num_collectives += 1
        here = Position(self.num_collectives, what, version)
        try:
            positions = self._positions(here)
        except Exception as err:
            err.add_note(f"learner rank {self.rank} was waiting for the other ranks to reach {here}")
            raise
        check_in_step(positions)
        try:
            yield
        except Exception as err:
            err.add_note(f"raised on learner rank {self.rank} inside {here}")
            raise

    def _positions(self, here: Position) -> list[Position]:
        """Every rank's position: one all_gather of three integers."""
        mine = torch.tensor(
            [here.count, COLLECTIVES.index(here.what), here.version], dtype=torch.int64, device=self.device
        )
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine)
        return [
            Position(count, COLLECTIVES[what], version) for count, what, version in torch.stack(everyone).tolist()
        ]  # one copy to the host


def check_in_step(positions: list[Position]) -> None:
    """Raise RanksOutOfStep naming the first rank whose position differs from rank 0's (every rank
    sees the same list, so every rank raises the same error)."""
    for rank, position in enumerate(positions):
        if position != positions[0]:
            raise RanksOutOfStep(
                f"learner ranks out of step: rank {rank} called {position} while rank 0 called {positions[0]}"
            )


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
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return frame
    size = torch.tensor([len(frame) if frame is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buf = (
        torch.from_numpy(np.frombuffer(frame, dtype=np.uint8).copy()).to(device)
        if frame is not None
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    dist.broadcast(buf, src=0)
    return buf.cpu().numpy().tobytes()


@dataclass(frozen=True)
class WeightPush:
    """What every learner rank gathers at a weight push, taken from the config alone (`of`), so that
    rank 0, which holds the publisher, and the others gather the same tensors in the same order: the
    policy in `dtype`, what the actors serve; under learner.lora (`adapter`) the adapter's tensors alone,
    in `dtype`, under PEFT's names, announced with the adapter's shape for the actors to serve it over
    their own base."""

    dtype: str
    adapter: AdapterSpec | None = None

    @classmethod
    def of(cls, cfg: RunConfig) -> WeightPush:
        lora = cfg.learner.lora
        adapter = AdapterSpec(lora.rank, lora.alpha, tuple(lora.target_modules)) if lora.enabled else None
        return cls(cfg.model.dtype, adapter)

    def __call__(self, trainer, publisher, version: int):
        """A new version onto the weight channel: the step runner calls this on every rank, and rank 0
        (`publisher`) gets the announcement, None the others (which pass none). The tensors reach rank
        0's host memory one at a time, a sharded model's each gathered in `dtype` just before it is
        copied, so no rank ever holds the whole model on its device."""
        entries, tensors = trainer.weights(self.dtype)
        if publisher is None:
            for _ in tensors:  # a sharded model's gathers are collectives: take part in each
                pass
            return None
        if self.adapter is not None:  # PEFT's names already, as vLLM's LoRA loader reads them
            return msgspec.structs.replace(publisher.publish(tensors, version, entries), adapter=self.adapter)
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
    key = (id(policy), entries)
    if key not in _conversions:
        converted = [
            pair
            for name, dtype, shape in entries
            for pair in split(name, torch.empty(shape, dtype=dtype, device="meta"))
        ]
        same = [name for name, _ in converted] == [name for name, _, _ in entries]
        _conversions[key] = None if same else [(name, t.dtype, tuple(t.shape)) for name, t in converted]
    return _conversions[key]


def broadcast_tensors(named: dict | None, device) -> dict:
    """Rank 0's named tensors on every rank, in host memory, one tensor at a time (the others pass None)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return named
    frame = (
        None
        if named is None
        else msgspec.msgpack.encode(
            _TensorHeader(
                list(named),
                [str(t.dtype).removeprefix("torch.") for t in named.values()],
                [list(t.shape) for t in named.values()],
            )
        )
    )
    header = msgspec.msgpack.decode(broadcast_bytes(frame, device), type=_TensorHeader)
    out = {}
    for name, dtype, shape in zip(header.names, header.dtypes, header.shapes):
        t = (
            named[name].contiguous().to(device)
            if named is not None
            else torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        )
        dist.broadcast(t, src=0)
        out[name] = t.cpu()
    return out
