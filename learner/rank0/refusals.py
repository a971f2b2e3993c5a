"""Rollouts the learner refuses, watched so that none is refused in silence.

The validator refuses a group whose rewards, tokens, versions or timings cannot be trusted (validation.py).
One refused now and then is an actor's glitch; many refused for one reason is a setting: a reward
scale beyond task.reward_range refuses exactly the groups that hold a right answer, and the model then
trains on wrong answers alone. So, per step's worth of groups received (learner.groups_per_step): a
reason that took more than WARN_FRAC of them is said once, with the setting that fixes it, in the
learner's log and on the console (the `tidal.notice` logger, which `tidal run` shows); the step's
share refused is a metric (`learner/refused_frac`). When more than STOP_FRAC of the last
learner.refusal_patience_steps steps' worth of groups were refused, the run stops with that line,
unless the refusals are one actor's: an actor that sent a step's worth of them, nearly all refused,
while the other actors' groups are mostly kept, is a broken or hostile actor, not a setting. It is
barred instead (the transport grants it nothing more and refuses what it sends), said once, and the
run goes on with the others.
"""

from __future__ import annotations

from collections import Counter, deque

from tidal.learner.rank0.notices import notice

WARN_FRAC = 0.05  # "more than a few percent" of a step's groups
STOP_FRAC = 0.5  # most of what arrives is refused: the run learns from what is left, if anything
ALONE_FRAC = 0.9  # an actor with this share of its groups refused, the others mostly kept, is barred

# reason -> what to do about it (a reason not named here is an actor of another run or version)
FIX = {
    "reward": "widen task.reward_range to hold every sample's reward (the reward functions' weighted sum), or "
    "rescale the rewards",
    "reward_component": "rename the reward function or the value the environment's score() returns",
    "length": "the actors sample more than sampling.max_tokens: start them with this run's config",
    "token_id": "the actors serve a larger vocabulary than the learner's model: give both the same model.path",
    "logprob": "the actors report logprobs no sampler can give: check the engine's settings (actor.vllm)",
    "version": "an actor claims weights this learner never announced: start the actors with this run's config",
    "timing": "an actor's clock runs ahead of the learner's: synchronise the machines' clocks",
    "empty_completion": "the actors' engine returned completions without a token: check actor.vllm",
    "finish_reason": "the task's environment ended episodes on its own reply: check its step()",
    "injected_spans": "the task's environment answered before the model spoke: check its start()",
}
OTHER_RUN = "an actor of another run or another tidal version: restart the actors with this run's config"


class RolloutsRefused(RuntimeError):
    """Most of what the actors send is refused: training on the rest would mislead."""


class RefusalWatch:
    """Counts each checked group's verdict; warns once per reason; raises RolloutsRefused when most are refused."""

    def __init__(self, groups_per_step: int, patience_steps: int, bar=None, live=None):
        self.block = max(groups_per_step, 1)  # a step's worth of groups
        # (actor id, reason or None) of the last groups checked
        self.recent: deque[tuple[str, str | None]] = deque(maxlen=self.block * patience_steps if patience_steps else 1)
        self.bar = bar  # bar(actor_id): the transport grants it nothing more (None: the run stops instead)
        self.live = live or (lambda: ())  # the live actor ids (the transport's)
        self.barred: list[str] = []
        self.stops = patience_steps > 0
        self.in_block: Counter[str] = Counter()
        self.checked_in_block = 0
        self.warned: set[str] = set()
        self.details: dict[str, str] = {}  # reason -> what the last group refused for it held
        self.step_checked, self.step_refused = 0, 0  # since the last step's metrics

    def observe(self, reason: str | None, detail: str = "", actor_id: str = "") -> None:
        """One checked group: its reason for refusal (None: kept), what the value was, who sent it."""
        if actor_id not in self.barred:  # a barred actor's groups still in flight say nothing more
            self.recent.append((actor_id, reason))
        self.step_checked += 1
        self.checked_in_block += 1
        if reason is not None:
            self.step_refused += 1
            self.in_block[reason] += 1
            self.details[reason] = detail
        if self.checked_in_block >= self.block:
            self.warn()
        self.stop_if_most_refused()

    def warn(self) -> None:
        for reason, count in self.in_block.items():
            if count > WARN_FRAC * self.checked_in_block and reason not in self.warned:
                self.warned.add(reason)
                notice.warning("%s", self.line(reason, count, self.checked_in_block))
        self.in_block.clear()
        self.checked_in_block = 0

    def stop_if_most_refused(self) -> None:
        if not self.stops or len(self.recent) < self.recent.maxlen:
            return
        refused = Counter(r for _, r in self.recent if r is not None)
        if sum(refused.values()) > STOP_FRAC * len(self.recent) and not self.bar_the_ones_refused_alone():
            top, count = refused.most_common(1)[0]
            raise RolloutsRefused(
                f"{self.line(top, count, len(self.recent))}; stopping the run (learner.refusal_patience_steps)"
            )

    def bar_the_ones_refused_alone(self) -> bool:
        """Bars the actors refused alone (a step's worth of groups sent, ALONE_FRAC of them refused, the
        others' groups mostly kept) and forgets their verdicts; whether the run goes on: any was barred,
        or the window holds only theirs while other live actors have yet to be heard."""
        if self.bar is None:
            return False
        sent = Counter(actor for actor, _ in self.recent)
        refused = Counter(actor for actor, reason in self.recent if reason is not None)
        alone = {a for a in sent if sent[a] >= self.block and refused[a] >= ALONE_FRAC * sent[a]}
        rest = [reason for actor, reason in self.recent if actor not in alone]
        if alone and not rest:  # a fast liar can fill the window before an honest actor's first group is in
            return bool(set(self.live()) - alone - set(self.barred))
        if not alone or sum(r is not None for r in rest) > STOP_FRAC / 2 * len(rest):
            return False
        for actor in sorted(alone):
            reasons = Counter(r for a, r in self.recent if a == actor and r is not None)
            top, count = reasons.most_common(1)[0]
            notice.warning(
                "actor %s is barred: the learner refused %d of its last %d rollout groups ('%s'%s) while it kept "
                "most of the other actors'; it is granted nothing more (restart it with this run's config)",
                actor,
                refused[actor],
                sent[actor],
                top,
                f": {self.details[top]}" if self.details.get(top) else "",
            )
            self.bar(actor)
            self.barred.append(actor)
        kept = [(a, r) for a, r in self.recent if a not in alone]
        self.recent.clear()
        self.recent.extend(kept)
        return True

    def line(self, reason: str, count: int, of: int) -> str:
        seen = f" ({self.details[reason]})" if self.details.get(reason) else ""
        return (
            f"the learner refused {count} of the last {of} rollout groups ({count / of:.0%}) for '{reason}'"
            f"{seen}: {FIX.get(reason, OTHER_RUN)}"
        )

    def step_metrics(self) -> dict[str, float]:
        """The share of the groups checked since the last step that were refused."""
        frac = self.step_refused / self.step_checked if self.step_checked else 0.0
        self.step_checked, self.step_refused = 0, 0
        return {"learner/refused_frac": frac}
