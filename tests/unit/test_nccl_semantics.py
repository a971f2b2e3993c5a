"""The weight channel under NCCL's semantics (tests/fake_nccl.py), which gloo does not have: work
completes asynchronously on streams, the current device is per thread, and a dead peer raises
nothing. First the fake itself, then the collective channel's worker side on it."""

import asyncio
import threading
import time

import pytest
import torch

import fake_nccl
from conftest import ScriptedEngine, weights_config
from tidal.broker.weights import build_receiver, collective


@pytest.fixture
def fake():
    with fake_nccl.installed():
        yield fake_nccl


class FakeModel:
    """A model in a vLLM worker: its load reads each tensor as a kernel on the current stream would."""

    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}

    def parameters(self):
        return iter(())

    def named_parameters(self, remove_duplicate: bool = True):
        return iter(())

    def load_weights(self, weights) -> set[str]:
        self.loaded.update((name, fake_nccl.read(t)) for name, t in weights)
        return set(self.loaded)


def receive_on_side_stream(side, expected):
    """A receive of `expected` with NCCL's semantics: enqueued on a stream of NCCL's own, landing later;
    the caller's current stream is made to wait for it (what ProcessGroupNCCL's Work.wait() does), the
    host not at all."""

    def receive(*_):
        buffer = torch.zeros_like(expected)
        fake_nccl.write_later(side, buffer, expected)
        torch.cuda.current_stream().wait_stream(side)
        return buffer

    return receive


# ---- the fake ----------------------------------------------------------------------------------------


def test_the_fake_orders_reads_as_streams_do(fake):
    """A read on the stream a receive was enqueued on, or on one told to wait for it, sees the data; a
    read on any other stream does not wait for it."""
    expected = torch.arange(8.0)
    side = torch.cuda.Stream()
    buffer = receive_on_side_stream(side, expected)()  # the current (default) stream now waits for `side`
    assert torch.equal(fake_nccl.read(buffer), expected)
    other = torch.cuda.Stream()
    buffer = receive_on_side_stream(side, expected)()
    with torch.cuda.stream(other):
        assert not torch.equal(fake_nccl.read(buffer), expected)  # not ordered: read before it landed
    side.synchronize()
    assert torch.equal(fake_nccl.read(buffer), expected)


def test_the_current_device_is_per_thread_and_a_new_thread_starts_on_device_0(fake):
    torch.cuda.set_device(3)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.cuda.current_device()))
    thread.start()
    thread.join()
    assert torch.cuda.current_device() == 3 and seen == [0]


def test_a_dead_peer_raises_nothing_and_an_abort_ends_the_wait(fake):
    uid = fake_nccl.unique_id()
    comms = {}

    def join(rank):  # each rank on a device of its own, as NCCL requires
        torch.cuda.set_device(rank)
        comms[rank] = fake_nccl.communicator(uid, rank, 2, rank)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sender = comms[0]
    sender.broadcast(torch.ones(4), src=0)  # the peer never takes part: no error, the stream never drains
    done = threading.Event()
    threading.Thread(target=lambda: (torch.cuda.current_stream().synchronize(), done.set()), daemon=True).start()
    assert not done.wait(0.3)
    sender.destroy()
    assert done.wait(5.0)
    sender.broadcast(torch.ones(4), src=0)  # aborted, not yet disabled: undefined on a GPU, recorded here
    assert len(fake_nccl.misuse) == 1
    fake_nccl.settle()
    assert sender.disabled
    sender.broadcast(torch.ones(4), src=0)  # disabled: nothing happens, nothing is raised
    assert len(fake_nccl.misuse) == 1


def test_a_collective_on_another_devices_stream_is_refused(fake):
    uid = fake_nccl.unique_id()
    made = threading.Thread(
        target=lambda: (torch.cuda.set_device(2), fake_nccl.communicator(uid, 1, 2, 2)), daemon=True
    )
    made.start()
    comm = fake_nccl.communicator(uid, 0, 2, 1)  # on cuda:1, while this thread's device is 0
    made.join()
    with pytest.raises(RuntimeError, match=r"communicator on cuda:1 enqueued on a stream of cuda:0"):
        comm.broadcast(torch.ones(2), src=0)


# ---- the nccl channel on the fake: tidal's control plane, vLLM's packed NCCL transfer --------------

LEARNER_DEVICE, WORKER_DEVICE = 1, 2


@pytest.fixture
def channel(fake, monkeypatch):
    """The nccl channel's three GPU calls replaced by the fake's; yields the communicators made, by rank."""
    from tidal.broker.weights import nccl

    made = []

    def communicator(uid, rank, world_size, device_index):
        comm = fake_nccl.communicator(uid, rank, world_size, device_index)
        made.append(comm)
        return comm

    monkeypatch.setattr(nccl, "unique_id", fake_nccl.unique_id)
    monkeypatch.setattr(nccl, "communicator", communicator)
    monkeypatch.setattr(nccl, "tensor_device", lambda index: torch.device("cpu"))
    monkeypatch.setattr(nccl, "landed", fake_nccl.read)  # a tag is computed as a kernel reads
    nccl._vllm_engine_class()  # vLLM's import, once, before any test's joins are timed
    torch.cuda.set_device(LEARNER_DEVICE)  # the learner's training thread
    yield made
    fake_nccl.settle()  # every abort's window closed: a side still sending would have been seen by now
    assert not fake_nccl.misuse


def nccl_publisher(timeout_s: float = 5.0, **keys):
    from tidal.broker.weights import nccl

    cfg = weights_config("nccl", bucket_mib=1, tcp_timeout_s=timeout_s, **keys)
    return collective.CollectivePublisher(cfg, nccl.NcclPlane(cfg), incarnation="inc")


def worker_engine(**keys) -> ScriptedEngine:
    """An actor's engine whose worker runs on a thread of its own on WORKER_DEVICE, with a stream of its
    own made current (as vLLM makes one current in each worker), reading what it loads as a kernel would."""
    from types import SimpleNamespace

    def setup():
        torch.cuda.set_device(WORKER_DEVICE)
        torch.cuda.set_stream(torch.cuda.Stream())

    return ScriptedEngine(
        None,
        read=fake_nccl.read,
        worker_setup=setup,
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(rank=0), model_config=None),
        **keys,
    )


def assert_whole(engine, state: dict, swaps: list[int]) -> None:
    """The engine took `swaps` and holds `state` exactly, its model whole again."""
    assert engine.swaps == swaps and not engine.torn
    assert all(torch.equal(engine.loaded[k], v) for k, v in state.items())


def weights(seed: int) -> dict:
    """Six tensors of 0.75 MiB: three chunks of vLLM's packing at weights.bucket_mib = 1."""
    generator = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(384, 512, generator=generator) for i in range(6)}


def test_every_piece_is_loaded_after_it_lands_on_the_workers_own_device(channel):
    """F1: the worker loads each chunk on the stream it was received on, so it reads it whole. F2:
    the learner's connection thread sends from the training device, not from cuda:0, a new thread's."""
    publisher = nccl_publisher()
    try:
        engine, receiver = worker_engine(), build_receiver(weights_config("nccl"))
        for version, seed in ((1, 0), (2, 1)):
            state = weights(seed)
            asyncio.run(receiver.apply(publisher.publish(state, version), engine))
            assert engine.swaps[-1] == version and all(torch.equal(engine.loaded[k], v) for k, v in state.items())
        learner, worker = sorted(channel, key=lambda comm: comm.rank)
        assert (learner.device_index, worker.device_index) == (LEARNER_DEVICE, WORKER_DEVICE)
        assert learner.num_ops == worker.num_ops == 1 + 2 * 3  # the warm-up, then three chunks a version
    finally:
        publisher.close()


def test_the_learner_sends_off_its_training_stream(channel):
    """S2: the sends run on streams of the group's own, so nothing is queued behind (or ahead of) the
    learner's training kernels on its default stream."""
    publisher = nccl_publisher()
    try:
        asyncio.run(build_receiver(weights_config("nccl")).apply(publisher.publish(weights(0), 1), worker_engine()))
        training = fake_nccl.default_stream(LEARNER_DEVICE)
        assert not [op for op in training.ops if op.writes is not None]
    finally:
        publisher.close()


def test_a_worker_that_stops_mid_transfer_costs_the_learner_one_timeout_and_nothing_else(channel):
    """F4: the worker takes the first chunk and goes silent. The learner's thread for it aborts the
    transfer after weights.tcp_timeout_s while the training thread's kernels run on untouched; a new
    actor then joins and receives the next version whole."""
    publisher = nccl_publisher(timeout_s=1.0)
    reading, release = threading.Event(), threading.Event()
    try:
        stuck = worker_engine()
        stuck.read = lambda t: (reading.set(), release.wait(30), t.clone())[2]  # a dead worker: nothing after
        receiver = build_receiver(weights_config("nccl", tcp_timeout_s=1.0))
        loop = asyncio.new_event_loop()
        transfer = loop.run_in_executor(
            None, lambda: asyncio.run(receiver.apply(publisher.publish(weights(0), 1), stuck))
        )
        assert reading.wait(10)
        worst = train_while(lambda: not publisher.server.groups, seconds=6)
        assert not publisher.server.groups  # the learner's side of that group was aborted and dropped
        assert worst < 0.5  # no training kernel waited on the stalled transfer
        fresh = worker_engine()
        state = weights(1)
        asyncio.run(build_receiver(weights_config("nccl")).apply(publisher.publish(state, 2), fresh))
        assert fresh.swaps == [2] and all(torch.equal(fresh.loaded[k], v) for k, v in state.items())
    finally:
        release.set()
        with pytest.raises(ConnectionError):
            loop.run_until_complete(transfer)  # the silent worker's own watchdog ends its side too
        publisher.close()


def train_while(done, seconds: float) -> float:
    """Enqueue a kernel on the training stream and wait for it, over and over until `done()` or
    `seconds`; returns the longest single wait."""
    training, worst, deadline = fake_nccl.default_stream(LEARNER_DEVICE), 0.0, time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        start = time.monotonic()
        training.enqueue(lambda op: None)
        training.synchronize()
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.01)
    assert done(), f"not done within {seconds} s"
    return worst


def test_a_learner_gone_mid_transfer_leaves_the_engine_paused_until_a_whole_version_loads(channel, monkeypatch):
    """The learner sends one chunk and goes silent: the worker aborts after weights.tcp_timeout_s
    (raising nothing is NCCL's way: the watchdog is the one who notices), the engine stays paused on
    its torn model, and the next learner process's version makes it whole."""
    from tidal.broker.weights import nccl

    publisher = nccl_publisher()
    send = nccl.NcclPlane.send

    def one_chunk_then_silence(self, group, served, progress):
        sent = served.manifest[:2]  # the first chunk: two 0.75 MiB tensors
        served = collective.Served(served.payload[: sent[-1].offset + sent[-1].nbytes], sent, [])
        send(self, group, served, progress)

    monkeypatch.setattr(nccl.NcclPlane, "send", one_chunk_then_silence)
    engine = worker_engine()
    receiver = build_receiver(weights_config("nccl", tcp_timeout_s=1.0))
    try:
        with pytest.raises(ConnectionError, match=r"weights v1 .* nothing arrived for 1 s"):
            asyncio.run(receiver.apply(publisher.publish(weights(0), 1), engine))
        assert engine.torn and engine.swaps == []
    finally:
        publisher.close()
    monkeypatch.setattr(nccl.NcclPlane, "send", send)
    resumed = nccl_publisher()
    try:
        resumed.incarnation = "inc-2"
        state = weights(1)
        asyncio.run(receiver.apply(resumed.publish(state, 1), engine))
        assert_whole(engine, state, [1])
    finally:
        resumed.close()


def test_transfers_beyond_max_sends_wait_their_turn_and_every_one_sends_from_the_same_slot(channel):
    """weights.max_sends = 1: two actors ask at once; one transfer runs, from the one send slot (two
    streams and two buffers of the largest chunk, made once), while the other actor waits longer than
    weights.tcp_timeout_s without timing out (the learner tells it it is queued), then takes its turn."""
    # a chunk takes 0.8 s, well inside the 2 s timeout even on a loaded machine (two test processes per
    # core: 0.4 s against 1 s once timed out there); a version, 2.4 s, beyond it
    publisher = nccl_publisher(timeout_s=2.0, max_sends=1)
    slow = lambda t: (time.sleep(0.4), fake_nccl.read(t))[1]  # noqa: E731
    engines = [worker_engine(), worker_engine()]
    for engine in engines:
        engine.read = slow
    state = weights(0)
    update = publisher.publish(state, 1)

    async def both():
        receivers = [build_receiver(weights_config("nccl", tcp_timeout_s=2.0)) for _ in engines]
        await asyncio.gather(*(r.apply(update, e) for r, e in zip(receivers, engines)))

    running, most, send = [], [], publisher.plane.send

    def counted(group, served, progress):
        running.append(1)
        most.append(len(running))
        try:
            send(group, served, progress)
        finally:
            running.pop()

    publisher.plane.send = counted
    try:
        asyncio.run(both())
        assert max(most) == 1 and len(most) == 2
        assert all(e.swaps == [1] and all(torch.equal(e.loaded[k], v) for k, v in state.items()) for e in engines)
        slots = publisher.plane.free
        assert len(slots) == 1 and slots[0].nbytes == 2 * state["layers.0.w"].numel() * 4  # two tensors a chunk
    finally:
        publisher.close()


def test_an_actor_whose_workers_never_form_its_group_costs_one_timeout(channel):
    """An actor joins and dies before its workers form their side: NCCL's init would wait for them for
    ever, so the learner forms its side on a thread of its own and gives up on the connection after
    weights.tcp_timeout_s; the next actor is served as if nothing happened."""
    import socket

    from tidal.broker.weights import server

    publisher = nccl_publisher(timeout_s=1.0)
    try:
        update = publisher.publish(weights(0), 1)
        conn = socket.create_connection(server.parse_location(update.location), timeout=10)
        conn.sendall(collective.control(update.token, collective.JOIN, 1))
        server.read_reply(conn, "join")
        started = time.monotonic()
        assert conn.recv(1) == b""  # the learner closed it
        assert time.monotonic() - started < 3.0 and not publisher.server.groups
        engine = worker_engine()
        asyncio.run(build_receiver(weights_config("nccl")).apply(update, engine))
        assert engine.swaps == [1]
    finally:
        publisher.close()


def test_a_tensor_altered_on_the_way_is_refused_and_the_engine_waits_for_a_checked_version(channel, monkeypatch):
    """Someone on NCCL's unauthenticated sockets flips one bit of the second chunk: the worker's tags,
    computed on its device as each tensor lands, disagree with the announced ones (keyed, carried
    by the authenticated broker), so the update fails naming the tensor, the engine stays paused on
    its torn model, and the next version, sent intact, loads."""
    from tidal.broker.weights import nccl

    publisher = nccl_publisher()
    send = nccl.NcclPlane.send

    def flip_one_bit(self, group, served, progress):
        payload = served.payload.clone()
        payload[served.manifest[3].offset + 1000] ^= 0x10
        send(self, group, collective.Served(payload, served.manifest, served.buckets), progress)

    monkeypatch.setattr(nccl.NcclPlane, "send", flip_one_bit)
    engine, receiver = worker_engine(), build_receiver(weights_config("nccl"))
    try:
        with pytest.raises(ConnectionError, match=r"tensor 'layers.3.w' arrived with tag .* altered on the way"):
            asyncio.run(receiver.apply(publisher.publish(weights(0), 1), engine))
        assert engine.torn and engine.swaps == []
        monkeypatch.setattr(nccl.NcclPlane, "send", send)
        state = weights(1)
        asyncio.run(receiver.apply(publisher.publish(state, 2), engine))
        assert_whole(engine, state, [2])
    finally:
        publisher.close()


@pytest.mark.parametrize("damage", [{"tags": []}, {"tag_key": b""}, {"tags": "one short"}])
def test_an_nccl_announcement_without_its_tags_is_refused_before_the_engine_is_touched(channel, damage):
    import msgspec

    publisher = nccl_publisher()
    try:
        update = publisher.publish(weights(0), 1)
        if damage.get("tags") == "one short":
            damage = {"tags": update.tags[:-1]}
        engine = worker_engine()
        with pytest.raises(ValueError, match="refused, its bytes could not be checked"):
            asyncio.run(build_receiver(weights_config("nccl")).apply(msgspec.structs.replace(update, **damage), engine))
        assert engine.swaps == [] and not engine.torn and not publisher.server.groups
    finally:
        publisher.close()


def test_an_adapter_version_lands_whole_in_the_stash_checked_by_its_tags(channel):
    """learner.lora over nccl: the adapter's tensors alone, tagged and checked as any version, kept
    by the worker for vLLM's LoRA manager instead of loaded into the model."""
    import msgspec

    from tidal.broker.schema import AdapterSpec

    publisher = nccl_publisher()
    spec = AdapterSpec(rank=4, alpha=8.0, target_modules=("q_proj",))
    tensors = {
        f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{p}.weight": torch.randn(*shape)
        for i in range(3)
        for p, shape in (("A", (4, 512)), ("B", (512, 4)))
    }
    try:
        engine = worker_engine(adapter=True)
        update = msgspec.structs.replace(publisher.publish(tensors, 1), adapter=spec)
        asyncio.run(build_receiver(weights_config("nccl")).apply(update, engine))
        got_spec, got, version = engine.worker.stash.current
        assert (got_spec, version, engine.swaps, engine.loaded) == (spec, 1, [1], {})
        assert all(torch.equal(got[k], v) for k, v in tensors.items())
    finally:
        publisher.close()
