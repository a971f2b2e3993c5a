"""The collective weight channel over NCCL: the learner (this process, GPU 0) publishes a version
on its GPU and a worker process on GPU 1 receives it by broadcast, bucket by bucket, exactly; a
second version reuses the group and the buffer. Then a sharded learner's two ranks (two publishers
here, both on GPU 0) each serve their rows, and the worker receives both parts and puts them
together (nccl_m2n). NCCL refuses two ranks on one GPU, so this needs two. (The same code over
gloo runs in tests/unit/test_collective_weights.py and, inside a real vLLM worker, in
tests/integration/test_engine.py and test_multirank.py.)"""
import subprocess
import sys

import msgspec
import pytest
import torch

from tidal.broker.weights import build_publisher
from tidal.config import WeightsConfig

WORKER = """
import sys
import msgspec, torch
from tidal.broker.schema import WeightUpdate
from tidal.broker.weights import collective
from tidal.broker.weights.tcp import tensors_of
torch.cuda.set_device(1)
for line in sys.stdin:
    update = msgspec.json.decode(line, type=WeightUpdate)
    buffer = collective.receive(update, "nccl", 60.0)
    torch.cuda.synchronize()
    sums = {name: float(t.double().sum()) for name, t in tensors_of(update.manifest, buffer)}
    print(msgspec.json.encode({"device": str(buffer.device), "ptr": buffer.data_ptr(), "sums": sums}).decode(),
          flush=True)
"""


def nccl_config() -> WeightsConfig:
    return WeightsConfig(transport="nccl", bucket_mib=1, tcp_timeout_s=60.0)


def worker_receives(worker, update) -> dict:
    worker.stdin.write(msgspec.json.encode(update).decode() + "\n")
    worker.stdin.flush()
    return msgspec.json.decode(worker.stdout.readline())


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two GPUs")


@TWO_GPUS
def test_versions_reach_a_worker_on_another_gpu_by_nccl_broadcast():
    torch.cuda.set_device(0)
    publisher = build_publisher(nccl_config(), "inc", "run", "/x")
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        seen = []
        for version in (1, 2):
            generator = torch.Generator(device="cuda").manual_seed(version)
            tensors = {"embed.weight": torch.randn(1000, 1024, device="cuda", generator=generator),
                       "norm.weight": torch.randn(1024, device="cuda", generator=generator).bfloat16()}
            update = publisher.publish(tensors, version)
            assert update.transport == "nccl" and len(update.buckets) > 1
            assert publisher.server.versions[version].payload.is_cuda  # packed on the learner's GPU
            got = worker_receives(worker, update)
            assert got["device"] == "cuda:1"
            for name, tensor in tensors.items():
                assert got["sums"][name] == pytest.approx(float(tensor.double().sum()), rel=1e-9, abs=1e-9)
            seen.append(got["ptr"])
        assert seen[0] == seen[1]  # one buffer on the worker's GPU for every version
    finally:
        worker.stdin.close()
        worker.wait(timeout=60)
        publisher.close()


@TWO_GPUS
def test_a_sharded_learners_ranks_each_send_their_rows_and_the_worker_puts_them_together():
    torch.cuda.set_device(0)
    ranks = [build_publisher(nccl_config(), "inc", "run", "/x", local_rank=r) for r in (0, 1)]
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for version in (1, 2):
            generator = torch.Generator(device="cuda").manual_seed(version)
            tensors = {"embed.weight": torch.randn(1001, 1024, device="cuda", generator=generator),
                       "norm.weight": torch.randn(1024, device="cuda", generator=generator).bfloat16()}
            half = {name: -(-t.shape[0] // 2) for name, t in tensors.items()}  # torch.chunk's split over 2 ranks
            rows = [{name: (t[:half[name]], 0) for name, t in tensors.items()},
                    {name: (t[half[name]:], half[name]) for name, t in tensors.items()}]
            sources = [rank.publish_shards(part, version) for rank, part in zip(ranks, rows)]
            update = ranks[0].announce(sources, version)
            assert len(update.sources) == 2 and not update.buckets
            got = worker_receives(worker, update)
            assert got["device"] == "cuda:1"
            for name, tensor in tensors.items():
                assert got["sums"][name] == pytest.approx(float(tensor.double().sum()), rel=1e-9, abs=1e-9)
    finally:
        worker.stdin.close()
        worker.wait(timeout=60)
        for rank in ranks:
            rank.close()
