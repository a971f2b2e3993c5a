"""The weight channels against peers that are not actors: every request to the learner's weight port
must carry the token announced over the broker, or it gets nothing and is closed; strangers hold no
thread and delay no honest actor; the accept loop outlives its failures; connections are capped;
the gloo channel's rendezvous keys have no port of their own; and every weight byte is checked
against a sha256 announced over the broker, so a rewritten weights file that keeps its crc32s is
refused, and what loads is what was checked."""

import asyncio
import errno
import json
import os
import socket
import threading
import time
import zlib

import msgspec
import pytest
import torch

from conftest import ScriptedEngine, served_weights, weights_config
from tidal.broker.weights import build_publisher, build_receiver, collective, gloo, server, tcp
from tidal.broker.weights.file import read_manifest


def wait_until(done, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done(), f"not done within {seconds} s"


def refusal(conn: socket.socket) -> tuple[int, str]:
    """(status, text) of the learner's reply on `conn`, which must then be closed by the learner."""
    conn.settimeout(10)
    magic, status, nbytes = server.REPLY.unpack(server.recv_exact(conn, server.REPLY.size))
    text = server.recv_exact(conn, nbytes).decode()
    try:
        closed = conn.recv(1) == b""  # nothing more
    except ConnectionResetError:
        closed = True  # closed with some of what was sent unread
    assert magic == server.MAGIC and closed
    return status, text


@pytest.fixture
def tcp_served():
    yield from served_weights("tcp")


@pytest.fixture
def gloo_served():
    yield from served_weights("gloo", tcp_timeout_s=1.0)


# ---- authentication --------------------------------------------------------------------------------


def test_a_tcp_request_without_the_token_gets_nothing_not_even_the_versions(tcp_served):
    publisher, update, _, tokenizer = tcp_served
    with socket.create_connection(server.parse_location(update.location)) as stranger:
        stranger.sendall(tcp.bucket_request(bytes(32), 3, 0))
        status, text = refusal(stranger)
    assert status == server.UNAUTHORIZED and "token" in text and "served" not in text and "3" not in text
    assert publisher.server.refused["unauthorized"] == 1
    forged = msgspec.structs.replace(update, token=bytes(32))  # an announcement that did not come from the broker
    # what an actor holding a restarted learner's old announcement gets too: a ConnectionError, which it
    # does not count toward giving up (the next announcement carries the new token)
    with pytest.raises(ConnectionError, match="does not carry this learner's weight token"):
        asyncio.run(build_receiver(weights_config("tcp")).apply(forged, ScriptedEngine(tokenizer)))
    with pytest.raises(ValueError, match="carries no token for the learner.s weight port \\(0 bytes"):
        asyncio.run(
            build_receiver(weights_config("tcp")).apply(
                msgspec.structs.replace(update, token=b""), ScriptedEngine(tokenizer)
            )
        )


def test_a_silent_stranger_is_closed_after_the_token_deadline_holding_no_thread(monkeypatch):
    monkeypatch.setattr(server, "AUTH_TIMEOUT_S", 0.2)
    served = served_weights("tcp")
    publisher, update, state, tokenizer = next(served)
    try:
        strangers = [socket.create_connection(server.parse_location(update.location)) for _ in range(20)]
        wait_until(lambda: len(publisher.server.pending) == 20)
        assert not publisher.server.handlers  # strangers wait in the accept loop, not on threads
        engine = ScriptedEngine(tokenizer)
        asyncio.run(build_receiver(weights_config("tcp")).apply(update, engine))  # an honest actor is served meanwhile
        assert engine.swaps == [3] and all(torch.equal(engine.loaded[k], v) for k, v in state.items())
        for stranger in strangers:
            stranger.settimeout(10)
            assert stranger.recv(1) == b""  # closed by the learner, having been sent nothing
            stranger.close()
        assert publisher.server.refused["no token in time"] == 20
    finally:
        served.close()


def test_a_flood_of_strangers_drops_the_oldest_waiting_and_an_honest_actor_is_served(tcp_served, monkeypatch):
    publisher, update, _, tokenizer = tcp_served
    monkeypatch.setattr(server, "MAX_PENDING", 4)
    strangers = [socket.create_connection(server.parse_location(update.location)) for _ in range(10)]
    wait_until(lambda: publisher.server.refused["too many waiting"] == 6)
    assert len(publisher.server.pending) == 4
    engine = ScriptedEngine(tokenizer)
    asyncio.run(build_receiver(weights_config("tcp")).apply(update, engine))
    assert engine.swaps == [3]
    for stranger in strangers:
        stranger.close()


def test_a_gloo_join_without_the_token_forms_no_group_and_learns_nothing(gloo_served):
    publisher, update, _, _ = gloo_served
    with socket.create_connection(server.parse_location(update.location)) as stranger:
        stranger.sendall(collective.control(bytes(32), collective.JOIN, 1))
        status, text = refusal(stranger)
    assert status == server.UNAUTHORIZED and "token" in text
    assert not publisher.plane.stores and not publisher.server.groups


# ---- the gloo channel's rendezvous -----------------------------------------------------------------


def listening_addresses() -> set[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: listening
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word host-ordered
                found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def test_the_rendezvous_has_no_port_and_nothing_listens_beyond_weights_tcp_host(monkeypatch):
    """No torch TCPStore (which listens on every interface and takes anyone's keys) is made: the
    group's keys live in the learner and the workers reach them through the weight port with the
    token; the learner's gloo listens on weights.tcp_host (127.0.0.1) alone."""

    def no_store(*args, **kwargs):
        raise AssertionError("a TCPStore was made")

    monkeypatch.setattr(torch.distributed, "TCPStore", no_store)
    before = listening_addresses()
    served = served_weights("gloo", tcp_timeout_s=2.0)
    publisher, update, state, tokenizer = next(served)
    try:
        engine = ScriptedEngine(tokenizer)
        asyncio.run(build_receiver(weights_config("gloo", tcp_timeout_s=2.0)).apply(update, engine))
        assert engine.swaps == [3] and all(torch.equal(engine.loaded[k], state[k]) for k in engine.loaded)
        opened = listening_addresses() - before
        assert opened and {address for address, _ in opened} <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, opened
    finally:
        served.close()


def store_request(token: bytes, group_id: int, op: int, key: bytes, value: bytes) -> bytes:
    return (
        collective.control(token, collective.STORE, group_id)
        + gloo.STORE_OP.pack(op, len(key), len(value))
        + key
        + value
    )


def test_a_stranger_stores_nothing_and_a_token_holders_keys_are_bounded(gloo_served):
    publisher, update, _, tokenizer = gloo_served
    receiver, engine = build_receiver(weights_config("gloo", tcp_timeout_s=1.0)), ScriptedEngine(tokenizer)
    asyncio.run(receiver.apply(update, engine))  # joined: its group, and the group's keys, live on
    ((group_id, store),) = publisher.plane.stores.items()
    address, written = server.parse_location(update.location), store.nbytes  # the worker's gloo address
    with socket.create_connection(address) as stranger:  # says it sends 60 KiB; the learner reads none of it
        stranger.sendall(store_request(bytes(32), group_id, gloo.SET, b"junk", b"x" * 1000)[:200])
        assert refusal(stranger)[0] == server.UNAUTHORIZED
    assert not store.store.check(["junk"]) and store.nbytes == written

    def holder_sets(key: bytes, nbytes: int) -> bytes:
        with socket.create_connection(address) as conn:
            conn.sendall(store_request(update.token, group_id, gloo.SET, key, b"v" * nbytes))
            return server.read_reply(conn, "set")

    assert holder_sets(b"a", 100) == b"" and store.store.get("a") == b"v" * 100
    with pytest.raises(ValueError, match="a 65537-byte value"):
        holder_sets(b"b", gloo.MAX_VALUE_BYTES + 1)
    with pytest.raises(ValueError, match="more than 1048576 bytes: refused"):
        for i in range(gloo.MAX_STORE_BYTES // gloo.MAX_VALUE_BYTES + 1):
            holder_sets(f"k{i}".encode(), gloo.MAX_VALUE_BYTES)
    assert store.nbytes <= gloo.MAX_STORE_BYTES


def test_three_abandoned_joins_do_not_make_an_honest_workers_receive_time_out(gloo_served):
    """Three token holders JOIN and never form their groups: each is served on its own thread and its
    rendezvous keys are its own, so an honest actor joining meanwhile forms its group and receives."""
    publisher, update, state, tokenizer = gloo_served
    abandoned = []
    for _ in range(3):
        conn = socket.create_connection(server.parse_location(update.location))
        conn.sendall(collective.control(update.token, collective.JOIN, 1))
        json.loads(server.read_reply(conn, "join"))  # the spec: the learner now waits for the group to form
        abandoned.append(conn)
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(weights_config("gloo", tcp_timeout_s=1.0))
    asyncio.run(receiver.apply(update, engine))
    assert engine.swaps == [3] and all(torch.equal(engine.loaded[k], state[k]) for k in engine.loaded)
    wait_until(lambda: len(publisher.plane.stores) == 1)  # the abandoned groups' keys went with them
    for conn in abandoned:
        conn.close()


# ---- capped threads, an accept loop that survives ----------------------------------------------------


def test_connections_beyond_the_cap_are_refused_at_once_and_served_once_one_ends():
    served = served_weights("tcp", max_connections=2)
    publisher, update, _, tokenizer = next(served)
    try:
        address = server.parse_location(update.location)
        held = []
        for _ in range(2):  # two actors mid-fetch: each holds a thread
            conn = socket.create_connection(address)
            conn.sendall(tcp.bucket_request(update.token, 3, 0))
            server.read_reply(conn, "bucket 0", max_bytes=1 << 20)
            held.append(conn)
        with socket.create_connection(address) as third:
            third.sendall(tcp.bucket_request(update.token, 3, 0))
            status, text = refusal(third)
        assert status == server.BUSY and "serves 2 weight connections already" in text
        with pytest.raises(ConnectionError, match="serves 2 weight connections already"):  # later, not a failure
            asyncio.run(build_receiver(weights_config("tcp")).apply(update, ScriptedEngine(tokenizer)))
        held.pop().close()
        wait_until(lambda: len(publisher.server.handlers) == 1)
        engine = ScriptedEngine(tokenizer)
        asyncio.run(build_receiver(weights_config("tcp")).apply(update, engine))
        assert engine.swaps == [3]
        held.pop().close()
    finally:
        served.close()


def answer(conn: socket.socket) -> int:
    """The status of the learner's reply on `conn`, its body read and dropped."""
    conn.settimeout(10)
    magic, status, nbytes = server.REPLY.unpack(server.recv_exact(conn, server.REPLY.size))
    server.recv_exact(conn, nbytes)
    return status


def connect_from(host: str, address: tuple[str, int]) -> socket.socket:
    """A connection to `address` from the loopback address `host`: another machine, as the server sees it."""
    return socket.create_connection(address, source_address=(host, 0))


@pytest.mark.parametrize("transport", ["tcp", "gloo"])
def test_one_machine_holding_every_slot_gives_way_to_another_and_cannot_take_it_back(transport):
    """Every actor holds the token: one that opens every slot and idles in them (tcp: renewing each
    before its timeout; gloo: a FETCH without a JOIN, then nothing) used to keep every other actor from
    its weights. Now a newcomer from a machine holding fewer takes an idle one's slot, and the holder
    retaking it is told it is busy."""
    served = served_weights(transport, max_connections=4)
    publisher, update, _, tokenizer = next(served)
    token, address = update.token, server.parse_location(update.location)
    if transport == "tcp":
        opening = tcp.bucket_request(token, 3, 0)
    else:
        opening = collective.CONTROL.pack(publisher.server.magic, token, collective.FETCH, 3)
    try:
        hoard = []
        for _ in range(4):  # one request each, then idle
            conn = connect_from("127.0.0.1", address)
            conn.sendall(opening)
            assert answer(conn) != server.BUSY
            hoard.append(conn)
        wait_until(lambda: len(publisher.server.idle) == 4)
        with connect_from("127.0.0.1", address) as again:  # the hoarder asks for a fifth
            again.sendall(opening)
            assert refusal(again)[0] == server.BUSY
        honest = connect_from("127.0.0.2", address)
        honest.sendall(opening)
        assert answer(honest) != server.BUSY  # served (gloo: told to join first), not refused
        assert publisher.server.evicted == 1
        assert sorted(publisher.server.connections.values()) == ["127.0.0.1"] * 3 + ["127.0.0.2"]
        wait_until(lambda: len(publisher.server.idle) == 4)
        with connect_from("127.0.0.1", address) as retake:  # 3 against 1: the hoarder may not take it back
            retake.sendall(opening)
            assert refusal(retake)[0] == server.BUSY
        assert publisher.server.evicted == 1
        honest.close()
        for conn in hoard:
            conn.close()
    finally:
        served.close()


def test_the_accept_loop_survives_no_descriptor_and_no_thread_left(tcp_served, monkeypatch, caplog):
    publisher, update, _, tokenizer = tcp_served
    weight_server, failures = publisher.server, []
    take = weight_server._take_connection

    def no_descriptor():  # the process is at its limit of open files, once
        if not failures:
            failures.append("EMFILE")
            raise OSError(errno.EMFILE, "Too many open files")
        return take()

    monkeypatch.setattr(weight_server, "_take_connection", no_descriptor)
    engine, receiver = ScriptedEngine(tokenizer), build_receiver(weights_config("tcp"))
    asyncio.run(receiver.apply(update, engine))  # taken on the next turn of the loop
    assert engine.swaps == [3]

    start = threading.Thread.start

    def no_thread(thread):  # the process is at its limit of threads, once
        if thread.name == "tidal-weight-send" and len(failures) == 1:
            failures.append("no thread")
            raise RuntimeError("can't start new thread")
        return start(thread)

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    moved = publisher.publish({k: v + 1 for k, v in engine.loaded.items()}, version=4)
    with pytest.raises(ConnectionError, match="weights v4"):
        asyncio.run(receiver.apply(moved, engine))
    asyncio.run(receiver.apply(moved, engine))  # the loop lives on and serves the retry
    assert engine.swaps == [3, 4] and failures == ["EMFILE", "no thread"]
    assert weight_server.accept_errors == 2 and weight_server.thread.is_alive()
    assert "Too many open files" in caplog.text and "can't start new thread" in caplog.text


# ---- integrity: sha256 per range, announced over the broker ------------------------------------------


def solve_gf2(columns: list[int], target: int) -> int:
    """x with XOR of columns[i] where bit i of x is set == target (32 independent 32-bit columns)."""
    rows = [(column, 1 << i) for i, column in enumerate(columns)]
    basis: dict[int, tuple[int, int]] = {}  # leading bit -> (value, combination)
    for value, combination in rows:
        for bit in sorted(basis, reverse=True):
            if value >> bit & 1:
                value, combination = value ^ basis[bit][0], combination ^ basis[bit][1]
        if value:
            basis[value.bit_length() - 1] = (value, combination)
    x = 0
    for bit in sorted(basis, reverse=True):
        if target >> bit & 1:
            target, x = target ^ basis[bit][0], x ^ basis[bit][1]
    assert target == 0
    return x


def alter_keeping_crc32(data: bytearray, change_at: int, fix_at: int) -> None:
    """Flip the byte at `change_at` and rewrite the 4 bytes at `fix_at` so that zlib.crc32(data) is
    what it was: crc32 is affine in its input, so 32 free bits cancel any change."""
    kept, original = zlib.crc32(data), data[change_at]
    data[change_at] ^= 0xFF
    altered = zlib.crc32(data)
    columns = []
    for bit in range(32):
        data[fix_at + bit // 8] ^= 1 << bit % 8
        columns.append(zlib.crc32(data) ^ altered)
        data[fix_at + bit // 8] ^= 1 << bit % 8
    x = solve_gf2(columns, altered ^ kept)
    for bit in range(32):
        if x >> bit & 1:
            data[fix_at + bit // 8] ^= 1 << bit % 8
    assert zlib.crc32(data) == kept and data[change_at] != original


@pytest.fixture
def published_file(tmp_path):
    from conftest import ALPHABET, TINY
    from tidal.tiny import build_tiny_model

    model, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    cfg = weights_config("file", dir=str(tmp_path / "weights"), bucket_mib=1)
    publisher = build_publisher(cfg, "inc", "run", str(tmp_path))
    publisher.bucket_bytes = 4096  # several ranges even for the tiny model
    return cfg, publisher.publish(model.state_dict(), version=3), model.state_dict(), tokenizer


def test_a_weights_file_rewritten_with_every_ranges_crc32_kept_is_refused(published_file):
    """A writer of weights.dir alters a weight in each of three ranges and rewrites 4 bytes of each so
    that every range's crc32 still matches: the sha256 announced over the broker refuses the file."""
    cfg, update, _, tokenizer = published_file
    assert all(len(b.sha256) == 32 for b in update.buckets) and not hasattr(update.buckets[0], "crc32")
    original = open(update.location, "rb").read()
    data = bytearray(original)
    data_start = min(spec.offset for spec in read_manifest(update.location))
    ranges = [b for b in update.buckets if b.offset >= data_start][-3:]
    for bucket in ranges:  # inside tensor bytes: the file still parses as safetensors
        alter_keeping_crc32(data, bucket.offset + 100, bucket.offset + 200)
    assert data != original
    assert all(
        zlib.crc32(data[b.offset : b.offset + b.nbytes]) == zlib.crc32(original[b.offset : b.offset + b.nbytes])
        for b in update.buckets
    )  # the check the file channel made before: passed
    with open(update.location, "r+b") as f:
        f.write(data)
    engine = ScriptedEngine(tokenizer)
    first = update.buckets.index(ranges[0])
    with pytest.raises(ValueError, match=rf"\(range {first}\) have sha256 .* altered or damaged, refused"):
        asyncio.run(build_receiver(cfg).apply(update, engine))
    assert engine.swaps == []


def test_a_weights_file_rewritten_after_its_check_changes_nothing_loaded(published_file):
    """The actor checks its own copy of the file and its workers load that copy: a writer who swaps the
    file between the check and the load changes nothing the engine takes."""
    cfg, update, state, tokenizer = published_file
    engine = ScriptedEngine(tokenizer)
    transfer = engine.transfer_weights

    async def swapped_meanwhile(version, info, streaming=False):
        data = bytearray(open(update.location, "rb").read())
        data[-64:] = bytes(64)
        with open(update.location, "r+b") as f:
            f.write(data)
        return await transfer(version, info, streaming)

    engine.transfer_weights = swapped_meanwhile
    asyncio.run(build_receiver(cfg).apply(update, engine))
    assert engine.swaps == [3] and all(torch.equal(engine.loaded[k], v) for k, v in state.items())


# ---- the run's own folder: made by the learner, never another user's ----------------------------------

NOBODY = 65534


def own_default_folder(tmp_path, name: str = "run"):
    """weights.dir as a run resolves it when empty (its own folder in /dev/shm), and its config."""
    from tidal.config import default_weights_dir

    run_dir = tmp_path / name
    return weights_config("file", dir=default_weights_dir("tidal", run_dir)), run_dir


def test_the_runs_own_weights_folder_is_0700_and_a_link_planted_in_a_folder_is_not_written_through(tmp_path):
    """Writes went through `weights-vNNNNNN.tmp` with a plain open, which follows a link: one planted
    there made the learner overwrite a file its planter could not write. Now the link is replaced."""
    from conftest import ALPHABET, TINY
    from tidal.tiny import build_tiny_model

    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    cfg, run_dir = own_default_folder(tmp_path)
    publisher = build_publisher(cfg, "inc", "tidal", str(run_dir))
    try:
        folder = publisher.directory
        assert oct(folder.stat().st_mode & 0o777) == "0o700"
        target = tmp_path / "not-the-learners.txt"
        target.write_text("kept")
        (folder / "weights-v000000.tmp").symlink_to(target)
        publisher.publish(model.state_dict(), version=0)
        assert target.read_text() == "kept" and not (folder / "weights-v000000.tmp").exists()
    finally:
        publisher.close()


def test_a_folder_of_this_users_left_by_a_crash_is_taken_back_private(tmp_path):
    cfg, run_dir = own_default_folder(tmp_path, "crashed")
    os.makedirs(cfg.dir, mode=0o755, exist_ok=True)
    os.chmod(cfg.dir, 0o755)
    publisher = build_publisher(cfg, "inc", "tidal", str(run_dir))
    try:
        assert oct(publisher.directory.stat().st_mode & 0o777) == "0o700"
    finally:
        publisher.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user's needs root")
def test_the_runs_weights_folder_made_first_by_another_user_is_refused(tmp_path):
    """Its name follows from the run folder's: `nobody` made it (0777) and read every version."""
    from tidal.broker.weights.file import ForeignFolder

    cfg, run_dir = own_default_folder(tmp_path, "squatted")
    os.makedirs(cfg.dir, exist_ok=True)
    os.chown(cfg.dir, NOBODY, NOBODY)
    os.chmod(cfg.dir, 0o777)
    try:
        with pytest.raises(ForeignFolder, match=f"uid {NOBODY}"):
            build_publisher(cfg, "inc", "tidal", str(run_dir))
    finally:
        os.rmdir(cfg.dir)
