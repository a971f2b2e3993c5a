"""Grants of the ZeroMQ and in-process transports: no live actor hoards the window (a fair share of the
groups in circulation each), a group held too long goes to the others too (broker.grant_timeout_s), and
an actor the learner bars is granted nothing more."""

import pytest

from conftest import prompt_group
from tidal.broker.grants import GrantTable
from tidal.broker.schema import Heartbeat
from tidal.config import BrokerConfig, ConfigError

WINDOW, STEP, N = 48, 16, 8  # the demo's window at max_lag 2: three steps of 16 groups of 8 samples
EVERYTHING = 1 << 24  # samples a hoarder asks for at once


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(*actors: str, grant_timeout_s: float = 0.0, clock=None) -> GrantTable:
    grants = GrantTable(actor_timeout_s=10, grant_timeout_s=grant_timeout_s, clock=clock or Clock())
    for actor in actors:
        grants.on_heartbeat(Heartbeat(actor_id=actor, version=0, engine={}, outstanding=[], hello=True))
    return grants


class Coordinator:
    """Keeps WINDOW groups outstanding, as the learner's admission does: a group frees its slot when returned."""

    def __init__(self, grants: GrantTable):
        self.grants, self.released, self.outstanding = grants, 0, set()

    def refill(self) -> None:
        fresh = [prompt_group(self.released + i, n=N) for i in range(WINDOW - len(self.outstanding))]
        self.released += len(fresh)
        self.outstanding |= {g.group_id for g in fresh}
        self.grants.submit(fresh)

    def returned(self, group_id: str, actor_id: str) -> bool:
        if self.grants.returned(group_id, actor_id) is not None:
            return False
        self.outstanding.discard(group_id)
        return True


def honest_steps(grants: GrantTable, rounds: int) -> int:
    """Steps an honest actor makes in `rounds` requests, each answered at once, while a hoarder asks for
    everything before each of them and answers nothing."""
    coordinator, trained = Coordinator(grants), 0
    for _ in range(rounds):
        coordinator.refill()
        grants.take("hoarder", EVERYTHING)
        trained += sum(coordinator.returned(g.group_id, "honest") for g in grants.take("honest", 32 * N))
    return trained // STEP


def test_a_hoarder_holds_at_most_its_fair_share_and_the_honest_actor_trains_on():
    grants = table("hoarder", "honest")
    steps = honest_steps(grants, rounds=20)
    # without the share the hoarder took all 48 groups at the first request and the honest actor none: 0 steps
    assert grants.held["hoarder"] == WINDOW // 2
    assert steps == 20 * (WINDOW // 2) // STEP
    assert grants.metrics({})["broker/share_capped_requests"] >= 20


def test_one_actor_takes_all_it_asks_for_and_two_split_the_queue():
    alone = table("a")
    alone.submit([prompt_group(i, n=N) for i in range(WINDOW)])
    assert len(alone.take("a", EVERYTHING)) == WINDOW
    pair = table("a", "b")
    pair.submit([prompt_group(i, n=N) for i in range(WINDOW)])
    assert len(pair.take("a", 10 * N)) == 10  # below its share: as many as its samples allow
    assert len(pair.take("b", EVERYTHING)) == WINDOW // 2
    assert len(pair.take("a", EVERYTHING)) == WINDOW // 2 - 10


def test_a_group_held_past_the_grant_timeout_goes_to_the_others_and_the_first_rollout_in_counts():
    clock = Clock()
    grants = table("hoarder", "honest", grant_timeout_s=600, clock=clock)
    grants.submit([prompt_group(i, n=N) for i in range(4)])
    held = [g.group_id for g in grants.take("hoarder", EVERYTHING)]
    assert held == ["r-0", "r-1"]
    clock.now = 599.0
    grants.expire()
    assert [g.group_id for g in grants.take("honest", EVERYTHING)] == ["r-2", "r-3"]
    assert grants.returned("r-2", "honest") is None and grants.returned("r-3", "honest") is None
    clock.now = 601.0
    grants.expire()  # the hoarder's two are due; the honest actor's are 2 s old
    assert grants.metrics({})["broker/overdue_groups"] == 2 and "hoarder" not in grants.held
    # two in circulation: one each, so the honest actor takes the second once it has answered the first
    assert [g.group_id for g in grants.take("honest", EVERYTHING)] == ["r-0"]
    assert grants.returned("r-0", "honest") is None
    assert [g.group_id for g in grants.take("honest", EVERYTHING)] == ["r-1"]
    # either holder may deliver; the first copy in is accepted, the other refused
    assert grants.returned("r-0", "hoarder") == "ungranted"
    assert grants.returned("r-1", "hoarder") is None and grants.returned("r-1", "honest") == "ungranted"
    assert not grants.held and not grants.granted


def test_a_barred_actor_is_granted_nothing_its_groups_go_to_the_others_and_its_rollouts_are_refused():
    grants = table("liar", "honest")
    grants.submit([prompt_group(i, n=N) for i in range(WINDOW)])
    held = grants.take("liar", EVERYTHING)
    assert len(held) == WINDOW // 2
    grants.bar("liar")
    assert grants.take("liar", EVERYTHING) == []
    assert grants.returned(held[0].group_id, "liar") == "barred"  # granted before the bar: refused all the same
    assert len(grants.take("honest", EVERYTHING)) == WINDOW  # the liar's share is the honest actor's now
    assert grants.metrics({})["broker/barred_actors"] == 1


def test_the_grant_timeout_is_checked_in_config():
    with pytest.raises(ConfigError, match="broker.grant_timeout_s"):
        BrokerConfig(grant_timeout_s=-1).check()
