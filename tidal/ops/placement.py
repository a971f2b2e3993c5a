"""Where `tidal run` puts each process: GPUs (through CUDA_VISIBLE_DEVICES) where the machine has
them, CPU cores (taskset, and vLLM's OpenMP binding) where it has not.

    GPUs:  learner ranks ─ one GPU each ─ the first learner.gpus devices
           actor i       ─ actor.gpus_per_replica devices each, after the learner's
                           (actor.colocate: on the learner's own, sharing their memory)
    CPU:   learner on core 0, actors spread over the other cores (sharing when there are too few)

A plan that needs more GPUs than are visible is refused before anything starts, in one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tidal.config import ActorConfig, LearnerConfig


class PlacementError(ValueError):
    """The processes cannot be placed on this machine: the message says what to change."""


@dataclass(frozen=True)
class Slot:
    cores: str | None = None  # taskset core list; None = no pinning
    gpus: tuple[str, ...] | None = None  # CUDA_VISIBLE_DEVICES entries; None = the environment is left alone

    def env(self) -> dict[str, str]:
        """What the child's environment gets."""
        return {} if self.gpus is None else {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus)}


@dataclass(frozen=True)
class Placement:
    learner: Slot
    actors: tuple[Slot, ...]


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (indices or UUIDs)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def place(learner: LearnerConfig, actor: ActorConfig, gpus: list[str], cores: list[int]) -> Placement:
    """The slot of every process; raises PlacementError when the GPUs do not suffice."""
    if not gpus:
        wanted = [
            (key, n)
            for key, n in (("learner.gpus", learner.gpus), ("actor.gpus_per_replica", actor.gpus_per_replica))
            if n > 0
        ]
        if wanted:
            raise PlacementError(
                f"{wanted[0][0]} = {wanted[0][1]} but this machine has no visible GPU (set it to -1 or 0 to run on CPU)"
            )
        return cpu_placement(actor.replicas, cores)
    learner_gpus = learner.num_ranks if learner.gpus < 0 else learner.gpus
    per_actor = actor.vllm.tensor_parallel_size if actor.gpus_per_replica < 0 else actor.gpus_per_replica
    if actor.colocate:
        return colocated(gpus, learner_gpus, actor.replicas, per_actor)
    needed = learner_gpus + actor.replicas * per_actor
    if needed > len(gpus):
        raise PlacementError(
            f"this run needs {needed} GPUs (learner {learner_gpus} + {actor.replicas} actor(s) x {per_actor}) but "
            f"{len(gpus)} are visible ({','.join(gpus)}): lower actor.replicas, actor.gpus_per_replica or "
            f"actor.vllm.tensor_parallel_size, or learner.num_ranks"
        )
    actor_gpus = gpus[learner_gpus:]
    actors = (Slot(gpus=tuple(actor_gpus[i * per_actor : (i + 1) * per_actor])) for i in range(actor.replicas))
    return Placement(Slot(gpus=tuple(gpus[:learner_gpus])), tuple(actors))


def colocated(gpus: list[str], learner_gpus: int, replicas: int, per_actor: int) -> Placement:
    """Actors on the learner's GPUs, round-robin (actor.colocate)."""
    if max(learner_gpus, per_actor) > len(gpus):
        raise PlacementError(
            f"actor.colocate: the learner needs {learner_gpus} and each actor {per_actor} GPUs "
            f"but {len(gpus)} are visible ({','.join(gpus)})"
        )
    shared = gpus[: max(learner_gpus, per_actor)]
    actors = (
        Slot(gpus=tuple(shared[(i * per_actor + j) % len(shared)] for j in range(per_actor))) for i in range(replicas)
    )
    return Placement(Slot(gpus=tuple(gpus[:learner_gpus])), tuple(actors))


def cpu_placement(num_actors: int, cores: list[int]) -> Placement:
    """The engine pins its OpenMP threads; left on auto, every actor claims every core. Give the
    learner core 0 and spread the actors over the others (sharing when there are too few)."""
    cores = sorted(cores)
    if len(cores) == 1:
        return Placement(Slot(str(cores[0])), tuple(Slot(str(cores[0])) for _ in range(num_actors)))
    rest = cores[1:]
    return Placement(Slot(str(cores[0])), tuple(Slot(str(rest[i % len(rest)])) for i in range(num_actors)))
