"""What a run binds and reaches, checked before any process starts (tidal.ops.reachable): a fixed port in
use, or a tracking server that does not answer, is one line naming the key and the value, at once.
Real sockets on loopback, and a real HTTP server on a thread for the answering case."""

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import ROOT
from tidal.config import ConfigError, load_config
from tidal.ops.cli import main
from tidal.ops.reachable import check_reachable

TINY = ROOT / "configs/tiny.yaml"


@pytest.fixture
def taken_port():
    """A port another process would hold: bound and listening on loopback for the test's length."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed: a connection is refused


def checked(*overrides: str, timeout_s: float = 4.0) -> list[str]:
    return check_reachable(load_config(TINY, list(overrides)), timeout_s)


def refused(*overrides: str, timeout_s: float = 4.0) -> str:
    with pytest.raises(ConfigError) as err:
        checked(*overrides, timeout_s=timeout_s)
    return str(err.value)


@pytest.mark.parametrize(
    "key, extra",
    [
        ("broker.zmq.control_port", ()),
        ("broker.zmq.weights_port", ()),
        ("weights.tcp_port", ("weights.transport=tcp",)),
        ("weights.tcp_port", ("weights.transport=gloo",)),
        ("broker.redis.embedded_port", ("broker.type=redis", "broker.redis.embedded=true")),
    ],
)
def test_a_port_in_use_is_one_line_naming_its_key(taken_port, key, extra):
    assert refused(f"{key}={taken_port}", *extra) == (
        f"config key '{key}' = {taken_port}: the port is in use on 127.0.0.1 (another tidal run?); choose another "
        "or 0 for any"
    )


def test_ports_the_run_does_not_bind_here_and_port_zero_are_not_checked(taken_port):
    assert checked(f"weights.tcp_port={taken_port}")[:-1] == []  # the file channel binds no port
    assert checked("broker.type=redis", f"broker.zmq.control_port={taken_port}")[:-1] == []  # a redis run, no zmq
    assert checked("broker.type=redis", f"broker.redis.embedded_port={taken_port}")[:-1] == []  # a server elsewhere
    assert checked()[:-1] == []  # every port 0: the kernel picks free ones


def test_free_ports_are_listed_and_free_again_after_the_check():
    port = closed_port()
    lines = checked(f"broker.zmq.control_port={port}")
    assert lines[0] == f"ports free on this machine: broker.zmq.control_port = {port}"
    with socket.socket() as again:  # the probe let go: the learner can bind it
        again.bind(("127.0.0.1", port))


def test_a_port_named_twice_names_the_other_key():
    port = closed_port()
    assert refused(f"broker.zmq.control_port={port}", f"broker.zmq.rollout_port={port}") == (
        f"config key 'broker.zmq.rollout_port' = {port}: broker.zmq.control_port binds the same port; choose another "
        "or 0 for any"
    )


def test_a_host_or_port_that_cannot_be_bound_names_its_key():
    assert refused("broker.zmq.host=192.0.2.7", "broker.zmq.control_port=47011") == (
        "config key 'broker.zmq.host' = '192.0.2.7': not an address of this machine, so broker.zmq.control_port = "
        "47011 cannot be bound on it"
    )  # 192.0.2.0/24 is reserved for documentation: never a local address
    assert refused("broker.zmq.host=nosuch.invalid", "broker.zmq.control_port=47011").startswith(
        "config key 'broker.zmq.host' = 'nosuch.invalid': no such host or interface here"
    )
    assert refused("broker.zmq.control_port=70000") == (
        "config key 'broker.zmq.control_port' = 70000: must be in 0..65535 (0: any free port)"
    )


def test_a_tracking_server_that_refuses_fails_at_once_naming_the_uri_without_its_password():
    port = closed_port()
    message = refused(f"tracking.uri=http://me:s3cret@127.0.0.1:{port}")
    assert message == (
        f"config key 'tracking.uri' = 'http://me:***@127.0.0.1:{port}': no MLflow server answered "
        f"http://127.0.0.1:{port}/health within 4 s (connection refused); start it, or point tracking.uri at one "
        "that runs ('' = a sqlite file in the run folder)"
    )


def test_a_tracking_server_that_never_answers_fails_at_the_timeout(taken_port):
    # the kernel accepts the connection into the backlog; nothing ever reads it: the timeout, not a hang
    assert "within 0.5 s (timed out)" in refused(f"tracking.uri=http://127.0.0.1:{taken_port}", timeout_s=0.5)


def test_the_environments_tracking_uri_is_named_as_such(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    assert refused().startswith("$MLFLOW_TRACKING_URI = 'http://127.0.0.1:")


class Health(BaseHTTPRequestHandler):
    """/prefix/health answers 200 OK (an MLflow server under a path prefix), anything else 503."""

    def do_GET(self):
        ok = self.path == "/prefix/health"
        self.send_response(200 if ok else 503)
        self.end_headers()
        self.wfile.write(b"OK" if ok else b"down")

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_a_server_that_answers_its_health_endpoint_passes_and_a_5xx_does_not(health_server):
    assert checked(f"tracking.uri={health_server}/prefix/") == [
        f"MLflow server {health_server}/prefix/: answers (200 from /health)"
    ]
    assert refused(f"tracking.uri={health_server}").endswith(
        f"the MLflow server answered {health_server}/health with 503 Service Unavailable: it is not serving"
    )


def test_a_store_folder_that_cannot_be_made_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert refused(f"tracking.uri=sqlite:///{blocker}/store/mlflow.db") == (
        f"config key 'tracking.uri' = 'sqlite:///{blocker}/store/mlflow.db': {blocker} is a file, so the MLflow "
        f"store's folder {blocker}/store cannot be made"
    )
    assert refused(f"run_dir={blocker}/run").startswith(
        f"config key 'run_dir' = '{blocker}/run' (the MLflow store's folder): {blocker} is a file"
    )
    assert checked(f"run_dir={tmp_path}/new/run") == [
        f"MLflow store {tmp_path}/new/run/mlflow.db: its folder can be written"
    ]
    assert not (tmp_path / "new").exists()  # nothing made


def test_tidal_run_stops_on_a_port_in_use_in_one_line_before_anything_starts(tmp_path, capsys, taken_port):
    assert main(["run", str(TINY), f"run_dir={tmp_path / 'run'}", f"broker.zmq.control_port={taken_port}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"tidal run: config key 'broker.zmq.control_port' = {taken_port}: the port is in use on 127.0.0.1 (another "
        "tidal run?); choose another or 0 for any"
    ]
    assert not (tmp_path / "run").exists()  # before: a traceback from the learner, 29 s in


def test_tidal_run_stops_on_a_tracking_server_that_is_down_in_one_line(tmp_path, capsys):
    port = closed_port()
    assert main(["run", str(TINY), f"run_dir={tmp_path / 'run'}", f"tracking.uri=http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"tidal run: config key 'tracking.uri' = 'http://127.0.0.1:{port}': no MLflow server answered"
    )
    assert not (tmp_path / "run").exists()


def test_a_sweep_stops_on_a_tracking_server_that_is_down_in_one_line(tmp_path, capsys):
    port = closed_port()
    assert (
        main(
            [
                "sweep",
                str(TINY),
                "staleness.max_lag=0,2",
                f"--out={tmp_path / 'sweep'}",
                f"tracking.uri=http://127.0.0.1:{port}",
            ]
        )
        == 2
    )
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(
        f"tidal sweep: the sweep's MLflow store 'http://127.0.0.1:{port}' (tracking.uri, else "
        "MLFLOW_TRACKING_URI): no MLflow server answered"
    ), line


def test_a_free_port_for_a_child_lies_below_the_kernels_ephemeral_range():
    """Connections and bind(0) take ports from that range: one chosen there was taken between the
    launcher's choice and the learner's bind."""
    from tidal.ops.reachable import _ephemeral_low, free_port

    ports = {free_port() for _ in range(8)}
    assert all(20000 <= p < _ephemeral_low() for p in ports), ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free, as promised
