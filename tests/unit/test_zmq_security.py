"""The ZeroMQ broker's security: key files only their owner reads, actor ids that stay inside the keys
folder, `tidal run`'s own keys, routing ids no key holder can take from an actor, and tables and logs
that a peer repeating itself cannot grow."""

import asyncio
import logging
import os
import stat
import time

import pytest
import zmq

from conftest import prompt_group as prompt
from conftest import rollout
from tidal.broker.base import OUTSTANDING_KEPT
from tidal.broker.grants import GrantTable
from tidal.broker.schema import Heartbeat, WireCodec, WorkRequest
from tidal.broker.zmq_keys import check_actor_id, generate, secure_client
from tidal.broker.zmq_transport import ZmqActorTransport, ZmqLearnerTransport
from tidal.config import ActorConfig, BrokerConfig, ConfigError, RunConfig, ZmqConfig, curve_on, load_config
from tidal.ops.launcher import with_run_keys


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---- key files -------------------------------------------------------------------------------------


def test_secret_keys_are_0600_in_0700_folders_even_under_a_loose_umask(tmp_path):
    old = os.umask(0o022)  # the usual umask: files 0644, folders 0755 unless told otherwise
    try:
        keys = generate(tmp_path / "keys", ["actor-0"])
    finally:
        os.umask(old)
    assert mode(keys) == 0o700 and mode(keys / "actors") == 0o700
    for path in [*keys.glob("*.key*"), *(keys / "actors").glob("*.key*")]:
        assert mode(path) == 0o600, path


def test_keys_made_before_are_tightened(tmp_path):
    keys = generate(tmp_path / "keys", ["actor-0"])
    (keys / "actors" / "actor-0.key_secret").chmod(0o644)
    keys.chmod(0o755)
    generate(keys, ["actor-0", "actor-1"])
    assert mode(keys) == 0o700 and mode(keys / "actors" / "actor-0.key_secret") == 0o600


def test_keys_that_cannot_be_changed_are_used_as_they_are(tmp_path, monkeypatch, caplog):
    """A mounted keys folder (read-only, perhaps another user's): private keys are read without a chmod;
    loose ones give a warning naming the file, not a crash."""
    keys = generate(tmp_path / "keys", ["actor-0"])
    (keys / "actors" / "actor-0.key").chmod(0o400)

    def refused(path, mode):
        raise PermissionError(f"read-only file system: {path}")

    monkeypatch.setattr(os, "chmod", refused)
    assert generate(keys, ["actor-0"]) == keys  # nothing to change, nothing changed
    monkeypatch.undo()
    (keys / "learner.key").chmod(0o644)
    monkeypatch.setattr(os, "chmod", refused)
    with caplog.at_level(logging.WARNING, logger="tidal.broker.zmq_keys"):
        generate(keys, ["actor-0"])
    assert [r.getMessage().split(" is ")[0] for r in caplog.records] == [str(keys / "learner.key")]


NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user's needs root")


@needs_root
def test_a_keys_folder_another_user_made_first_is_refused_and_nothing_is_written(tmp_path, capsys):
    """`nobody` made shared/actors (0777) first: tightening its mode left it theirs, and a key they added
    there was granted work. Now `tidal keys` and `tidal run` refuse the folder, naming its owner."""
    from tidal.ops.cli import main

    (tmp_path / "shared" / "actors").mkdir(parents=True)
    for folder in (tmp_path / "shared", tmp_path / "shared" / "actors"):
        os.chown(folder, NOBODY, NOBODY)
        folder.chmod(0o777)
    assert main(["keys", str(tmp_path / "shared"), "--actors", "actor-0"]) == 2
    assert f"belongs to uid {NOBODY}" in capsys.readouterr().err
    assert not any((tmp_path / "shared").rglob("*.key*"))
    run = tmp_path / "run"
    (run / "keys").mkdir(parents=True)
    os.chown(run / "keys", NOBODY, NOBODY)
    with pytest.raises(Exception, match=f"belongs to uid {NOBODY}"):
        with_run_keys(RunConfig(run_dir=str(run)))


@needs_root
def test_the_learner_trusts_no_key_file_of_another_user(tmp_path):
    keys = generate(tmp_path / "keys", ["actor-0"])
    evil = generate(tmp_path / "evil", ["evil"])
    planted = keys / "actors" / "evil.key"
    planted.write_bytes((evil / "actors" / "evil.key").read_bytes())
    os.chown(planted, NOBODY, NOBODY)
    side = ZmqLearnerTransport(BrokerConfig(zmq=ZmqConfig(curve="on", keys_dir=str(keys))), WireCodec(1 << 20))
    side.submit_prompts([prompt(0)])

    try:
        (evil / "learner.key").write_bytes((keys / "learner.key").read_bytes())
        # a grant comes within milliseconds to a trusted key
        assert asyncio.run(ask_for_work(side, "evil", 1, curve="on", keys_dir=str(evil))) == []
        granted = asyncio.run(ask_for_work(side, "actor-0", 30, curve="on", keys_dir=str(keys)))
        assert [g.group_id for g in granted] == ["r-0"]
    finally:
        side.close()


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "x" * 129, ".hidden", "/abs"])
def test_an_actor_id_that_could_leave_the_keys_folder_is_refused_before_anything_is_written(tmp_path, bad):
    with pytest.raises(ValueError, match="actor id .* is not valid"):
        generate(tmp_path / "keys", ["actor-0", bad])
    assert not (tmp_path / "keys").exists() and not (tmp_path / "x.key_secret").exists()
    with pytest.raises(ValueError, match="is not valid"):
        check_actor_id(bad)


# ---- CURVE on in a run, and what `auto` means --------------------------------------------------------


def test_tidal_run_turns_curve_on_with_keys_of_its_own(tmp_path):
    z = with_run_keys(RunConfig(run_dir=str(tmp_path / "run"), actor=ActorConfig(replicas=2))).broker.zmq
    keys = tmp_path / "run" / "keys"
    assert (z.curve, z.keys_dir) == ("on", str(keys)) and curve_on(z)
    assert mode(keys) == 0o700 and mode(keys / "learner.key_secret") == 0o600
    assert sorted(p.name for p in (keys / "actors").glob("*.key_secret")) == [
        "actor-0.key_secret",
        "actor-1.key_secret",
    ]


def test_auto_is_on_where_keys_are_named_or_the_host_is_beyond_loopback():
    assert not curve_on(ZmqConfig())  # a role started alone on loopback without keys (tests)
    assert curve_on(ZmqConfig(keys_dir="/k")) and curve_on(ZmqConfig(host="0.0.0.0"))
    assert not curve_on(ZmqConfig(curve="off", keys_dir="/k"))


def test_a_role_started_alone_on_loopback_authenticates_with_its_runs_own_keys(tmp_path):
    """A learner started on its own on loopback with no keys trusted anyone who reached its ports as any
    actor. Now it makes the run's own keys; an actor given the run folder takes its own from there and is
    granted work; a peer without a key of the run gets nothing."""
    from tidal.learner.main import with_own_keys
    from tidal.ops.cli import _own_keys

    run = tmp_path / "run"
    learner_cfg = with_own_keys(RunConfig(run_dir=str(run), actor=ActorConfig(replicas=2)))
    z = learner_cfg.broker.zmq
    assert (z.curve, z.keys_dir) == ("on", str(run / "keys")) and mode(run / "keys") == 0o700
    with pytest.raises(ConfigError, match="broker.zmq.keys_dir.*set run_dir to the learner's run folder"):
        _own_keys(RunConfig(), "actor")  # where are the run's keys? one line says what to set
    with pytest.raises(ConfigError, match="holds no actors/actor-7.key_secret"):
        _own_keys(RunConfig(run_dir=str(run), actor=ActorConfig(index=7)), "actor")
    actor_z = _own_keys(RunConfig(run_dir=str(run), actor=ActorConfig(index=1)), "actor").broker.zmq
    assert (actor_z.curve, actor_z.keys_dir) == ("on", str(run / "keys"))
    for left in (ZmqConfig(curve="off"), ZmqConfig(keys_dir="/k"), ZmqConfig(host="0.0.0.0")):
        assert (
            with_own_keys(RunConfig(run_dir=str(tmp_path / "other"), broker=BrokerConfig(zmq=left))).broker.zmq == left
        )
    assert not (tmp_path / "other" / "keys").exists()

    side = ZmqLearnerTransport(BrokerConfig(zmq=z), WireCodec(1 << 20))
    side.submit_prompts([prompt(0)])

    try:
        # no key: a grant would come in milliseconds
        assert asyncio.run(ask_for_work(side, "actor-1", 1, curve="off")) == []
        granted = asyncio.run(ask_for_work(side, "actor-1", 30, curve=actor_z.curve, keys_dir=actor_z.keys_dir))
        assert [g.group_id for g in granted] == ["r-0"]
    finally:
        side.close()


def test_a_learner_with_curve_on_and_no_keys_folder_names_the_key():
    with pytest.raises(RuntimeError) as err:
        ZmqLearnerTransport(BrokerConfig(zmq=ZmqConfig(curve="on")), WireCodec(4096))
    assert "broker.zmq.keys_dir is empty but CURVE is on" in str(err.value.__cause__)


@pytest.mark.parametrize("role", ["learner", "actor"])
def test_a_role_started_alone_with_curve_on_and_no_keys_is_one_line_naming_the_key(role, capsys):
    from tidal.ops.cli import main

    assert main([role, "configs/tiny.yaml", "broker.zmq.curve=on"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tidal {role}: broker.zmq.keys_dir is empty but CURVE is on") and err.count("\n") == 1


# ---- identity: a routing id belongs to its key -------------------------------------------------------


def hello(actor_id: str) -> Heartbeat:
    return Heartbeat(actor_id=actor_id, version=0, engine={}, outstanding=[], hello=True)


def actor_config(side, **zmq_keys) -> BrokerConfig:
    p = side.ports
    return BrokerConfig(
        zmq=ZmqConfig(control_port=p["control"], rollout_port=p["rollout"], weights_port=p["weights"], **zmq_keys)
    )


async def ask_for_work(side, actor_id: str, timeout_s: float, **zmq_keys) -> list:
    """What `side` grants an actor connecting with these ZeroMQ settings: a hello, then one work request,
    which returns as soon as a grant comes."""
    t = ZmqActorTransport(actor_config(side, **zmq_keys), WireCodec(1 << 20), actor_id)
    try:
        await t.heartbeat(hello(actor_id))
        return await t.request_work(8, timeout_s=timeout_s)
    finally:
        t.close()


def test_a_key_holder_claiming_another_actors_routing_id_neither_gets_in_nor_locks_the_owner_out(tmp_path):
    keys = generate(tmp_path / "keys", ["actor-0", "actor-1"])
    curve = dict(curve="on", keys_dir=str(keys))
    side = ZmqLearnerTransport(BrokerConfig(zmq=ZmqConfig(**curve)), WireCodec(1 << 20))
    side.submit_prompts([prompt(i) for i in range(2)])
    codec, ctx = WireCodec(1 << 20), zmq.Context()
    squatters = []
    for identity in (b"actor-0", b"actor-0/0", b"actor-0/" + b"0" * 32):  # actor-1's key, actor-0's routing ids
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, str(keys), "actor-1")
        sock.connect(f"tcp://127.0.0.1:{side.ports['control']}")
        sock.send(codec.encode(hello("actor-0")))
        sock.send(codec.encode(WorkRequest(actor_id="actor-0", max_samples=100)))
        squatters.append(sock)
    time.sleep(0.3)  # the squatters are connected first

    async def owner():
        t = ZmqActorTransport(actor_config(side, **curve), WireCodec(1 << 20), "actor-0")
        await t.heartbeat(hello("actor-0"))
        groups = await t.request_work(8, timeout_s=5)
        t.close()
        return groups

    try:
        assert [g.group_id for g in asyncio.run(owner())] == ["r-0", "r-1"]
        assert not any(sock.poll(0) for sock in squatters)  # none of them was granted anything
        m = side.metrics()
        assert m["broker/rejected/impersonation"] == 6 and m["broker/live_actors"] == 1
    finally:
        ctx.destroy(linger=0)
        side.close()


def test_an_actor_whose_key_is_added_during_the_run_joins_and_a_strangers_key_does_not(tmp_path):
    """`tidal keys <run>/keys --actors actor-2` while the learner runs lets actor-2 in without a restart;
    a key pair made elsewhere is refused."""
    keys = generate(tmp_path / "keys", ["actor-0"])
    side = ZmqLearnerTransport(BrokerConfig(zmq=ZmqConfig(curve="on", keys_dir=str(keys))), WireCodec(1 << 20))
    side.submit_prompts([prompt(0)])
    stranger = generate(tmp_path / "elsewhere", ["actor-2"])
    generate(keys, ["actor-2"])

    async def ask(keys_dir, timeout_s: float):
        t = ZmqActorTransport(actor_config(side, curve="on", keys_dir=str(keys_dir)), WireCodec(1 << 20), "actor-2")
        try:
            await t.heartbeat(hello("actor-2"))
            return await t.request_work(8, timeout_s=timeout_s)
        finally:
            t.close()

    try:
        # a grant comes within milliseconds once the handshake is through: a second without one is a refusal
        assert asyncio.run(ask(stranger, 1)) == []  # its server key is not the learner's either: no handshake
        (stranger / "learner.key").write_bytes((keys / "learner.key").read_bytes())
        assert asyncio.run(ask(stranger, 1)) == []  # the learner's public key, but its own unknown pair
        assert [g.group_id for g in asyncio.run(ask(keys, 5))] == ["r-0"]
    finally:
        side.close()


# ---- bytes: hellos and heartbeats kept and logged only on change ---------------------------------------

BIG_ENGINE = {f"k{i:02d}": "v" * 1024 for i in range(32)}  # the most the wire lets an engine description hold


def test_a_32_kib_hello_repeated_does_not_grow_the_log(caplog):
    grants = GrantTable(actor_timeout_s=10)
    caplog.set_level(logging.INFO, logger="tidal.broker")
    for _ in range(500):  # at the control rate, a tenth of a second of one peer's hellos
        grants.on_heartbeat(Heartbeat(actor_id="a", version=0, engine=BIG_ENGINE, outstanding=[], hello=True))
    logged = sum(len(r.getMessage()) for r in caplog.records)
    assert 0 < logged < 1024  # one line, its engine cut short (500 lines of 32 KiB were 16 MiB)
    assert len(grants.take_joins()) == 1


def test_hellos_alternating_two_engines_are_logged_at_most_once_per_interval(caplog):
    grants = GrantTable(actor_timeout_s=10)
    caplog.set_level(logging.INFO, logger="tidal.broker")
    for i in range(200):
        grants.on_heartbeat(Heartbeat(actor_id="a", version=0, engine={"pid": str(i % 2)}, outstanding=[], hello=True))
    assert len([r for r in caplog.records if "joined" in r.getMessage()]) == 1


def test_heartbeats_keep_one_engine_copy_and_a_bounded_outstanding_list():
    grants = GrantTable(actor_timeout_s=10)
    many = [f"r-{i}" for i in range(10_000)]
    grants.on_heartbeat(Heartbeat(actor_id="a", version=0, engine=dict(BIG_ENGINE), outstanding=many, hello=True))
    first = grants.actors["a"].engine
    grants.on_heartbeat(Heartbeat(actor_id="a", version=1, engine=dict(BIG_ENGINE), outstanding=many))
    info = grants.actors["a"]
    assert info.engine is first and info.version == 1 and len(info.outstanding) == OUTSTANDING_KEPT


def test_many_connections_of_one_actor_share_one_rate_budget_and_one_parked_request_each():
    side = ZmqLearnerTransport(BrokerConfig(), WireCodec(1 << 20))
    side._control.rate.rate = 5.0  # bursts of 10, for the one id all these connections claim
    codec, ctx = WireCodec(1 << 20), zmq.Context()
    try:
        conns = []
        for i in range(4):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"a/conn-{i}".encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{side.ports['control']}")
            conns.append(sock)
        for sock in conns:
            for _ in range(10):
                sock.send(codec.encode(WorkRequest(actor_id="a", max_samples=1)))
        deadline = time.monotonic() + 5
        while side.metrics().get("broker/rejected/rate_limited", 0) < 30 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert side.metrics()["broker/rejected/rate_limited"] >= 30  # 40 sent, about 10 allowed
    finally:
        ctx.destroy(linger=0)
        side.close()


def first_automatic_routing_id() -> bytes:
    """The routing id a new ROUTER gives its first peer that names none."""
    with zmq.Context() as ctx:
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"x")
        identity = router.recv_multipart()[0]
        for sock in (router, dealer):
            sock.close(linger=0)
        return identity


def test_the_learners_automatic_routing_ids_cannot_be_known_in_advance():
    """libzmq draws them from the C library's rand(): unseeded, a peer could claim the next one and then
    connect without an id, which aborts the learner; the learner seeds it as it starts."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.srand(1)  # as every process starts
    foreseen = [first_automatic_routing_id() for _ in range(3)]
    libc.srand(1)
    side = ZmqLearnerTransport(BrokerConfig(), WireCodec(4096))
    try:
        assert first_automatic_routing_id() not in foreseen
    finally:
        side.close()


def test_unread_rollouts_are_bounded_in_bytes_not_only_in_frames():
    """rollout_hwm of 64 frames of up to 1 MiB would hold 64 MiB per connection; a buffer of 2 MiB lowers
    the socket's mark to 2 frames of 512 KiB, beside what the kernel buffers."""
    cfg = BrokerConfig(max_message_bytes=1 << 20, zmq=ZmqConfig(rollout_hwm=64, rollout_buffer_bytes=2 << 20))
    side = ZmqLearnerTransport(cfg, WireCodec(1 << 20))
    side.submit_prompts([prompt(i, n=1) for i in range(80)])

    async def flood():
        t = ZmqActorTransport(actor_config(side), WireCodec(1 << 20), "a")
        await t.heartbeat(hello("a"))
        groups = await t.request_work(80, timeout_s=5)
        big = (3,) * 65_536  # 512 KiB a frame
        for g in groups:
            await t.send_rollout(
                rollout(
                    tokens=big,
                    logprobs=(-0.1,) * len(big),
                    spans=((0, 0, len(big)),),
                    group_id=g.group_id,
                    actor_id="a",
                )
            )
        await asyncio.sleep(0.5)  # time to move all the learner's side would take
        t.close()  # what the actor still held goes with it
        return groups

    granted = asyncio.run(flood())
    received = 0
    while side.recv_rollout(timeout_s=0.5) is not None:
        received += 1
    side.close()
    # 2 in the socket and what the kernel's socket buffers held (about 6 MB here: 14 in all), not 64 and those
    assert len(granted) == 80 and 0 < received < 40


@pytest.mark.parametrize("hwm", [dict(control_hwm=1), dict(rollout_hwm=1), dict(rollout_buffer_bytes=1 << 20)])
def test_a_socket_whose_mark_is_set_to_one_still_receives_under_curve(tmp_path, hwm):
    """A high-water mark of 1 on a CURVE socket let nothing through: the learner heard no request (control)
    or no rollout (a mark of 1 frame, by rollout_hwm or by a buffer of one frame) and waited out its timeout.
    The config refuses such marks; a transport built without the check pins them at 2."""
    keys = generate(tmp_path / "keys", ["actor-0"])
    curve = dict(curve="on", keys_dir=str(keys))
    side = ZmqLearnerTransport(
        BrokerConfig(max_message_bytes=1 << 20, zmq=ZmqConfig(**curve, **hwm)), WireCodec(1 << 20)
    )
    side.submit_prompts([prompt(0)])

    async def actor():
        t = ZmqActorTransport(actor_config(side, **curve), WireCodec(1 << 20), "actor-0")
        try:
            await t.heartbeat(hello("actor-0"))
            groups = await t.request_work(8, timeout_s=10)
            await t.send_rollout(rollout(group_id="r-0"))
            received = await asyncio.to_thread(side.recv_rollout, 10)  # before the actor closes: it may drop
            return groups, received
        finally:
            t.close()

    try:
        groups, received = asyncio.run(actor())
        assert [g.group_id for g in groups] == ["r-0"] and received.group_id == "r-0"
    finally:
        side.close()
    key = next(iter(hwm))
    with pytest.raises(ConfigError, match=f"broker.zmq.{key}"):
        load_config(None, [f"broker.zmq.{key}={hwm[key]}"])


def test_a_flood_of_junk_frames_is_counted_exactly_and_logged_at_powers_of_ten(caplog):
    """One key's 235,500 junk frames in 10 s added 35.9 MiB to learner.log, a line each."""
    caplog.set_level(logging.WARNING, logger="tidal.broker")
    side = ZmqLearnerTransport(BrokerConfig(), WireCodec(1 << 20))
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{side.ports['rollout']}")
    try:
        for _ in range(1000):
            push.send(b"junk")
        deadline = time.monotonic() + 120  # a bound for a stuck learner, not a measure: 1000 frames take ms
        while side.metrics()["broker/rejected_frames"] < 1000 and time.monotonic() < deadline:
            assert side.recv_rollout(timeout_s=0.05) is None
        assert side.metrics()["broker/rejected_frames"] == 1000
        lines = [r.getMessage() for r in caplog.records if "rejected a frame on the rollout stream" in r.getMessage()]
        assert len(lines) == 4 and "(#1000 of rollout frames rejected" in lines[-1], lines
    finally:
        ctx.destroy(linger=0)
        side.close()
