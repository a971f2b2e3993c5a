"""The step runner: every learner rank runs the same steps, so every collective is issued from here,
in one order, on every rank.

    build_rank (build.py): trainer, checkpoint the ranks agree on ─► the rank's role ─► restore*
    StepRunner.run(role):
        publish* the starting weights ─► role.begin
        each step: role.collect ─► exchange* ─► train* ─► role.on_trained ─► publish* ─► role.on_step
                   ─► save* when due
        at the end: role.end ─► save* ─► export* (the final gather) ─► role.on_exported

    * a collective: every rank takes part, inside `RankGroup.collective`, which first checks that
      all ranks are at the same one.

What differs between ranks is the role, and none of its methods is collective: rank 0's `Learner`
collects rollouts, announces weights, evaluates and logs; every other rank is a `Follower`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Protocol

import torch

from tidal.broker.schema import WeightUpdate
from tidal.broker.weights import WeightPublisher
from tidal.health import HealthFile
from tidal.learner.every_rank.checkpoint import Checkpointer
from tidal.learner.every_rank.ranks import Collective, RankGroup, WeightPush
from tidal.learner.every_rank.trainer import Trainer
from tidal.learner.rank0.admission import StepBatch
from tidal.prometheus import StateClock

log = logging.getLogger(__name__)

# where a learner rank's time goes, as the runner's clock counts it (rank 0's flow metrics): waiting for and
# admitting rollouts, training, pushing weights, saving checkpoints, and the rest (evaluation, logging)
ROLLOUTS, TRAIN, PUSH, CHECKPOINT, OTHER = "rollouts", "train", "push", "checkpoint", "other"
PHASES = (ROLLOUTS, TRAIN, PUSH, CHECKPOINT, OTHER)


class Role(Protocol):
    """What a rank does between the step runner's collectives; never a collective itself."""

    steps: StepRunner

    def begin(self) -> None:
        """The starting weights are out: rank 0 evaluates them and starts releasing prompts."""

    def collect(self) -> StepBatch | None:
        """Rank 0: the next step batch, or None to end the run early. The others: None (they receive rank 0's)."""

    def on_trained(self, batch: StepBatch) -> None:
        """The trainer stepped on `batch`; the runner's version is still the one it trained."""

    def announce(self, update: WeightUpdate | None) -> None:
        """The pushed version's announcement (rank 0's; None on the others)."""

    def on_step(self, batch: StepBatch, metrics: dict[str, float]) -> None:
        """The new version is published; `metrics` are the trainer's and the push's."""

    def checkpoint_state(self) -> dict:
        """Tidal's state for the checkpoint about to be saved (rank 0's is written; the others' is not)."""

    def on_saved(self) -> None:
        """A checkpoint of the current version is in place."""

    def end(self) -> None:
        """The last step is trained: rank 0 evaluates the final weights and lets the actors go."""

    def on_exported(self, state: dict[str, torch.Tensor]) -> None:
        """The final policy, gathered (rank 0's whole state dict, `Trainer.export_state`; {} on the others)."""


class StepRunner:
    """The collectives of a learner rank, in the one order every rank issues them."""

    def __init__(
        self,
        trainer: Trainer,
        checkpointer: Checkpointer,
        ranks: RankGroup | None,
        push: WeightPush,
        publisher: WeightPublisher | None,
        max_steps: int,
    ):
        self.trainer, self.checkpointer, self.ranks = trainer, checkpointer, ranks  # ranks: None in unit tests
        self.push = push
        self.publisher = publisher  # rank 0's weight channel; None on the others
        self.max_steps = max_steps
        self.version = 0
        self.clock = StateClock(PHASES, OTHER)

    def run(self, role: Role) -> None:
        self.publish(role)  # the starting weights
        role.begin()
        while self.version < self.max_steps:
            start = time.perf_counter()
            self.clock.enter(ROLLOUTS)
            batch = self.exchange(role.collect())
            self.clock.enter(OTHER)
            if batch is None:
                break
            self.step(batch, role, time.perf_counter() - start)
        role.end()
        self.save(role)
        self.export(role)

    def step(self, batch: StepBatch, role: Role, collect_s: float = 0.0) -> None:
        """Train on this rank's share of `batch`, publish the new version, checkpoint when due.
        `collect_s`: the seconds the batch took to arrive and be admitted (on rank 0 the time the
        learner waited for rollouts: where a step's time goes, beside training and the push)."""
        self.clock.enter(TRAIN)
        metrics = self.train(batch)
        role.on_trained(batch)
        self.version += 1
        metrics["timing/collect_s"] = collect_s
        self.clock.enter(PUSH)
        metrics["timing/weight_push_s"] = self.publish(role)
        self.clock.enter(OTHER)
        role.on_step(batch, metrics)
        if self.checkpointer.due(self.version):
            self.save(role)

    # ---- the collectives, one method each --------------------------------------------------------

    def restore(self, checkpoint: Path | None) -> dict | None:
        """Model, optimizer and random states from `checkpoint`, the one the ranks agreed on (rank 0 reads
        its JSON files and sends them to the others); tidal's state, or None where there is none."""
        if checkpoint is None:
            return None
        with self._collective(Collective.RESTORE):
            state = self.checkpointer.load(checkpoint)
        self.version = state["version"]
        return state

    def exchange(self, batch: StepBatch | None) -> StepBatch | None:
        """Rank 0's step batch on every rank; rank 0's None (the run ends early) goes out as an empty one."""
        if self.ranks is None or not self.ranks.active:
            return batch
        with self._collective(Collective.BATCH):
            if self.ranks.rank == 0:
                sent = batch if batch is not None else StepBatch()  # empty: the others end the run too
                self.ranks.send(sent.groups, sent.token_masks)
                return batch
            groups, masks = self.ranks.recv()
        return StepBatch(groups, masks) if groups else None

    def train(self, batch: StepBatch) -> dict[str, float]:
        """One optimizer step (DDP's or FSDP's syncs and the trainer's reductions inside); its metrics."""
        with self._collective(Collective.TRAIN):
            return self.trainer.step(batch.groups, batch.token_masks, self.version)

    def publish(self, role: Role) -> float:
        """The current version onto the weight channel (gathered on every rank, sent and announced by rank
        0); the seconds that took."""
        start = time.perf_counter()
        with self._collective(Collective.PUSH):
            update = self.push(self.trainer, self.publisher, self.version)
        role.announce(update)
        return time.perf_counter() - start

    def save(self, role: Role) -> None:
        self.clock.enter(CHECKPOINT)
        state = role.checkpoint_state()
        with self._collective(Collective.SAVE):
            self.checkpointer.save(self.version, state)
        role.on_saved()
        self.clock.enter(OTHER)

    def export(self, role: Role) -> None:
        """The final policy in the served dtype, gathered one tensor at a time when sharded."""
        with self._collective(Collective.EXPORT):
            state = self.trainer.export_state(self.push.dtype)
        role.on_exported(state)

    def _collective(self, what: Collective) -> contextlib.AbstractContextManager[None]:
        return self.ranks.collective(what, self.version) if self.ranks is not None else contextlib.nullcontext()


class Follower:
    """A rank other than 0: the same steps on rank 0's batches, and between them only a health file."""

    def __init__(self, steps: StepRunner, health: HealthFile):
        self.steps = steps
        self.health = health  # a pod's probe: a step went by (or began)

    def run(self) -> int:
        ranks = self.steps.ranks
        log.info("rank %d of %d follows rank 0 from version %d", ranks.rank, ranks.world, self.steps.version)
        self.steps.run(self)
        return 0

    def collect(self) -> None:
        self.health.touch()
        return None  # the batch comes from rank 0

    def begin(self) -> None:
        pass

    def on_trained(self, batch: StepBatch) -> None:
        pass

    def announce(self, update: WeightUpdate | None) -> None:
        pass

    def on_step(self, batch: StepBatch, metrics: dict[str, float]) -> None:
        pass

    def checkpoint_state(self) -> dict:
        return {}

    def on_saved(self) -> None:
        pass

    def end(self) -> None:
        pass

    def on_exported(self, state: dict[str, torch.Tensor]) -> None:
        pass
