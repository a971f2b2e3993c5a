"""The nccl weight channel on real GPUs (the same code runs on CPU under a fake with NCCL's semantics,
tests/unit/test_nccl_semantics.py).

One GPU, vLLM installed: a worker receives through vLLM's packed consumer from a communicator whose
every chunk lands late on the stream it was issued on, while a stream of vLLM's own is current, and
loads each chunk whole (F1). Two GPUs (NCCL refuses two ranks on one GPU): a learner on GPU 0 and a
worker process on GPU 1 with real communicators: the worker receives on its own device (F2); a worker
killed mid-transfer costs the learner one timeout and nothing else (F4); the learner's training
kernels do not wait behind a transfer (S2)."""

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import ScriptedEngine, gpu_check_report, weights_config

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two GPUs")


def chunks_of(state: dict, buffer_bytes: int) -> list[torch.Tensor]:
    """The packed chunks the learner sends for `state` (vLLM's packing, in the manifest's order)."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    pairs, out = iter(state.items()), []
    while (chunk := pack_tensors(pairs, lambda item: item[1], buffer_bytes)) is not None:
        out.append(chunk.packed_tensor.clone())
    return out


class LateCommunicator:
    """A communicator whose broadcast lands each expected chunk on the stream it is issued on, after the
    GPU has spun for a while there (a receive enqueued, not done): NCCL's asynchronous completion."""

    def __init__(self, chunks: list[torch.Tensor]):
        self.chunks, self.device, self.model_update_group = list(chunks), torch.device("cuda", 0), self

    def broadcast(self, tensor, src, stream=None):
        stream = stream or torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time before the bytes land
            tensor.copy_(self.chunks.pop(0), non_blocking=True)

    def destroy(self):
        pass


def test_every_chunk_is_loaded_after_it_lands_on_the_stream_it_came_on(monkeypatch):
    pytest.importorskip("vllm", reason="the worker receives through vLLM's NCCL engine")
    from tidal.broker.weights import nccl, payload, tags
    from tidal.broker.weights.base import InitInfo

    torch.cuda.set_device(0)
    torch.cuda.set_stream(torch.cuda.Stream())  # vLLM makes a stream of its own current in each worker
    generator = torch.Generator(device="cuda").manual_seed(0)
    state = {f"layers.{i}.w": torch.randn(1024, 1024, device="cuda", generator=generator) for i in range(6)}
    model = SimpleNamespace(
        named_parameters=lambda: iter(()), modules=lambda: iter(()), parameters=lambda: iter(()), loaded={}
    )
    model.load_weights = lambda weights: model.loaded.update((k, t.clone()) for k, t in weights) or set()
    monkeypatch.setattr(nccl, "communicator", lambda *_: LateCommunicator(chunks_of(state, 4 << 20)))
    engine = SimpleNamespace(
        config=None,
        device=torch.device("cuda", 0),
        model=model,
        load_target=model,
        model_config=None,
        worker_rank=0,
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(rank=0), model_config=None),
    )
    uid = base64.b64encode(bytes(128)).decode()  # the stub communicator needs no rendezvous
    member = nccl.NcclPlane.join(engine, InitInfo("nccl", {"uid": uid, "world_size": 2, "buffer_bytes": 4 << 20}, 30))
    manifest, _ = payload.layout((k, "F32", tuple(v.shape)) for k, v in state.items())
    key = tags.new_key()
    learner_tags = tags.Tagger(key)
    for tensor in state.values():
        learner_tags.tag(tensor)
    update = SimpleNamespace(version=1, manifest=manifest, tag_key=key, tags=learner_tags.digests())
    start = time.perf_counter()
    member.start()
    member.receive(update)
    member.finish()
    torch.cuda.synchronize()
    assert all(torch.equal(model.loaded[k], v) for k, v in state.items())
    gpu_check_report("F1-side-stream-load", chunks=len(chunks_of(state, 4 << 20)), seconds=time.perf_counter() - start)


def test_tags_on_the_gpu_agree_with_the_cpu_and_cost_little_beside_a_transfer():
    """The nccl channel's tensor tags, computed on a GPU, are the CPU's bit for bit (exact int64
    arithmetic on any device), and their throughput is what a worker adds to each update's pause."""
    from tidal.broker.weights import tags

    key = tags.new_key()
    generator = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(4096, 4096, device="cuda", generator=generator).to(torch.bfloat16) for _ in range(8)]
    on_gpu, on_cpu = tags.Tagger(key), tags.Tagger(key)
    for tensor in tensors[:2]:
        on_gpu.tag(tensor)
        on_cpu.tag(tensor.cpu())
    assert on_gpu.digests() == on_cpu.digests()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for tensor in tensors:
        on_gpu.tag(tensor)
    on_gpu.digests()
    seconds = time.perf_counter() - start
    gpu_check_report(
        "W1-tensor-tags",
        gib=sum(t.nbytes for t in tensors) / 2**30,
        seconds=seconds,
        gib_per_s=sum(t.nbytes for t in tensors) / 2**30 / seconds,
    )


WORKER = """
import json, os, signal, sys, time, types
import torch
torch.cuda.set_device(1)
from tidal.broker.weights import nccl
from tidal.broker.weights.base import InitInfo
spec = json.loads(sys.argv[1])
loaded, seen = {}, []
def load_weights(weights):
    for name, tensor in weights:
        seen.append(name)
        loaded[name] = float(tensor.double().sum()), str(tensor.device)
        if os.environ.get("DIE_AFTER") and len(seen) >= int(os.environ["DIE_AFTER"]):
            print("dying", flush=True); os.kill(os.getpid(), signal.SIGKILL)
    return set()
model = types.SimpleNamespace(named_parameters=lambda: iter(()), modules=lambda: iter(()),
                              parameters=lambda: iter(()), load_weights=load_weights)
engine = types.SimpleNamespace(config=None, device=torch.device("cuda", 1), model=model, load_target=model,
                               model_config=None,
                               worker_rank=0, vllm_config=types.SimpleNamespace(
                                   parallel_config=types.SimpleNamespace(rank=0), model_config=None))
member = nccl.NcclPlane.join(engine, InitInfo("nccl", spec["group"], 30.0))
print("joined", flush=True)
for line in sys.stdin:
    update = types.SimpleNamespace(**json.loads(line))
    from tidal.broker.schema import TensorSpec
    update.manifest = [TensorSpec(**s) for s in update.manifest]
    update.tag_key, update.tags = bytes.fromhex(update.tag_key), [bytes.fromhex(t) for t in update.tags]
    member.start(); member.receive(update); member.finish(); torch.cuda.synchronize()
    print(json.dumps(loaded), flush=True)
"""


def two_gpu_group(publisher, die_after: int = 0):
    """A worker process on GPU 1 joined to `publisher` (on GPU 0) the way an actor's engine joins:
    (the process, the learner-side connection)."""
    import socket

    from tidal.broker.weights import collective, server

    conn = socket.create_connection(server.parse_location(publisher.location))
    conn.sendall(collective.control(publisher.server.token, collective.JOIN, 1))  # the announcement carries it
    spec = json.loads(server.read_reply(conn, "join"))
    env = os.environ | ({"DIE_AFTER": str(die_after)} if die_after else {})
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, json.dumps({"group": spec})],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert worker.stdout.readline().strip() == "joined"
    return worker, conn


def fetch(worker, conn, update) -> None:
    from tidal.broker.weights import collective, server

    conn.sendall(collective.control(update.token, collective.FETCH, update.version))
    server.read_reply(conn, "fetch")
    worker.stdin.write(
        json.dumps(
            {
                "version": update.version,
                "manifest": [
                    {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "offset": s.offset, "nbytes": s.nbytes}
                    for s in update.manifest
                ],
                "tag_key": update.tag_key.hex(),
                "tags": [t.hex() for t in update.tags],
            }
        )
        + "\n"
    )
    worker.stdin.flush()


@TWO_GPUS
def test_a_worker_receives_on_its_own_device_from_a_learner_on_another():
    pytest.importorskip("vllm", reason="the communicators are vLLM's")
    from tidal.broker.weights import nccl
    from tidal.broker.weights.collective import CollectivePublisher

    torch.cuda.set_device(0)
    cfg = weights_config("nccl", bucket_mib=8, tcp_timeout_s=30.0)
    publisher = CollectivePublisher(cfg, nccl.NcclPlane(cfg), "inc")
    worker, conn = two_gpu_group(publisher)
    try:
        generator = torch.Generator().manual_seed(0)
        state = {f"layers.{i}.w": torch.randn(2048, 2048, generator=generator) for i in range(8)}  # 128 MiB
        update = publisher.publish(state, 1)
        fetch(worker, conn, update)
        loaded = json.loads(worker.stdout.readline())
        assert {device for _, device in loaded.values()} == {"cuda:1"}  # F2: the worker's own device
        for name, tensor in state.items():
            assert loaded[name][0] == pytest.approx(float(tensor.double().sum()), rel=1e-9, abs=1e-6)
        gpu_check_report("F2-worker-device", tensors=len(state))
    finally:
        worker.stdin.close()
        worker.wait(timeout=60)
        conn.close()
        publisher.close()


@TWO_GPUS
def test_a_worker_killed_mid_transfer_costs_the_learner_one_timeout_and_its_training_nothing():
    """F4 and S2: the worker dies after its first chunk; the learner's connection thread aborts the
    transfer after weights.tcp_timeout_s, this process lives on, its matmuls on the training stream
    kept their pace meanwhile, and a new worker then receives the next version."""
    pytest.importorskip("vllm", reason="the communicators are vLLM's")
    from tidal.broker.weights import nccl
    from tidal.broker.weights.collective import CollectivePublisher

    torch.cuda.set_device(0)
    cfg = weights_config("nccl", bucket_mib=64, tcp_timeout_s=5.0)
    publisher = CollectivePublisher(cfg, nccl.NcclPlane(cfg), "inc")
    generator = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.w": torch.randn(4096, 4096, generator=generator) for i in range(32)}  # 2 GiB
    try:
        baseline = training_pace(seconds=1.0)
        worker, conn = two_gpu_group(publisher, die_after=4)
        fetch(worker, conn, publisher.publish(state, 1))
        assert worker.stdout.readline().strip() == "dying"
        worker.wait(timeout=30)
        assert worker.returncode == -signal.SIGKILL
        during = training_pace(seconds=2.0)
        deadline = time.monotonic() + 30
        while publisher.server.groups and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not publisher.server.groups, "the learner's side of the dead worker's group was not aborted"
        gpu_check_report("F4-S2-dead-worker", matmul_ms_baseline=baseline * 1e3, matmul_ms_during=during * 1e3)
        assert during < 1.5 * baseline
        fresh, conn2 = two_gpu_group(publisher)
        try:
            fetch(fresh, conn2, publisher.publish(state, 2))
            loaded = json.loads(fresh.stdout.readline())
            assert loaded["layers.0.w"][0] == pytest.approx(float(state["layers.0.w"].double().sum()), rel=1e-9)
        finally:
            fresh.stdin.close()
            fresh.wait(timeout=60)
            conn2.close()
    finally:
        publisher.close()


def training_pace(seconds: float) -> float:
    """The median time of a 4096^2 matmul on this process's default stream, over `seconds`."""
    a = torch.randn(4096, 4096, device="cuda")
    times, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.perf_counter()
        (a @ a).sum().item()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@TWO_GPUS
def test_a_receive_through_the_channel_reaches_an_actor_engine_scripted_on_gpu_1():
    """The actor's side end to end (control connection, join, fetch) with the worker on GPU 1."""
    pytest.importorskip("vllm", reason="the communicators are vLLM's")
    from tidal.broker.weights import build_receiver, nccl
    from tidal.broker.weights.collective import CollectivePublisher

    torch.cuda.set_device(0)
    cfg = weights_config("nccl", bucket_mib=8)
    publisher = CollectivePublisher(cfg, nccl.NcclPlane(cfg), "inc")
    engine = ScriptedEngine(
        None,
        worker_setup=lambda: (torch.cuda.set_device(1), torch.cuda.set_stream(torch.cuda.Stream())),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(rank=0), model_config=None),
        device=torch.device("cuda", 1),
    )
    try:
        state = {"w": torch.randn(1024, 1024)}
        asyncio.run(build_receiver(cfg).apply(publisher.publish(state, 1), engine))
        assert engine.loaded["w"].device == torch.device("cuda", 1)
        assert torch.equal(engine.loaded["w"].cpu(), state["w"])
    finally:
        publisher.close()
