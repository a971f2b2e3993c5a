"""Prometheus metrics of one process (the learner's rank 0, an actor), for the people who operate a run:
a `/metrics` endpoint on `tracking.metrics_port`, served by prometheus-client on its own thread.

Metrics as data: a role describes its metrics once (`Spec`: name, kind, help, extra labels) and hands
the endpoint a function that returns their values ({name: value}, or {name: {label value: value}} for a
labelled one); a scrape reads that function, so nothing is pushed from the step and a slow scraper never
holds it up. Time shares come from a `StateClock`, whose open interval counts up to the scrape: a learner
starved for a minute shows that minute while it lasts, not after. Histograms (ages, pauses) are observed
where they happen. Every series carries the run's labels (`run`, and `actor` on an actor's).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

COUNTER, GAUGE = "counter", "gauge"
# seconds: from a sub-second weight pause to an hour-old sample
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)

Values = Mapping[str, float | Mapping[str, float]]


@dataclass(frozen=True)
class Spec:
    """One metric a role serves: `name` by Prometheus' conventions (tidal_ prefix, the unit in the name,
    _total on counters), its kind, its help, and the label its values are keyed by, if any."""

    name: str
    kind: str
    help: str
    label: str = ""


class StateClock:
    """Seconds spent in each of a few states, the current one counted up to the moment it is read.
    Thread-safe: the owner moves it on its own thread; a scrape reads it from the server's."""

    def __init__(self, states: Iterable[str], initial: str):
        self.totals = dict.fromkeys(states, 0.0)
        self.state, self.since = initial, time.monotonic()
        self._lock = threading.Lock()

    def enter(self, state: str) -> None:
        with self._lock:
            now = time.monotonic()
            self.totals[self.state] += now - self.since
            self.state, self.since = state, now

    def seconds(self) -> dict[str, float]:
        with self._lock:
            out = dict(self.totals)
            out[self.state] += time.monotonic() - self.since
        return out


class _Values(Collector):
    """The families of `specs`, read from `values()` at each scrape; a metric it leaves out is not served."""

    def __init__(self, specs: Iterable[Spec], values: Callable[[], Values], labels: Mapping[str, str]):
        self.specs, self.values, self.labels = list(specs), values, dict(labels)

    def collect(self) -> Iterable[Metric]:
        now = self.values()
        for spec in self.specs:
            if spec.name not in now:
                continue
            value = now[spec.name]
            names = [*self.labels, *([spec.label] if spec.label else [])]
            family = (CounterMetricFamily if spec.kind == COUNTER else GaugeMetricFamily)(
                spec.name.removesuffix("_total") if spec.kind == COUNTER else spec.name, spec.help, labels=names
            )
            points = value.items() if spec.label else [(None, value)]
            for key, number in points:
                family.add_metric([*self.labels.values(), *([key] if spec.label else [])], float(number))
            yield family


class MetricsEndpoint:
    """One process's metrics: the families a role describes, its histograms, and the HTTP server."""

    def __init__(self, labels: Mapping[str, str]):
        self.labels = dict(labels)
        self.registry = CollectorRegistry(auto_describe=False)
        self.server = None

    def describe(self, specs: Iterable[Spec], values: Callable[[], Values]) -> None:
        self.registry.register(_Values(specs, values, self.labels))

    def histogram(self, name: str, help: str, buckets=SECONDS_BUCKETS):
        """A histogram with this process's labels, ready to observe."""
        family = Histogram(name, help, list(self.labels), registry=self.registry, buckets=buckets)
        return family.labels(**self.labels)

    def serve(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); the port bound. A port that is taken fails here, by name."""
        try:
            self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            raise OSError(f"tracking.metrics_port: cannot serve Prometheus metrics on {host}:{port}: {err}") from err
        return self.server.server_port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
