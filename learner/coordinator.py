"""The coordinator: owns the prompt dataset, admission control, eval dispatch, and the
bookkeeping of every prompt group (what is outstanding, what was consumed).

Admission control keeps at most `(max_lag + 1) * groups_per_step` training groups outstanding,
and every released group carries `min_version` = the learner's version at release, so a token
trained at step s was produced by weights no older than s - max_lag (DESIGN §3). Groups
discarded at arrival (zero variance, stale) free their slot at once; trained groups free theirs
only after the step that used them has bumped the version, which makes max_lag = 0 synchronous.

Delivery is at-least-once (a redelivered Redis entry, a group re-dispatched from an actor that
went silent but was only slow), so the learner asks `admit(group_id)` first: a group id is
consumed at most once. A copy of a group this coordinator never released (released by the
learner before a restart) is trained normally but frees no slot.
"""
from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from dataclasses import dataclass

import numpy as np

from tidal.broker.base import LearnerTransport
from tidal.broker.schema import PromptGroup, SamplingParams, int32s
from tidal.learner.ledger import Ledger
from tidal.tasks import Prompt

log = logging.getLogger(__name__)


@dataclass
class DispatchPlan:
    """What the coordinator needs to turn prompts into groups."""

    run_id: str
    task: str
    n: int
    sampling: SamplingParams
    eval_n: int
    eval_sampling: SamplingParams
    groups_per_step: int
    max_lag: int
    seed: int


class Coordinator:
    def __init__(self, plan: DispatchPlan, train: list[Prompt], val: list[Prompt], encode,
                 transport: LearnerTransport, ledger: Ledger):
        self.plan = plan
        self.train = train
        self.val = val
        self.encode = encode  # text -> list[int]
        self.transport = transport
        self.ledger = ledger
        self.version = 0
        self.epoch = 0
        self.cursor = 0
        self.num_released = 0
        self.outstanding: dict[str, tuple[int, int]] = {}  # group id -> (train prompt index, min_version)
        self.consumed: set[str] = set()  # group ids trained on or discarded
        self.dead: set[str] = set()  # group ids given up on by the broker
        self.counts: Counter[str] = Counter()
        self._order = self._shuffled(0)
        self._cond = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="coordinator", daemon=True)

    @property
    def window(self) -> int:
        return (self.plan.max_lag + 1) * self.plan.groups_per_step

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def check(self) -> None:
        """Re-raise a coordinator failure in the training thread."""
        if self._error is not None:
            raise RuntimeError(f"coordinator thread failed: {self._error!r}") from self._error

    # ---- called by the training loop ---------------------------------------------------------

    def admit(self, group_id: str) -> bool:
        """True the first time a group id arrives; later copies are recorded as duplicates."""
        with self._cond:
            if group_id in self.consumed:
                self.counts["duplicates"] += 1
                self.ledger.record("duplicate", id=group_id)
                self._free(group_id)  # a re-released copy of a group first seen before a restart
                return False
            self.consumed.add(group_id)
            if group_id not in self.outstanding:
                self.counts["unknown"] += 1  # released before a restart; trained, frees no slot
            return True

    def on_discarded(self, group_id: str, reason: str) -> None:
        """A group dropped at arrival: its slot is free now."""
        with self._cond:
            self.counts[f"discarded/{reason}"] += 1
            self.ledger.record("discarded", reason=reason, id=group_id)
            self._free(group_id)

    def on_step(self, new_version: int, group_ids: list[str]) -> None:
        """A step trained on these groups and produced new_version (already published)."""
        with self._cond:
            self.version = new_version
            self.ledger.record("trained", step=new_version, ids=group_ids)
            for group_id in group_ids:
                self._free(group_id)

    def on_dead_letter(self, group_id: str) -> None:
        """The broker gave up on a group (too many deliveries): free its slot, once."""
        with self._cond:
            if group_id in self.dead:
                return
            self.dead.add(group_id)
            self.counts["dead_lettered"] += 1
            self.ledger.record("dead_letter", id=group_id)
            self._free(group_id)

    def _free(self, group_id: str) -> None:
        if self.outstanding.pop(group_id, None) is not None:
            self._cond.notify_all()

    def dispatch_eval(self, version: int) -> list[str]:
        """Send every held-out prompt for evaluation at `version`; returns the group ids."""
        groups = [self._group(p, f"{self.plan.run_id}-eval{version}-{i}", version, is_eval=True)
                  for i, p in enumerate(self.val)]
        self.transport.submit_prompts(groups)
        return [g.group_id for g in groups]

    # ---- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or len(self.outstanding) < self.window)
                    if self._stop:
                        return
                    groups = [self._next_train_group() for _ in range(self.window - len(self.outstanding))]
                    self.ledger.record("released", ids=[g.group_id for g in groups])
                self.transport.submit_prompts(groups)
        except BaseException as err:
            self._error = err
            log.exception("coordinator failed")

    def _next_train_group(self) -> PromptGroup:
        if self.cursor >= len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._shuffled(self.epoch)
        index = int(self._order[self.cursor])
        self.cursor += 1
        self.num_released += 1
        group_id = f"{self.plan.run_id}-{self.num_released - 1}"
        self.outstanding[group_id] = (index, self.version)
        return self._group(self.train[index], group_id, self.version, is_eval=False)

    def _group(self, prompt: Prompt, group_id: str, min_version: int, is_eval: bool) -> PromptGroup:
        return PromptGroup(
            run_id=self.plan.run_id, group_id=group_id, prompt_id=prompt.prompt_id,
            prompt_tokens=int32s(self.encode(prompt.text)), task=self.plan.task, payload=prompt.payload,
            n=self.plan.eval_n if is_eval else self.plan.n,
            sampling=self.plan.eval_sampling if is_eval else self.plan.sampling,
            min_version=min_version, is_eval=is_eval)

    def _shuffled(self, epoch: int) -> np.ndarray:
        order = list(range(len(self.train)))
        random.Random(self.plan.seed * 100_003 + epoch).shuffle(order)
        return np.asarray(order)

    # ---- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a resumed learner needs, with the ledger offset taken under the same lock."""
        with self._cond:
            return {"epoch": self.epoch, "cursor": self.cursor, "num_released": self.num_released,
                    "version": self.version, "outstanding": {k: list(v) for k, v in self.outstanding.items()},
                    "consumed": sorted(self.consumed), "dead": sorted(self.dead), "counts": dict(self.counts),
                    "ledger_offset": self.ledger.offset()}

    def load_state_dict(self, state: dict) -> None:
        with self._cond:
            self.epoch, self.cursor = state["epoch"], state["cursor"]
            self.num_released, self.version = state["num_released"], state["version"]
            self.outstanding = {k: (int(v[0]), int(v[1])) for k, v in state["outstanding"].items()}
            self.consumed, self.dead = set(state["consumed"]), set(state["dead"])
            self.counts = Counter(state["counts"])
            self._order = self._shuffled(self.epoch)

    def resubmit_outstanding(self) -> int:
        """After a restart on a transport that kept nothing (ZeroMQ): queue the outstanding groups again."""
        with self._cond:
            groups = [self._group(self.train[index], group_id, min_version, is_eval=False)
                      for group_id, (index, min_version) in self.outstanding.items()]
        self.transport.submit_prompts(groups)
        return len(groups)
