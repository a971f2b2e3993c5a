"""Flow metrics and the Prometheus endpoint: time counted by state up to the moment it is read, values
served by Prometheus' conventions from what a role describes, the actors' time shares from their
heartbeats, and a sample's age bounded by what the learner itself saw."""

import socket
import urllib.request

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import rollout
from tidal import prometheus
from tidal.actor.loop import BUSY, IDLE, WAITING_FOR_WEIGHTS, Actor
from tidal.broker.base import FLOW_WINDOW_S, actor_info
from tidal.broker.schema import Heartbeat
from tidal.config import load_config
from tidal.learner.rank0.flow import LearnerFlow
from tidal.prometheus import COUNTER, GAUGE, MetricsEndpoint, Spec, StateClock


class FakeTime:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock_time(monkeypatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(prometheus.time, "monotonic", fake)
    return fake


def test_a_state_clock_counts_the_open_interval_up_to_the_read(clock_time):
    clock = StateClock(("wait", "work"), "wait")
    clock_time.now += 5
    assert clock.seconds() == {"wait": 5.0, "work": 0.0}  # still waiting: the wait so far is counted
    clock.enter("work")
    clock_time.now += 2
    clock.enter("wait")
    clock_time.now += 1
    assert clock.seconds() == {"wait": 6.0, "work": 2.0}
    assert clock.seconds() == {"wait": 6.0, "work": 2.0}  # reading does not move it


def scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_an_endpoint_serves_what_a_role_describes_by_prometheus_conventions():
    now = {"tidal_test_wait_seconds_total": 1.5, "tidal_test_version": 3, "tidal_test_lag": {"a-0": 1, "a-1": 2}}
    endpoint = MetricsEndpoint({"run": "demo", "actor": "a-0"})
    endpoint.describe(
        [
            Spec("tidal_test_wait_seconds_total", COUNTER, "seconds waiting"),
            Spec("tidal_test_version", GAUGE, "a version"),
            Spec("tidal_test_lag", GAUGE, "lag by actor", "peer"),
            Spec("tidal_test_absent", GAUGE, "left out of the values: not served"),
        ],
        lambda: now,
    )
    ages = endpoint.histogram("tidal_test_age_seconds", "ages")
    port = endpoint.serve("127.0.0.1", 0)
    try:
        ages.observe(0.3)
        ages.observe(7.0)
        got = scrape(port)
        (wait,) = got["tidal_test_wait_seconds"].samples
        assert got["tidal_test_wait_seconds"].type == "counter" and wait.name == "tidal_test_wait_seconds_total"
        assert wait.value == 1.5 and wait.labels == {"run": "demo", "actor": "a-0"}
        assert got["tidal_test_version"].type == "gauge" and got["tidal_test_version"].samples[0].value == 3
        lags = {s.labels["peer"]: s.value for s in got["tidal_test_lag"].samples}
        assert lags == {"a-0": 1, "a-1": 2}
        assert "tidal_test_absent" not in got
        buckets = [s for s in got["tidal_test_age_seconds"].samples if s.name.endswith("_bucket")]
        counts = {s.labels["le"]: s.value for s in buckets}
        assert counts["0.5"] == 1 and counts["10.0"] == 2 and counts["+Inf"] == 2
        now["tidal_test_wait_seconds_total"] = 4.0  # read at each scrape, not pushed
        assert scrape(port)["tidal_test_wait_seconds"].samples[0].value == 4.0
        with pytest.raises(OSError, match="tracking.metrics_port"):  # a port that is taken fails by name
            MetricsEndpoint({"run": "demo"}).serve("127.0.0.1", port)
    finally:
        endpoint.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def beat(uptime: float, work=0.0, weights=0.0, pause=0.0, pulls=0.0, pull=0.0) -> Heartbeat:
    return Heartbeat(
        actor_id="actor-0",
        version=1,
        engine={},
        outstanding=[],
        uptime_s=uptime,
        work_wait_s=work,
        weights_wait_s=weights,
        weight_pause_s=pause,
        weight_pulls_s=pulls,
        weight_pull_s=pull,
    )


def test_an_actors_time_shares_come_over_a_window_bounded_and_start_again_after_a_restart():
    info = actor_info(beat(1.0), None)
    assert info.shares == {}  # nothing measured yet
    info = actor_info(beat(1.0 + FLOW_WINDOW_S / 2, work=3.0), info)
    assert info.shares == {}  # a heartbeat's worth of time would be noise: not yet a window
    window = beat(1.0 + FLOW_WINDOW_S, work=FLOW_WINDOW_S / 2, weights=1.0, pause=0.5, pulls=0.8, pull=0.1)
    info = actor_info(window, info)
    assert info.shares == {
        "flow/actor_work_wait_share": pytest.approx(0.5),
        "flow/actor_weights_wait_share": pytest.approx(1.0 / FLOW_WINDOW_S),
        "flow/actor_pause_share": pytest.approx(0.5 / FLOW_WINDOW_S),
        "flow/actor_pull_share": pytest.approx(0.8 / FLOW_WINDOW_S),
    }
    assert info.flow["weight_pull_s"] == 0.1  # the latest update's, as timing/actor_weight_pull_s reports it
    kept = info.shares
    info = actor_info(beat(2.0 + FLOW_WINDOW_S, work=1e9), info)
    assert info.shares == kept  # the next window is not full: the last shares stand
    info = actor_info(beat(1.0 + 3 * FLOW_WINDOW_S, work=1e9, weights=0.0), info)
    assert info.shares["flow/actor_work_wait_share"] == 1.0  # an actor saying anything stays within [0, 1]
    info = actor_info(beat(0.5), info)
    assert info.shares == {} and info.baseline["uptime_s"] == 0.5  # restarted: measured afresh


def test_a_samples_age_is_bounded_by_its_release_and_its_arrival(monkeypatch):
    from tidal.learner.rank0 import flow as flow_module

    now = FakeTime(1_000.0)
    monkeypatch.setattr(flow_module.time, "time", now)
    flow = LearnerFlow(StateClock(("rollouts", "train", "push", "checkpoint", "other"), "other"))
    # said 990: it is 20 s old at 1010; before its release (980): as old as the release; in the future, or
    # not said: as old as its arrival (1000)
    groups = [
        msgspec.structs.replace(rollout(group_id=f"g{i}"), finished_at=said)
        for i, said in enumerate((990.0, 1.0, 5_000.0, 0.0))
    ]
    for group in groups:
        flow.arrived(group, released_at=980.0)
    now.now = 1_010.0
    observed = []
    flow.on_age = observed.append
    flow.trained(groups)
    assert flow.last_ages == [20.0, 30.0, 10.0, 10.0] and observed == flow.last_ages
    assert flow.generation_end == {}


def test_an_actors_time_goes_to_work_weights_or_generation_as_its_groups_say(tmp_path):
    cfg = load_config("configs/tiny.yaml", [f"run_dir={tmp_path}"])
    actor = Actor(cfg.actor, engine=None, transport=None, receiver=None)
    assert actor.clock.state == IDLE
    actor.outstanding = {"g1": None, "g2": None}
    actor.waiting_for_weights = 1
    actor.settle()
    assert actor.clock.state == BUSY  # one group generates while the other waits
    actor.waiting_for_weights = 2
    actor.settle()
    assert actor.clock.state == WAITING_FOR_WEIGHTS
    actor.outstanding = {}
    actor.waiting_for_weights = 0
    actor.settle()
    assert actor.clock.state == IDLE
    flow = actor.flow()
    assert set(flow) == {"uptime_s", "work_wait_s", "weights_wait_s", "weight_pause_s", "weight_pulls_s"} | {
        "weight_pull_s"
    }
    assert flow["uptime_s"] >= flow["work_wait_s"] + flow["weights_wait_s"]
