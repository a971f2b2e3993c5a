"""The coordinator: owns the prompt dataset and decides what is released to the actors, when.

Admission control keeps at most `(max_lag + 1) * groups_per_step` training groups outstanding,
and every released group carries `min_version` = the learner's version at release, so a token
trained at step s was produced by weights no older than s - max_lag. Groups discarded at
arrival (zero variance, stale) free their slot at once; trained groups free theirs only after
the step that used them has bumped the version, which makes max_lag = 0 synchronous. Where each
group is lives in the `GroupBook`; which prompts are still worth sampling in the `Curriculum`.
Held-out prompts go out as eval groups, which carry the version they evaluate.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tidal.broker.base import LearnerTransport
from tidal.broker.schema import PromptGroup, SamplingParams, int32s
from tidal.config import CurriculumConfig
from tidal.learner.rank0.curriculum import Curriculum, CurriculumExhausted
from tidal.learner.rank0.groups import GroupBook, Release, prompt_digest
from tidal.tasks import Prompt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
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


def release_of(group: PromptGroup, index: int) -> Release:
    """The record a group's rollout is checked against, stamped with the time it goes out."""
    return Release(
        index,
        group.min_version,
        group.n,
        prompt_digest(group.prompt_tokens.data),
        group.eval_version,
        prompt_id=group.prompt_id,
        interrupted_max_tokens=longest_interrupted(group.sampling),
        released_at=time.time(),
    )


def longest_interrupted(sampling: SamplingParams) -> int:
    """The most tokens a completion finishing "interrupted" can have (0: no forced interruptions)."""
    interrupt = sampling.interrupt
    return 0 if interrupt is None else interrupt.max_think_tokens + len(interrupt.tokens) + interrupt.answer_tokens


class Coordinator:
    def __init__(
        self,
        plan: DispatchPlan,
        train: list[Prompt],
        val: list[Prompt],
        encode: Callable[[Prompt], list[int]],
        transport: LearnerTransport,
        book: GroupBook,
        curriculum: CurriculumConfig | None = None,
        pass_threshold: float = 1.0,
    ):
        self.plan = plan
        self.train = train
        self.val = val
        self.encode = encode  # prompt -> token ids (tidal.tasks.PromptEncoder)
        self.transport = transport
        self.book = book
        self.version = 0
        self.epoch = 0
        self.cursor = 0
        self.num_released = 0
        self.pass_threshold = pass_threshold  # task.pass_threshold: a pass, for the curriculum and evaluations
        self.curriculum = Curriculum(curriculum, (p.prompt_id for p in train), pass_threshold)  # None: all stay
        self._order = self._shuffled(0)
        self._cond = book.cond  # one lock: releases wait for slots the book frees
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
        """Re-raise a coordinator failure in the training thread; end the run when the curriculum left nothing."""
        if self._error is not None:
            raise RuntimeError(f"coordinator thread failed: {self._error!r}") from self._error
        if self.curriculum.exhausted and not self.book.in_flight():
            cfg = self.curriculum.cfg
            raise CurriculumExhausted(
                f"every training prompt ({len(self.curriculum.prompt_ids)}) is retired by the curriculum "
                f"(pass rate >= curriculum.retire_pass_rate = {cfg.retire_pass_rate} over curriculum.min_samples = "
                f"{cfg.min_samples} samples, a pass being a reward >= task.pass_threshold = {self.pass_threshold}) "
                f"and no group is left in flight at version {self.version}: nothing to "
                "train on. Lower learner.max_steps, raise curriculum.retire_pass_rate or task.pass_threshold, "
                "or set curriculum.enabled=false"
            )

    # ---- called by the training loop ---------------------------------------------------------

    def on_rewards(self, prompt_id: int, rewards: list[float]) -> None:
        """A training group arrived (trained or discarded): its rewards update the prompt's pass rate."""
        with self._cond:
            judged = self.curriculum.add(prompt_id, rewards)
            if judged is None:
                return
            samples, pass_rate = judged
            self.book.ledger.record(
                "retired", prompt_id=prompt_id, pass_rate=pass_rate, samples=samples, version=self.version
            )
            if self.curriculum.exhausted:
                log.warning(
                    "curriculum: all %d training prompts are retired at version %d; no more groups are dispatched",
                    len(self.curriculum.prompt_ids),
                    self.version,
                )
                self.book.ledger.record("curriculum_exhausted", version=self.version)

    @property
    def num_retired_prompts(self) -> int:
        with self._cond:
            return len(self.curriculum.retired)

    def on_step(self, new_version: int, group_ids: list[str]) -> None:
        """A step trained on these groups and produced new_version (already published)."""
        with self._cond:
            self.version = new_version
        self.book.trained(new_version, group_ids)

    def dispatch_eval(self, version: int) -> dict[str, Release]:
        """Send every held-out prompt for evaluation at `version`; returns what went out, by group id."""
        groups = [
            self._group(p, f"{self.plan.run_id}-eval{version}-{i}", version, eval_version=version)
            for i, p in enumerate(self.val)
        ]
        self.transport.submit_prompts(groups)
        return {g.group_id: release_of(g, i) for i, g in enumerate(groups)}

    # ---- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    # an exhausted curriculum releases nothing more: the learner ends the run in check()
                    self._cond.wait_for(
                        lambda: (
                            self._stop or (len(self.book.outstanding) < self.window and not self.curriculum.exhausted)
                        )
                    )
                    if self._stop:
                        return
                    groups = [self._next_train_group() for _ in range(self.window - len(self.book.outstanding))]
                    self.book.release({g.group_id: release_of(g, index) for g, index in groups})
                self.transport.submit_prompts([g for g, _ in groups])
        except BaseException as err:
            self._error = err
            log.exception("coordinator failed")

    def _next_train_group(self) -> tuple[PromptGroup, int]:
        """The next prompt in epoch order that the curriculum has not retired (the caller saw one is
        left), as a group and its prompt's index in the training split."""
        while True:
            if self.cursor >= len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._order = self._shuffled(self.epoch)
            index = int(self._order[self.cursor])
            self.cursor += 1
            if not self.curriculum.is_retired(self.train[index].prompt_id):
                break
        self.num_released += 1
        group_id = f"{self.plan.run_id}-{self.num_released - 1}"
        return self._group(self.train[index], group_id, self.version), index

    def _group(self, prompt: Prompt, group_id: str, min_version: int, eval_version: int | None = None) -> PromptGroup:
        is_eval = eval_version is not None
        return PromptGroup(
            run_id=self.plan.run_id,
            group_id=group_id,
            prompt_id=prompt.prompt_id,
            prompt_tokens=int32s(self.encode(prompt)),
            task=self.plan.task,
            payload=prompt.payload,
            n=self.plan.eval_n if is_eval else self.plan.n,
            sampling=self.plan.eval_sampling if is_eval else self.plan.sampling,
            min_version=min_version,
            eval_version=eval_version,
        )

    def _shuffled(self, epoch: int) -> np.ndarray:
        order = list(range(len(self.train)))
        random.Random(self.plan.seed * 100_003 + epoch).shuffle(order)
        return np.asarray(order)

    # ---- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a resumed learner needs, with the ledger offset taken under the same lock."""
        with self._cond:
            return {
                "epoch": self.epoch,
                "cursor": self.cursor,
                "num_released": self.num_released,
                "version": self.version,
                **self.book.state_dict(),
                "curriculum": self.curriculum.state_dict(),
                "ledger_offset": self.book.ledger.offset(),
            }

    def load_state_dict(self, state: dict) -> None:
        with self._cond:
            self.epoch, self.cursor = state["epoch"], state["cursor"]
            self.num_released, self.version = state["num_released"], state["version"]
            self.book.load_state_dict(state)
            self._complete_older_releases(state["outstanding"])
            self.curriculum.load_state_dict(state.get("curriculum", {}))  # absent in checkpoints made before it
            self._order = self._shuffled(self.epoch)

    def _complete_older_releases(self, stored: dict[str, dict]) -> None:
        """Releases from a checkpoint made before they carried their prompt id and interruption budget:
        both as this coordinator releases that prompt (lock held)."""
        for group_id, release in self.book.outstanding.items():
            if "prompt_id" not in stored[group_id]:
                release.prompt_id = self.train[release.index].prompt_id
                release.interrupted_max_tokens = longest_interrupted(self.plan.sampling)

    def resubmit_outstanding(self) -> int:
        """After a restart: queue the groups outstanding at the checkpoint again, and only those (the
        transport withdraws what the dead process released after the checkpoint)."""
        with self._cond:
            groups = [
                self._group(self.train[r.index], group_id, r.min_version)
                for group_id, r in self.book.outstanding.items()
            ]
        self.transport.resubmit_prompts(groups)
        return len(groups)
