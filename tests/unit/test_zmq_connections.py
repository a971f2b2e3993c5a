"""The learner's ZeroMQ sockets keep at most broker.zmq.max_connections connections each: the newest beyond
it are shut down at once and counted, one that closes makes room, an actor already in keeps working through
a flood, strangers' big frames are held for the cap's connections only, and closing the learner still
takes a moment and leaves nothing behind."""

import asyncio
import os
import socket
import struct
import threading
import time

import psutil
import pytest
import zmq

from conftest import prompt_group as prompt
from conftest import rollout
from tidal.broker import zmq_transport
from tidal.broker.schema import Heartbeat, WeightUpdate, WireCodec
from tidal.broker.zmq_keys import generate, secure_client
from tidal.broker.zmq_transport import (
    SUBSCRIPTION_BYTES,
    SUBSCRIPTION_HWM,
    ZmqActorTransport,
    ZmqLearnerTransport,
    _Connections,
    buffer_bound_bytes,
    connection_cap,
    refuse_beyond_cap,
)
from tidal.config import BrokerConfig, ConfigError, ZmqConfig, load_config

SOCKETS = ("control", "rollout", "weights")
# the first bytes of a ZMTP 3 greeting for the NULL mechanism: what libzmq reads before the handshake
GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32


def learner(cap: int, **zmq_keys) -> ZmqLearnerTransport:
    cfg = BrokerConfig(max_actors=1, zmq=ZmqConfig(max_connections=cap, **zmq_keys))
    return ZmqLearnerTransport(cfg, WireCodec(1 << 20))


def until(condition, timeout_s: float = 120.0) -> bool:
    """Whether `condition` came true; it is polled until it does, the timeout only a guard against a hang (every
    use expects it to come true, and a loaded machine may take many seconds: a short deadline made these flaky)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def strangers(port: int, count: int) -> list[socket.socket]:
    """Plain TCP connections that send nothing: what a peer holds before its handshake (30 s at most)."""
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]


def shut_down(conn: socket.socket, wait_s: float) -> bool:
    """Whether the learner ended the connection within `wait_s` (its greeting may come first)."""
    conn.settimeout(wait_s)
    try:
        while conn.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


ESTABLISHED = 0x01


def tcp_queues(conn: socket.socket, port: int) -> tuple[int, int]:
    """The client end's TCP state and the bytes still in the kernel for this loopback connection: its send
    queue plus the learner end's receive queue (what libzmq has not yet read), from /proc/net/tcp."""
    mine, state, queued = conn.getsockname()[1], 0, 0
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            local, remote, st, queues = line.split()[1:5]
            ends = (int(local.split(":")[1], 16), int(remote.split(":")[1], 16))
            tx, rx = (int(q, 16) for q in queues.split(":"))
            if ends == (mine, port):
                state, queued = int(st, 16), queued + tx
            elif ends == (port, mine):
                queued += rx
    return state, queued


def refused(side: ZmqLearnerTransport) -> float:
    return side.metrics().get("broker/rejected/too_many_connections", 0)


@pytest.mark.parametrize("name", SOCKETS)
def test_connections_beyond_the_cap_are_shut_down_at_once_and_counted(name):
    side = learner(cap=3)
    conns = strangers(side.ports[name], 8)
    try:
        assert until(lambda: refused(side) == 5)
        assert [shut_down(c, 1.0) for c in conns[3:]] == [True] * 5  # the newest
        assert [shut_down(c, 0.1) for c in conns[:3]] == [False] * 3  # the first three stay
        assert side.connections() == {s: (3 if s == name else 0) for s in SOCKETS}
    finally:
        for c in conns:
            c.close()
        side.close()


def test_a_connection_that_closes_makes_room_for_a_new_one():
    side = learner(cap=2)
    port = side.ports["rollout"]
    first = strangers(port, 2)
    try:
        [third] = strangers(port, 1)
        assert shut_down(third, 1.0) and until(lambda: refused(side) == 1)
        first[0].close()
        assert until(lambda: side.connections()["rollout"] == 1)
        [fourth] = strangers(port, 1)
        assert not shut_down(fourth, 0.2) and side.connections()["rollout"] == 2 and refused(side) == 1
        fourth.close()
    finally:
        for c in first:
            c.close()
        side.close()


def from_machine(address: str, port: int) -> socket.socket:
    conn = socket.socket()
    conn.bind((address, 0))
    conn.connect(("127.0.0.1", port))
    return conn


def test_a_machine_hoarding_every_place_gives_one_to_another_machine_and_cannot_take_it_back():
    """Strangers from one machine held every place and retook each as it freed: an actor restarting on
    another machine got no grant in 40 s. Now a newcomer from a machine holding fewer takes the place of the
    hoarder's newest connection; the hoarder's next one is refused."""
    side = learner(cap=3)
    port = side.ports["control"]
    hoard = strangers(port, 3)  # from 127.0.0.1
    other = None
    try:
        assert until(lambda: side.connections()["control"] == 3)
        other = from_machine("127.0.0.2", port)
        assert until(lambda: refused(side) == 1)
        assert shut_down(hoard[2], 1.0)  # the hoarder's newest gave way
        assert not shut_down(other, 0.2) and [shut_down(c, 0.1) for c in hoard[:2]] == [False, False]
        [again] = strangers(port, 1)
        assert shut_down(again, 1.0) and until(lambda: refused(side) == 2)  # it cannot take the place back
        assert not shut_down(other, 0.2) and side.connections()["control"] == 3
        again.close()
    finally:
        for c in [*hoard, *([other] if other else [])]:
            c.close()
        side.close()


def hello(actor_id: str) -> Heartbeat:
    return Heartbeat(actor_id=actor_id, version=0, engine={}, outstanding=[], hello=True)


def test_an_actor_connected_before_a_flood_keeps_working(tmp_path):
    """With CURVE, as in every run: the flood takes the rest of each cap and is refused beyond it; the actor's
    work requests, rollouts and the weight announcements it hears all still go through."""
    keys = generate(tmp_path / "keys", ["actor-0"])
    curve = dict(curve="on", keys_dir=str(keys))
    side = learner(cap=2, **curve)
    side.submit_prompts([prompt(i) for i in range(2)])
    p = side.ports
    flood: list[socket.socket] = []

    async def scenario():
        cfg = BrokerConfig(
            zmq=ZmqConfig(control_port=p["control"], rollout_port=p["rollout"], weights_port=p["weights"], **curve)
        )
        t = ZmqActorTransport(cfg, WireCodec(1 << 20), "actor-0")
        try:
            await t.heartbeat(hello("actor-0"))
            assert until(lambda: side.connections() == dict.fromkeys(SOCKETS, 1))
            flood.extend(c for name in SOCKETS for c in strangers(p[name], 6))
            assert until(lambda: refused(side) == 3 * 5) and side.connections() == dict.fromkeys(SOCKETS, 2)
            groups = await t.request_work(8, timeout_s=2)
            for g in groups:
                await t.send_rollout(rollout(group_id=g.group_id, actor_id="actor-0"))
            side.publish_weights(WeightUpdate(version=4, transport="file", location="/w", manifest=[], checksum="c"))
            announced = await asyncio.wait_for(t.next_announcement(), 2)
            return [g.group_id for g in groups], announced.version
        finally:
            t.close()

    try:
        granted, version = asyncio.run(scenario())
        assert granted == ["r-0", "r-1"] and version == 4
        assert sorted(side.recv_rollout(timeout_s=2).group_id for _ in granted) == granted
    finally:
        for c in flood:
            c.close()
        side.close()


def test_strangers_streaming_big_frames_are_held_for_the_caps_connections_only():
    """Before its handshake a peer may send one frame of up to the socket's ZMQ_MAXMSGSIZE, which libzmq
    holds whole: ten strangers sending 16 MiB each to a cap of 2 leave the learner holding 32 MiB, not
    160 (the learner reads nothing; no handshake ever ends)."""
    frame = 16 << 20
    cfg = BrokerConfig(
        max_actors=1,
        max_message_bytes=frame,
        zmq=ZmqConfig(max_connections=2, rollout_buffer_bytes=frame, rollout_hwm=1),
    )
    side = ZmqLearnerTransport(cfg, WireCodec(frame))
    # a command frame, long form (flags, its size), and 15 MiB of it: libzmq holds it whole until it ends
    start = GREETING + struct.pack(">BQ", 0x06, frame) + b"z" * (15 << 20)
    rss_before = psutil.Process().memory_info().rss
    conns = strangers(side.ports["rollout"], 10)
    try:
        for c in conns:
            try:
                c.sendall(start)
            except (BrokenPipeError, ConnectionResetError):  # refused while it sent
                pass

        def held_mib() -> float:
            return (psutil.Process().memory_info().rss - rss_before) / 2**20

        # waited for until the learner has read every byte the two admitted sent: nothing queued in the kernel
        # on either side of a connection still open. (A lower bound on RSS is no such signal: in a process
        # that freed big blocks before, the allocator hands the frames memory already resident.)
        admitted = lambda: [c for c in conns if tcp_queues(c, side.ports["rollout"])[0] == ESTABLISHED]
        assert until(
            lambda: (
                refused(side) == 8
                and len(admitted()) == 2
                and all(tcp_queues(c, side.ports["rollout"])[1] == 0 for c in admitted())
            )
        )
        assert side.connections()["rollout"] == 2 and held_mib() < 2 * 16 + 8
    finally:
        for c in conns:
            c.close()
        side.close()


def test_the_bound_is_the_cap_times_what_one_connection_holds():
    cfg = BrokerConfig(
        max_actors=3,
        max_message_bytes=1 << 20,
        max_control_bytes=1 << 16,
        zmq=ZmqConfig(max_connections=5, rollout_hwm=4, rollout_buffer_bytes=64 << 20, control_hwm=2),
    )
    per_connection = (4 + 1) * (1 << 20) + (2 + 1) * (1 << 16) + (SUBSCRIPTION_HWM + 1) * SUBSCRIPTION_BYTES
    assert connection_cap(cfg) == 5 and buffer_bound_bytes(cfg) == 5 * per_connection
    assert connection_cap(BrokerConfig(max_actors=7)) == 14  # 0: twice the actors


@pytest.mark.parametrize(
    "setting, why",
    [
        ("broker.zmq.max_connections=-1", "must be >= 0"),
        ("broker.zmq.max_connections=8", "at least broker.max_actors = 1024"),
    ],
)
def test_a_cap_below_zero_or_below_the_actors_names_the_key(setting, why):
    with pytest.raises(ConfigError, match=f"broker.zmq.max_connections.*{why}"):
        load_config(None, [setting])


def test_a_handshake_that_fails_gives_its_place_back(tmp_path):
    keys = generate(tmp_path / "keys", ["actor-0"])
    stranger = generate(tmp_path / "elsewhere", ["actor-0"])
    (stranger / "learner.key").write_bytes((keys / "learner.key").read_bytes())
    side = learner(cap=1, curve="on", keys_dir=str(keys))
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RECONNECT_IVL, 60_000)  # one try
        secure_client(sock, str(stranger), "actor-0")  # the learner's public key, an unknown pair
        failed = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        sock.connect(f"tcp://127.0.0.1:{side.ports['control']}")
        assert failed.poll(120_000)  # the learner said no (at once; the guard only against a hang)
        assert until(lambda: side.connections()["control"] == 0)
        conns = strangers(side.ports["control"], 1)  # the place is free again
        assert not shut_down(conns[0], 0.2) and refused(side) == 0
        conns[0].close()
    finally:
        ctx.destroy(linger=0)
        side.close()


def fake_monitor(ctx: zmq.Context):
    """A socket whose monitor is a PAIR the test writes events to; and the function that writes one."""
    feed = ctx.socket(zmq.PAIR)
    feed.bind("inproc://events")

    class Monitored:
        def get_monitor_socket(self, events, addr):
            monitor = ctx.socket(zmq.PAIR)
            monitor.connect("inproc://events")
            return monitor

    def send(event: int, fd: int) -> None:
        feed.send_multipart([struct.pack("=HI", event, fd), b"tcp://127.0.0.1:1"])

    return Monitored(), send


@pytest.mark.parametrize("gone_before_shutdown", [False, True])
def test_a_refused_connection_whose_fd_number_is_reused_before_its_shutdown_is_left_alone(
    monkeypatch, gone_before_shutdown
):
    """Refused, then closed by libzmq and its number given to another file (here a socket pair standing in)
    before the shutdown: that file is never shut down. Without the race, the connection is."""
    ctx = zmq.Context()
    monitored, send = fake_monitor(ctx)
    table = _Connections("rollout", monitored, cap=1)
    (first, _), (newest, peer) = socket.socketpair(), socket.socketpair()
    real_dup = zmq_transport._dup

    def dup_as_it_closes(fd: int):
        if gone_before_shutdown:
            send(zmq.EVENT_DISCONNECTED, fd)  # reported gone: libzmq closed it, and the number went elsewhere
        return real_dup(fd)

    monkeypatch.setattr(zmq_transport, "_dup", dup_as_it_closes)
    try:
        send(zmq.EVENT_ACCEPTED, first.fileno())
        send(zmq.EVENT_ACCEPTED, newest.fileno())
        assert [t.name for t in refuse_beyond_cap([table])] == ["rollout"]  # counted either way
        assert shut_down(peer, 0.1) is not gone_before_shutdown
        assert table.admitted() == 1 and table.refused == (set() if gone_before_shutdown else {newest.fileno()})
    finally:
        ctx.destroy(linger=0)


def test_events_read_together_apply_in_order():
    """A refused connection gone and its number accepted again, all in one read: the new one is admitted
    (the old one's room is free) and nothing is shut down."""
    ctx = zmq.Context()
    monitored, send = fake_monitor(ctx)
    table = _Connections("control", monitored, cap=1)
    (first, _), (reused, peer) = socket.socketpair(), socket.socketpair()
    try:
        send(zmq.EVENT_ACCEPTED, first.fileno())
        send(zmq.EVENT_ACCEPTED, reused.fileno())
        send(zmq.EVENT_DISCONNECTED, reused.fileno())
        send(zmq.EVENT_DISCONNECTED, first.fileno())
        send(zmq.EVENT_ACCEPTED, reused.fileno())
        assert [t.name for t in refuse_beyond_cap([table])] == ["control"]
        assert not shut_down(peer, 0.1) and table.open == {reused.fileno(): 3} and table.admitted() == 1
    finally:
        ctx.destroy(linger=0)


def test_closing_the_learner_with_connections_open_takes_a_moment_and_leaves_nothing():
    fds_before = len(os.listdir("/proc/self/fd"))
    side = learner(cap=2)
    conns = [c for name in SOCKETS for c in strangers(side.ports[name], 4)]
    assert until(lambda: refused(side) == 3 * 2)
    start = time.monotonic()
    side.close()
    assert time.monotonic() - start < 1
    assert not any(t.name == "zmq-learner-io" for t in threading.enumerate())
    assert all(shut_down(c, 1.0) for c in conns)  # the learner's side of each is closed
    for c in conns:
        c.close()
    assert until(lambda: len(os.listdir("/proc/self/fd")) <= fds_before)


def test_a_strangers_frame_to_the_weights_port_is_cut_at_the_size_of_a_subscription():
    """The PUB socket reads only subscriptions: without a limit a stranger's first frame, before any
    handshake, could be of any size, all of it held."""
    side = learner(cap=4)
    [conn] = strangers(side.ports["weights"], 1)
    try:
        conn.sendall(GREETING + struct.pack(">BQ", 0x06, SUBSCRIPTION_BYTES + 1))
        assert shut_down(conn, 1.0) and refused(side) == 0
    finally:
        conn.close()
        side.close()


def test_a_peer_whose_host_is_gone_is_noticed_by_tcp_keepalive():
    """The learner never writes to a rollout connection: without keepalive one whose host died would keep
    its place under the cap for good."""
    side = learner(cap=4)
    [conn] = strangers(side.ports["rollout"], 1)
    try:
        assert until(lambda: side.connections()["rollout"] == 1)
        [fd] = side._conns[1].open
        ours = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)
        assert ours.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert ours.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == zmq_transport.KEEPALIVE_IDLE_S
        ours.close()
    finally:
        conn.close()
        side.close()


# ---- the open-file limit: a cap the process can hold ------------------------------------------------


def test_the_learner_raises_its_soft_open_file_limit_to_the_hard_one():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        side = ZmqLearnerTransport(BrokerConfig(max_actors=4), WireCodec(1 << 20))
        side.close()
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


LOW_LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
from tidal.broker.schema import WireCodec
from tidal.broker.zmq_transport import ZmqLearnerTransport, connection_cap
from tidal.config import BrokerConfig, ConfigError, ZmqConfig
explicit = BrokerConfig(max_actors=8, zmq=ZmqConfig(max_connections=2048))
for cfg in (BrokerConfig(), explicit, BrokerConfig(max_actors=64)):
    try:
        side = ZmqLearnerTransport(cfg, WireCodec(1 << 20))
    except ConfigError as err:
        print("refused:", err)
        continue
    print("cap:", side._cap)
    side.close()
"""


def test_under_a_hard_limit_of_1024_files_the_cap_fits_it_or_the_learner_refuses_naming_the_key():
    """At a limit of 1,024 and the cap of 2,048, 1,100 connections to one socket crashed the learner (EMFILE)
    in about 7 s. Now the default cap is what the limit holds, and a cap or a max_actors it cannot hold is
    refused before any socket opens."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LOW_LIMIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused: config key 'broker.max_actors' = 1024: 3 sockets x 1024 connections")
    assert "may open 1024" in lines[0]
    assert lines[1].startswith("refused: config key 'broker.zmq.max_connections' = 2048")
    assert lines[2] == "cap: 128"  # twice max_actors: it fits
    assert connection_cap(BrokerConfig(max_actors=1024), open_files=2048) == (2048 - 512) // 3
