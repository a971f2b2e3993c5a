"""What a run binds and reaches outside itself, checked before any process starts: every fixed port it
binds on this machine is free, and its MLflow store answers (a server) or can be written (a file).

Found later, each costs more than its line here: a port in use stopped the learner with a 15-line
ZeroMQ traceback after ~30 s of start-up, and a tracking server that is down kept the console silent
for minutes while MLflow retried in the learner's log.

    ports   broker.zmq.*_port (zmq broker), broker.redis.embedded_port (embedded redis-server),
            weights.tcp_port (tcp, gloo, nccl): each bound and listened on for a moment, as the run
            will; 0 (any free port) is not checked
    store   http(s): GET <uri>/health within STORE_TIMEOUT_S; sqlite or file: a file made and removed
            in the store's folder, or the nearest folder above it that exists (nothing is created)
"""

from __future__ import annotations

import errno
import os
import random
import socket
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tidal.config import BrokerType, ConfigError, RunConfig, WeightTransport, redact_uri

STORE_TIMEOUT_S = 4.0  # a server that has not answered /health by then is reported; MLflow would retry for minutes
ANY_ADDRESS = ("", "*", "0.0.0.0", "::")  # every interface: ZeroMQ writes it *, sockets ""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now for a process started later to bind, chosen below the kernel's ephemeral range.

    A port the kernel hands out for bind(0) lies in that range, and so does the local end of every
    outgoing connection: between this choice and the child's bind, a vLLM engine starting beside it
    (its own ports, its connections) took the learner's port once in a CI run. Below the range only a
    process that names the port can take it. Falls back to bind(0) where the range leaves no room."""
    low = _ephemeral_low()
    for port in random.sample(range(20000, low), min(64, max(low - 20000, 0))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere the range differs and bind(0) is the fallback


@dataclass(frozen=True)
class BoundPort:
    """A port the run binds on this machine, and the config keys it comes from."""

    key: str
    port: int
    host_key: str
    host: str


def check_reachable(cfg: RunConfig, timeout_s: float = STORE_TIMEOUT_S) -> list[str]:
    """One line per thing checked; raises ConfigError naming the key (or $MLFLOW_TRACKING_URI) and its value."""
    return [*check_ports(bound_ports(cfg)), check_store(cfg, timeout_s)]


def bound_ports(cfg: RunConfig) -> list[BoundPort]:
    """The fixed ports `tidal run` binds here. Not learner.master_port: tidal run picks a free one for the
    ranks on one machine, and on several it is node 0's, where torchrun binds it."""
    found = []
    if cfg.broker.type is BrokerType.zmq:
        z = cfg.broker.zmq
        found += [
            BoundPort(f"broker.zmq.{name}_port", getattr(z, f"{name}_port"), "broker.zmq.host", z.host)
            for name in ("control", "rollout", "weights")
        ]
    elif cfg.broker.redis.embedded:  # started by tidal run on loopback (tidal.ops.launcher.start_redis)
        found.append(BoundPort("broker.redis.embedded_port", cfg.broker.redis.embedded_port, "", "127.0.0.1"))
    if cfg.weights.transport != WeightTransport.file:
        found.append(BoundPort("weights.tcp_port", cfg.weights.tcp_port, "weights.tcp_host", cfg.weights.tcp_host))
    return [b for b in found if b.port]


def check_ports(ports: list[BoundPort]) -> list[str]:
    """Each port bound and listened on, all at once, as the run will hold them: one in use by another
    process, or named twice, is a ConfigError naming its key."""
    if not ports:
        return []
    holders: dict[int, str] = {}  # port -> the key whose probe holds it now
    with ExitStack() as held:
        for bound in ports:
            probe = listen_on(bound, holders)
            if probe is not None:
                held.enter_context(probe)
                holders.setdefault(bound.port, bound.key)
    return ["ports free on this machine: " + ", ".join(f"{b.key} = {b.port}" for b in ports)]


def listen_on(bound: BoundPort, holders: dict[int, str]) -> socket.socket | None:
    """A socket listening where the run will (None: a ZeroMQ interface name, which only ZeroMQ resolves)."""
    if not 0 < bound.port < 65536:  # getaddrinfo would wrap it round to another port
        raise ConfigError(f"config key '{bound.key}' = {bound.port}: must be in 0..65535 (0: any free port)")
    address = bind_address(bound)
    if address is None:
        return None
    family, where = address
    probe = socket.socket(family, socket.SOCK_STREAM)
    # as ZeroMQ, redis-server and the weight server bind: a port left in TIME_WAIT is free to them
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(where)
        probe.listen(1)
    except OSError as err:
        probe.close()
        raise ConfigError(port_error(bound, err, holders)) from None
    return probe


def bind_address(bound: BoundPort) -> tuple[int, tuple] | None:
    """(family, address) to bind, IPv4 first as ZeroMQ resolves; ConfigError for a host no lookup finds."""
    host = "" if bound.host in ANY_ADDRESS else bound.host
    try:
        found = socket.getaddrinfo(host or None, bound.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        if bound.host in {name for _, name in socket.if_nameindex()}:
            return None  # ZeroMQ binds an interface by name (tcp://eth0:5555)
        raise ConfigError(
            f"config key '{bound.host_key}' = {bound.host!r}: no such host or interface here, so "
            f"{bound.key} = {bound.port} cannot be bound on it"
        ) from None
    family, _, _, _, where = min(found, key=lambda info: info[0] != socket.AF_INET)
    return family, where


def port_error(bound: BoundPort, err: OSError, holders: dict[int, str]) -> str:
    """Why the port cannot be bound, naming the key to change."""
    head, code = f"config key '{bound.key}' = {bound.port}", err.errno
    if code == errno.EADDRINUSE and bound.port in holders:
        return f"{head}: {holders[bound.port]} binds the same port; choose another or 0 for any"
    if code == errno.EADDRINUSE:
        where = "every interface" if bound.host in ANY_ADDRESS else bound.host
        return f"{head}: the port is in use on {where} (another tidal run?); choose another or 0 for any"
    if code == errno.EADDRNOTAVAIL:
        return (
            f"config key '{bound.host_key}' = {bound.host!r}: not an address of this machine, so "
            f"{bound.key} = {bound.port} cannot be bound on it"
        )
    if code == errno.EACCES:
        return f"{head}: binding a port below 1024 needs privileges; choose another or 0 for any"
    return f"{head}: cannot bind {bound.host}:{bound.port} ({os.strerror(code) if code else err})"


def check_store(cfg: RunConfig, timeout_s: float = STORE_TIMEOUT_S) -> str:
    """The run's MLflow store (tracking.uri, else $MLFLOW_TRACKING_URI, else a sqlite file in run_dir):
    a server answers, a file can be written. The ConfigError names where the URI came from."""
    from tidal.mlflow_store import tracking_uri

    run_dir = Path(cfg.run_dir) if cfg.run_dir else Path("runs") / cfg.name  # resolve() adds a time to the name
    uri = tracking_uri(cfg.tracking, run_dir)
    if cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI"):
        source = "config key 'tracking.uri'" if cfg.tracking.uri else "$MLFLOW_TRACKING_URI"
        named, shown = f"{source} = {redact_uri(uri)!r}", redact_uri(uri)
    else:
        folder = cfg.run_dir or "runs/<name>-<time>"
        named, shown = f"config key 'run_dir' = {folder!r} (the MLflow store's folder)", f"{folder}/mlflow.db"
    if urlsplit(uri).scheme.lower() in ("http", "https"):
        return check_server(uri, named, timeout_s)
    folder = store_folder(uri)
    if folder is None:
        return f"MLflow store {shown}: not checked (only servers and files are)"
    check_writable(folder, named)
    return f"MLflow store {shown}: its folder can be written"


def store_folder(uri: str) -> Path | None:
    """The folder a file store writes: a sqlite file's, a file store's own; None for any other store."""
    from tidal.mlflow_store import sqlite_file

    scheme = urlsplit(uri).scheme.lower()
    if scheme == "sqlite":
        found = sqlite_file(uri)
        return None if found is None else found.parent  # sqlite:// alone is in memory
    if scheme == "file":
        return Path(unquote(urlsplit(uri).path))
    return Path(uri) if scheme == "" else None


def check_server(uri: str, named: str, timeout_s: float) -> str:
    """GET <uri>/health: no answer within `timeout_s`, or a 5xx, is a ConfigError. With requests, as
    MLflow's client: the same proxies, CA bundle and MLflow's TLS settings."""
    import requests

    health = health_url(uri)
    insecure = os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true"
    verify = False if insecure else os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or True
    try:
        answer = requests.get(health, timeout=timeout_s, verify=verify)
    except requests.RequestException as err:
        raise ConfigError(
            f"{named}: no MLflow server answered {health} within {timeout_s:g} s "
            f"({no_answer_reason(err)}); start it, or point tracking.uri at one that runs "
            "('' = a sqlite file in the run folder)"
        ) from None
    if answer.status_code >= 500:
        raise ConfigError(
            f"{named}: the MLflow server answered {health} with {answer.status_code} {answer.reason}: it is not serving"
        )
    return f"MLflow server {redact_uri(uri)}: answers ({answer.status_code} from /health)"


def health_url(uri: str) -> str:
    """<uri>/health, without credentials or query: a server under a path prefix serves it there too."""
    parts = urlsplit(uri)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path.rstrip('/')}/health"


NO_ANSWER = {
    "Connection refused": "connection refused",
    "Name or service not known": "no such host",
    "Temporary failure in name resolution": "no such host",
    "No route to host": "no route to host",
    "Network is unreachable": "network unreachable",
    "CERTIFICATE_VERIFY_FAILED": "its TLS certificate is not trusted; see MLFLOW_TRACKING_SERVER_CERT_PATH",
}


def no_answer_reason(err: Exception) -> str:
    """Why nothing answered, in words a user acts on (requests nests the socket's error in its text)."""
    import requests

    if isinstance(err, requests.Timeout):
        return "timed out"
    return next((reason for words, reason in NO_ANSWER.items() if words in str(err)), type(err).__name__)


def check_writable(folder: Path, named: str) -> None:
    """A file made and removed in `folder`, or in the nearest folder above it that exists (the run makes the
    rest): a permission check alone passes for root on a read-only file system."""
    existing = folder.resolve()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{named}: {existing} is a file, so the MLflow store's folder {folder} cannot be made")
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".tidal-check-"):
            pass
    except OSError as err:
        raise ConfigError(
            f"{named}: the MLflow store's folder cannot be written ({existing}: {err.strerror or err})"
        ) from None
