"""The weight channel under NCCL's semantics (tests/fake_nccl.py), which gloo does not have: work
completes asynchronously on streams, the current device is per thread, and a dead peer raises
nothing. First the fake itself, then the collective channel's worker side on it."""
import threading
import time

import msgspec
import pytest
import torch

import fake_nccl
from tidal.broker.schema import WeightUpdate
from tidal.broker.weights import collective
from tidal.broker.weights.tcp import pack
from tidal.broker.weights.vllm_engine import UpdateInfo, update_info


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

    def named_parameters(self):
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
    sender.broadcast(torch.ones(4), src=0)  # destroyed: nothing happens, nothing is raised


def test_a_collective_on_another_devices_stream_is_refused(fake):
    uid = fake_nccl.unique_id()
    made = threading.Thread(target=lambda: (torch.cuda.set_device(2), fake_nccl.communicator(uid, 1, 2, 2)),
                            daemon=True)
    made.start()
    comm = fake_nccl.communicator(uid, 0, 2, 1)  # on cuda:1, while this thread's device is 0
    made.join()
    with pytest.raises(RuntimeError, match=r"communicator on cuda:1 enqueued on a stream of cuda:0"):
        comm.broadcast(torch.ones(2), src=0)


# ---- the collective channel's worker side ----------------------------------------------------------

def nccl_update(expected: dict) -> tuple[WeightUpdate, torch.Tensor]:
    payload, manifest = pack(expected)
    return WeightUpdate(version=1, transport="nccl", location="learner:1", manifest=manifest, checksum="",
                        incarnation="inc"), payload


@pytest.mark.xfail(strict=True, reason="F1: the prefetch thread's wait() orders only that thread's stream, so the "
                                       "load on vLLM's stream reads the buffer before the bytes land")
def test_a_prefetched_version_is_loaded_only_once_it_has_landed(fake, monkeypatch):
    expected = {"w": torch.arange(4096, dtype=torch.float32)}
    update, payload = nccl_update(expected)
    monkeypatch.setattr(collective, "receive", receive_on_side_stream(torch.cuda.Stream(), payload))
    info = UpdateInfo(**update_info("nccl", update, "", 5.0))
    torch.cuda.set_stream(torch.cuda.Stream())  # vLLM makes a stream of its own current in each worker
    collective.prefetch(info)
    while not collective.prefetched():
        time.sleep(0.001)
    model = FakeModel()
    collective.load_received(model, None, info)
    torch.cuda.synchronize()
    assert torch.equal(model.loaded["w"], expected["w"])


@pytest.mark.xfail(strict=True, reason="F2: the prefetch thread receives onto cuda:0, a new thread's device")
def test_a_worker_receives_on_its_own_device(fake, monkeypatch):
    expected = {"w": torch.arange(16, dtype=torch.float32)}
    update, payload = nccl_update(expected)
    devices = []

    def receive_part(*_):
        devices.append(collective.device_for("nccl").index)
        return payload
    monkeypatch.setattr(collective, "receive_part", receive_part)
    monkeypatch.setattr(collective, "payload_bytes", lambda update: payload.numel())
    torch.cuda.set_device(1)  # this worker is tensor-parallel rank 1
    info = UpdateInfo(**update_info("nccl", msgspec.structs.replace(update), "", 5.0))
    collective.prefetch(info)
    collective.load_received(FakeModel(), None, info)
    assert devices == [1]
