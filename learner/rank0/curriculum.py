"""The no-positive-resampling curriculum: prompts the policy already solves are not dispatched again.

Each training prompt's pass rate is learned from the rewards of the groups the learner receives
(trained or discarded alike: an all-pass group is dropped as zero-variance, and it is exactly
the evidence that retires a prompt). A sample passes when its task reward is at least
`task.pass_threshold`, whatever the reward's scale: partial credit for a wrong answer is no pass.
A prompt is judged once `curriculum.min_samples` of its samples arrived since its last judgement;
a pass rate >= `curriculum.retire_pass_rate` retires it for good, also after a resume. When every
prompt is retired nothing more is released, and the learner ends the run (`CurriculumExhausted`)
once the groups in flight are consumed.
"""

from __future__ import annotations

from collections.abc import Iterable

from tidal.config import CurriculumConfig


class CurriculumExhausted(RuntimeError):
    """Every training prompt is retired and no group is left in flight: the run cannot make a step."""


class Curriculum:
    """No-positive-resampling: per-prompt pass counts and the set of retired prompt ids."""

    def __init__(self, cfg: CurriculumConfig | None, prompt_ids: Iterable[int], pass_threshold: float = 1.0):
        self.cfg = cfg
        self.pass_threshold = pass_threshold  # task.pass_threshold: a reward at least this is a pass
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
        counts[1] += sum(r >= self.pass_threshold for r in rewards)
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
