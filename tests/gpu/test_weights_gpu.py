"""The collective weight channel over NCCL: the learner (this process, GPU 0) publishes a version
on its GPU and a worker process on GPU 1 receives it by broadcast, bucket by bucket, exactly; a
second version reuses the group and the buffer. NCCL refuses two ranks on one GPU, so this needs
two. (The same code over gloo runs in tests/unit/test_collective_weights.py and, inside a real
vLLM worker, in tests/integration/test_engine.py.)"""
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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two GPUs")
def test_versions_reach_a_worker_on_another_gpu_by_nccl_broadcast():
    torch.cuda.set_device(0)
    publisher = build_publisher(WeightsConfig(transport="nccl", bucket_mib=1, tcp_timeout_s=60.0), "inc", "run", "/x")
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
            worker.stdin.write(msgspec.json.encode(update).decode() + "\n")
            worker.stdin.flush()
            got = msgspec.json.decode(worker.stdout.readline())
            assert got["device"] == "cuda:1"
            for name, tensor in tensors.items():
                assert got["sums"][name] == pytest.approx(float(tensor.double().sum()), rel=1e-9, abs=1e-9)
            seen.append(got["ptr"])
        assert seen[0] == seen[1]  # one buffer on the worker's GPU for every version
    finally:
        worker.stdin.close()
        worker.wait(timeout=60)
        publisher.close()
