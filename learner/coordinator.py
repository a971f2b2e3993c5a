"""The coordinator thread: owns the prompt dataset, admission control and eval dispatch.

Admission control keeps `released - consumed <= (max_lag + 1) * groups_per_step`, and every
released group carries `min_version` = the learner's version at release, so a token trained at
step s was produced by weights no older than s - max_lag (DESIGN §3). Groups discarded at
arrival (zero variance, stale) free their slot at once; trained groups free theirs only after
the step that used them has bumped the version, which makes max_lag = 0 synchronous.
"""
from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass

import numpy as np

from tidal.broker.base import LearnerTransport
from tidal.broker.schema import PromptGroup, SamplingParams, int32s
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
    def __init__(self, plan: DispatchPlan, train: list[Prompt], val: list[Prompt], encode, transport: LearnerTransport):
        self.plan = plan
        self.train = train
        self.val = val
        self.encode = encode  # text -> list[int]
        self.transport = transport
        self.version = 0
        self.epoch = 0
        self.cursor = 0
        self.num_released = 0
        self.num_consumed = 0
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

    def on_discarded(self, num_groups: int) -> None:
        """Groups dropped at arrival: their slots are free now."""
        with self._cond:
            self.num_consumed += num_groups
            self._cond.notify_all()

    def on_step(self, new_version: int, num_groups: int) -> None:
        """A step trained on num_groups groups and produced new_version (already published)."""
        with self._cond:
            self.version = new_version
            self.num_consumed += num_groups
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
                    self._cond.wait_for(lambda: self._stop or self.num_released - self.num_consumed < self.window)
                    if self._stop:
                        return
                    free = self.window - (self.num_released - self.num_consumed)
                    groups = [self._next_train_group() for _ in range(free)]
                self.transport.submit_prompts(groups)
        except BaseException as err:
            self._error = err
            log.exception("coordinator failed")

    def _next_train_group(self) -> PromptGroup:
        if self.cursor >= len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._shuffled(self.epoch)
        prompt = self.train[self._order[self.cursor]]
        self.cursor += 1
        self.num_released += 1
        return self._group(prompt, f"{self.plan.run_id}-{self.num_released - 1}", self.version, is_eval=False)

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

    def state_dict(self) -> dict:
        with self._cond:
            return {"epoch": self.epoch, "cursor": self.cursor, "num_released": self.num_released,
                    "num_consumed": self.num_consumed, "version": self.version}
