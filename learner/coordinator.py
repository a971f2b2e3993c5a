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

The no-positive-resampling curriculum (DESIGN §6) learns each training prompt's pass rate from
the rewards of the groups the learner receives (trained or discarded alike: an all-pass group
is dropped as zero-variance, and it is exactly the evidence that retires a prompt). A prompt is
judged once `curriculum.min_samples` of its samples arrived since its last judgement; a pass
rate >= `curriculum.retire_pass_rate` retires it for good (ledger event "retired"), and it is
never dispatched again, also after a resume. When every prompt is retired nothing more is
released; once the groups in flight are consumed the learner fails with `CurriculumExhausted`
instead of waiting for rollouts that cannot come.
"""
from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tidal.broker.base import LearnerTransport
from tidal.broker.schema import PromptGroup, SamplingParams, int32s
from tidal.config import CurriculumConfig
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


class CurriculumExhausted(RuntimeError):
    """Every training prompt is retired and no group is left in flight: the run cannot make a step."""


class Curriculum:
    """No-positive-resampling: per-prompt pass counts and the set of retired prompt ids."""

    def __init__(self, cfg: CurriculumConfig | None, prompt_ids: Iterable[int]):
        self.cfg = cfg
        self.prompt_ids = frozenset(prompt_ids)
        self.pending: dict[int, list[int]] = {}  # prompt id -> [samples, passes] since its last judgement
        self.retired: set[int] = set()

    @property
    def enabled(self) -> bool:
        return self.cfg is not None and self.cfg.enabled

    @property
    def exhausted(self) -> bool:
        return self.enabled and bool(self.prompt_ids) and self.prompt_ids <= self.retired

    def is_retired(self, prompt_id: int) -> bool:
        # Disabled (e.g. on a resume with curriculum.enabled=false), the retired set is kept but not applied.
        return self.enabled and prompt_id in self.retired

    def add(self, prompt_id: int, rewards: list[float]) -> tuple[int, float] | None:
        """Count one group's rewards; returns (samples, pass rate) when they retire the prompt."""
        if not self.enabled or prompt_id not in self.prompt_ids or prompt_id in self.retired:
            return None  # eval or unknown prompts never count; a retired prompt's late groups change nothing
        counts = self.pending.setdefault(prompt_id, [0, 0])
        counts[0] += len(rewards)
        counts[1] += sum(r > 0 for r in rewards)  # tidal's rewards are 1 for a pass, 0 otherwise
        if counts[0] < self.cfg.min_samples:
            return None
        samples, passes = self.pending.pop(prompt_id)  # judged: the next judgement uses fresh samples
        if passes / samples < self.cfg.retire_pass_rate:
            return None
        self.retired.add(prompt_id)
        return samples, passes / samples

    def state_dict(self) -> dict:
        return {"pending": {str(k): v for k, v in self.pending.items()}, "retired": sorted(self.retired)}

    def load_state_dict(self, state: dict) -> None:
        self.pending = {int(k): [int(v[0]), int(v[1])] for k, v in state.get("pending", {}).items()}
        self.retired = {int(k) for k in state.get("retired", [])}


class Coordinator:
    def __init__(self, plan: DispatchPlan, train: list[Prompt], val: list[Prompt], encode,
                 transport: LearnerTransport, ledger: Ledger, curriculum: CurriculumConfig | None = None):
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
        self.curriculum = Curriculum(curriculum, (p.prompt_id for p in train))  # None: every prompt stays
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
        """Re-raise a coordinator failure in the training thread; fail when the curriculum left nothing."""
        if self._error is not None:
            raise RuntimeError(f"coordinator thread failed: {self._error!r}") from self._error
        with self._cond:
            starved = self.curriculum.exhausted and all(g in self.consumed for g in self.outstanding)
        if starved:
            cfg = self.curriculum.cfg
            raise CurriculumExhausted(
                f"every training prompt ({len(self.curriculum.prompt_ids)}) is retired by the curriculum "
                f"(pass rate >= curriculum.retire_pass_rate = {cfg.retire_pass_rate} over curriculum.min_samples = "
                f"{cfg.min_samples} samples) and no group is left in flight at version {self.version}: nothing to "
                "train on. Lower learner.max_steps, raise curriculum.retire_pass_rate or set curriculum.enabled=false")

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

    def on_rewards(self, prompt_id: int, rewards: list[float]) -> None:
        """A training group arrived (trained or discarded): its rewards update the prompt's pass rate."""
        with self._cond:
            judged = self.curriculum.add(prompt_id, rewards)
            if judged is None:
                return
            samples, pass_rate = judged
            self.ledger.record("retired", prompt_id=prompt_id, pass_rate=pass_rate, samples=samples,
                               version=self.version)
            if self.curriculum.exhausted:
                log.warning("curriculum: all %d training prompts are retired at version %d; no more groups "
                            "are dispatched", len(self.curriculum.prompt_ids), self.version)
                self.ledger.record("curriculum_exhausted", version=self.version)

    @property
    def num_retired_prompts(self) -> int:
        with self._cond:
            return len(self.curriculum.retired)

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
                    # an exhausted curriculum releases nothing more: the learner fails in check()
                    self._cond.wait_for(lambda: self._stop or (len(self.outstanding) < self.window
                                                               and not self.curriculum.exhausted))
                    if self._stop:
                        return
                    groups = [self._next_train_group() for _ in range(self.window - len(self.outstanding))]
                    self.ledger.record("released", ids=[g.group_id for g in groups])
                self.transport.submit_prompts(groups)
        except BaseException as err:
            self._error = err
            log.exception("coordinator failed")

    def _next_train_group(self) -> PromptGroup:
        """The next prompt in epoch order that the curriculum has not retired (the caller saw one is left)."""
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
                    "curriculum": self.curriculum.state_dict(), "ledger_offset": self.ledger.offset()}

    def load_state_dict(self, state: dict) -> None:
        with self._cond:
            self.epoch, self.cursor = state["epoch"], state["cursor"]
            self.num_released, self.version = state["num_released"], state["version"]
            self.outstanding = {k: (int(v[0]), int(v[1])) for k, v in state["outstanding"].items()}
            self.consumed, self.dead = set(state["consumed"]), set(state["dead"])
            self.counts = Counter(state["counts"])
            self.curriculum.load_state_dict(state.get("curriculum", {}))  # absent in checkpoints made before it
            self._order = self._shuffled(self.epoch)

    def resubmit_outstanding(self) -> int:
        """After a restart on a transport that kept nothing (ZeroMQ): queue the outstanding groups again."""
        with self._cond:
            groups = [self._group(self.train[index], group_id, min_version, is_eval=False)
                      for group_id, (index, min_version) in self.outstanding.items()]
        self.transport.submit_prompts(groups)
        return len(groups)
