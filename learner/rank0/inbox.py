"""The learner's side of the broker as the training thread reads it: one rollout at a time; about
once a second, actor joins into the ledger and dead letters to whoever owns the group; the health
file touched. Actors that stay quiet for `learner.rollout_timeout_s` fail the run, naming them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tidal.broker.base import LearnerTransport
from tidal.broker.schema import RolloutGroup
from tidal.health import HealthFile
from tidal.learner.rank0.accounting import Accounting
from tidal.learner.rank0.ledger import Ledger

BROKER_POLL_S = 1.0  # how often joins and dead letters are asked for
RECV_WAIT_S = 0.5  # one wait for a rollout: the caller re-checks its own state (coordinator, evals) this often


class Inbox:
    def __init__(
        self,
        transport: LearnerTransport,
        ledger: Ledger,
        accounting: Accounting,
        timeout_s: float,
        health_file: str,
        on_dead_letter: Callable[[str], None],
    ):
        self.transport = transport
        self.ledger = ledger
        self.accounting = accounting
        self.timeout_s = timeout_s
        self.health = HealthFile(health_file)
        self.on_dead_letter = on_dead_letter
        self.next_poll = 0.0
        self.last_arrival = time.monotonic()

    def restart_clock(self) -> None:
        """Start counting the rollout timeout from now (a new step batch, the final evaluation)."""
        self.last_arrival = time.monotonic()

    def next(self, version: int, what: str = "a rollout") -> RolloutGroup | None:
        """One rollout, or None after a short wait; raises once none arrived for the timeout."""
        self.poll(version)
        group = self.transport.recv_rollout(timeout_s=RECV_WAIT_S)
        if group is None:
            if time.monotonic() - self.last_arrival > self.timeout_s:
                raise TimeoutError(
                    f"waiting for {what}: no rollout arrived for {self.timeout_s:.0f} s "
                    f"(learner.rollout_timeout_s; live actors: {sorted(self.transport.actors())})"
                )
            return None
        self.last_arrival = time.monotonic()
        self.accounting.received(group.actor_id)
        return group

    def poll(self, version: int) -> None:
        """Liveness, actor joins and dead letters, about once a second."""
        self.health.touch()
        if time.monotonic() < self.next_poll:
            return
        self.next_poll = time.monotonic() + BROKER_POLL_S
        for join in self.transport.take_joins():
            self.ledger.record(
                "actor_joined",
                actor=join.actor_id,
                version=join.version,
                announced=join.announced,
                learner_version=version,
            )
        for group_id in self.transport.take_dead_letters():
            self.on_dead_letter(group_id)
