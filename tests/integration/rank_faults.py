"""Two learner ranks (gloo, CPU) run the step runner through a restore and two steps, once per case: in
step, then with a fault in each collective in turn on rank 1 (it skips the collective, raises inside it,
or saves before it pushes weights). Writes each case's outcome on this rank to OUT_DIR/rank<r>.json.

    python rank_faults.py RANK OUT_DIR     (both ranks, each case in a process group of its own)

The trainer and the checkpointer are stand-ins that make the real ones' collectives (an all_reduce for
DDP's gradient sync, one per tensor for FSDP's gathers, a barrier around a save, a broadcast of rank
0's checkpoint state), so each case takes milliseconds unless something waits.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the step batch lives in conftest.py
from conftest import step_batch  # noqa: E402
from tidal.health import HealthFile  # noqa: E402
from tidal.learner.every_rank.ranks import Collective, RankGroup, WeightPush, broadcast_bytes  # noqa: E402
from tidal.learner.rank0.admission import StepBatch  # noqa: E402
from tidal.learner.steps import Follower, StepRunner  # noqa: E402

TIMEOUT_S = 3.0  # the process group's: a rank left waiting fails after this
MAX_STEPS = 2
METHODS = {
    Collective.RESTORE: "restore",
    Collective.BATCH: "exchange",
    Collective.TRAIN: "train",
    Collective.PUSH: "publish",
    Collective.SAVE: "save",
    Collective.EXPORT: "export",
}
CASES = [
    "in step",
    *(f"skip {w.name}" for w in Collective),
    *(f"raise {w.name}" for w in Collective),
    "save before push",
    "skip EXPORT and stay",
]


class InjectedFault(Exception):
    pass


class Trainer:
    """The trainer's collectives without a model."""

    policy = None

    def step(self, groups, masks, version: int) -> dict[str, float]:
        grad = torch.ones(4)
        dist.all_reduce(grad)  # DDP's gradient sync
        return {"learner/loss": float(grad[0])}

    def weights(self, dtype: str):
        entries = [(f"w{i}", torch.float32, (4,)) for i in range(3)]

        def gathered():
            for name, _, _ in entries:
                t = torch.ones(4)
                dist.all_reduce(t)  # FSDP's gather of one tensor
                yield name, t

        return entries, gathered()

    def export_state(self, dtype: str) -> dict:
        return dict(self.weights(dtype)[1])


class Checkpointer:
    periodic = True

    def due(self, version: int) -> bool:
        return version % 2 == 0

    def save(self, version: int, state: dict) -> None:
        dist.barrier()  # every rank wrote its part

    def load(self, path: Path) -> dict:
        frame = json.dumps({"version": 0}).encode() if dist.get_rank() == 0 else None
        return json.loads(broadcast_bytes(frame, torch.device("cpu")))  # rank 0 reads, the others receive


class Collector(Follower):
    """Rank 0's role, reduced to its step batches."""

    def collect(self) -> StepBatch:
        return StepBatch(*step_batch(2))


def inject(runner: StepRunner, case: str) -> None:
    """Rank 1's fault: a runner method that skips its collective, raises inside it, or saves first."""
    kind, _, name = case.partition(" ")
    if case == "save before push":
        publish = runner.publish
        runner.publish = lambda role: (runner.save(role), publish(role))[1]
    elif kind == "skip":
        what = Collective[name.split()[0]]
        neutral = {
            Collective.BATCH: lambda batch: StepBatch(*step_batch(2)),
            Collective.TRAIN: lambda batch: {},
            Collective.PUSH: lambda role: 0.0,
        }
        setattr(runner, METHODS[what], neutral.get(what, lambda *args: None))
    elif kind == "raise":
        what = Collective[name]

        def raise_inside(*args):
            with runner._collective(what):
                raise InjectedFault(f"injected into {what.value}")

        setattr(runner, METHODS[what], raise_inside)


def run_case(rank: int, case: str, store_dir: Path) -> dict:
    store = dist.FileStore(str(store_dir / case.replace(" ", "-")), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    ranks = RankGroup(SimpleNamespace(process_index=rank, num_processes=2, device=torch.device("cpu")))
    runner = StepRunner(Trainer(), Checkpointer(), ranks, WeightPush("float32"), None, MAX_STEPS)
    role = (Collector if rank == 0 else Follower)(runner, HealthFile(""))
    if rank == 1 and case != "in step":
        inject(runner, case)
    start = time.perf_counter()
    outcome = {"error": None, "message": "", "notes": []}
    try:
        runner.restore(Path("step-000000"))
        runner.run(role)
    except Exception as err:
        outcome = {"error": type(err).__name__, "message": str(err), "notes": getattr(err, "__notes__", [])}
    outcome |= {"seconds": time.perf_counter() - start, "version": runner.version, "collectives": ranks.num_collectives}
    if rank == 1 and case.endswith("and stay"):
        time.sleep(TIMEOUT_S + 1)  # in the group, joining nothing: rank 0 waits out the timeout
    dist.destroy_process_group()
    return outcome


def main() -> None:
    rank, out_dir = int(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    outcomes = {case: run_case(rank, case, out_dir) for case in CASES}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(outcomes, indent=1))


if __name__ == "__main__":
    main()
