"""The NCCL data plane of the collective weight channel (`weights.transport: nccl`, GPUs), built on
vLLM's own NCCL weight transfer (vllm.distributed.weight_transfer, 0.32):

    learner  one communicator per actor engine, rank 0 (vLLM's PyNcclCommunicator from an NCCL unique
             id the learner mints and sends over the control connection: no store, nothing unpickled);
             a version goes out as vLLM's packed chunks (`pack_tensors`, weights.bucket_mib each),
             copied from the page-locked payload on two streams of the group's own, never the
             training stream
    worker   vLLM's NCCL engine (`NCCLWeightTransferEngine`): its double-buffered packed consumer
             receives each chunk on its own stream and loads it on that same stream (nothing is
             read before it lands), into the worker's own device, each chunk as it arrives: no
             worker holds more than two chunks beyond its weights

NCCL's operations complete asynchronously and a dead peer raises nothing: a kernel waits for it for
ever. Both sides therefore watch their own progress and destroy the communicator (ncclCommAbort)
after weights.tcp_timeout_s without any, which ends the pending work. These are vLLM's
communicators, not torch's ProcessGroupNCCL, so no watchdog of torch's ever takes the process down.
A new thread's current device is 0: the learner's connection threads are bound to the training
device first; the workers receive on the thread vLLM runs them on, with vLLM's own device.
NCCL_SOCKET_IFNAME (and NCCL's other variables) pick the network.
"""
from __future__ import annotations

import base64

from tidal.broker.schema import WeightUpdate
from tidal.broker.weights.base import InitInfo, StreamedLoad
from tidal.broker.weights.collective import CollectiveTransport, Plane, Watchdog
from tidal.broker.weights.payload import DTYPE_NAMES, tensors_of
from tidal.broker.weights.server import Served

NAME = "nccl"
NUM_BUFFERS = 2  # chunks in flight on each side: vLLM's double buffering


# The three calls that need the NCCL library and a GPU: the unit tier's fake (tests/fake_nccl.py)
# stands in for them, with NCCL's semantics.

def unique_id() -> bytes:
    """A fresh ncclUniqueId, the rendezvous of one communicator."""
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    return bytes(NCCLLibrary().ncclGetUniqueId().internal)


def communicator(uid: bytes, rank: int, world_size: int, device_index: int):
    """This rank's communicator of the group `uid` names, on `device_index`; blocks until every rank
    has joined (then runs vLLM's one-element warm-up all-reduce)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    return PyNcclCommunicator.from_unique_id_bytes(uid, rank=rank, world_size=world_size, device=device_index)


class Abortable:
    """A communicator that does nothing once aborted. vLLM's destroy() runs ncclCommAbort on a thread
    of its own and marks the communicator disabled only when that returns (or after 5 s): a sender or
    receiver that issued its next chunk meanwhile would enqueue on a communicator being torn down. The
    flag set here first closes that window; the rest of the API is the communicator's."""

    def __init__(self, comm):
        self.comm, self.aborted = comm, False

    def broadcast(self, tensor, src: int, stream=None) -> None:
        if not self.aborted:
            self.comm.broadcast(tensor, src=src, stream=stream)

    def destroy(self) -> None:
        self.aborted = True
        self.comm.destroy()

    def __getattr__(self, name: str):
        return getattr(self.comm, name)


def tensor_device(device_index: int):
    import torch

    return torch.device("cuda", device_index)


class _LearnerGroup:
    """The learner's end of one actor's group: its communicator and the two streams its sends use."""

    def __init__(self, comm: Abortable, streams: list):
        self.comm, self.streams = comm, streams

    def abort(self) -> None:
        self.comm.destroy()  # ncclCommAbort: pending collectives end, later ones are never issued


class NcclPlane(Plane):
    name = NAME
    pin = True

    @classmethod
    def check_learner(cls) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("config key 'weights.transport' = 'nccl' needs CUDA on the learner and the actors; "
                             "on CPUs use gloo or tcp")

    def device_index(self) -> int:
        import torch

        return torch.cuda.current_device()

    def bind(self, device_index: int) -> None:
        import torch

        torch.cuda.set_device(device_index)

    def mint(self, num_workers: int, bucket_bytes: int) -> dict:
        return {"uid": base64.b64encode(unique_id()).decode(), "world_size": 1 + num_workers,
                "buffer_bytes": bucket_bytes}

    def form(self, spec: dict, timeout_s: float) -> _LearnerGroup:
        import torch

        device = torch.cuda.current_device()
        streams = [torch.cuda.Stream(device=device) for _ in range(NUM_BUFFERS)]
        with torch.cuda.stream(streams[0]):  # the communicator's warm-up too stays off the training stream
            comm = Abortable(communicator(base64.b64decode(spec["uid"]), 0, spec["world_size"], device))
        return _LearnerGroup(comm, streams)

    def send(self, group: _LearnerGroup, served: Served, progress) -> None:
        """vLLM's packed producer, on the group's own streams: each chunk is packed (copied from the
        payload in host memory) and broadcast on one stream while the other's is in flight."""
        import torch
        from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

        device = tensor_device(torch.cuda.current_device())
        pairs = iter(tensors_of(served.manifest, served.payload))
        in_flight = [None] * len(group.streams)  # each stream's chunk, alive until its broadcast ends
        index = 0
        while True:
            group.streams[index].synchronize()
            in_flight[index] = None
            progress()
            with torch.cuda.stream(group.streams[index]):
                chunk = pack_tensors(pairs, lambda item: item[1].to(device, non_blocking=True),
                                     self.cfg.bucket_mib << 20)
                if chunk is None:
                    break
                group.comm.broadcast(chunk.packed_tensor, src=0, stream=group.streams[index])
                in_flight[index] = chunk
            index = (index + 1) % len(group.streams)
        for stream in group.streams:
            stream.synchronize()
            progress()

    @classmethod
    def join(cls, engine, init: InitInfo) -> NcclMember:
        return NcclMember(engine, init)


class NcclMember:
    """A worker's side of its engine's group: vLLM's NCCL engine, receiving into the model through
    `StreamedLoad` (copies where they serve, a layer-wise reload where a kernel or a quantization
    method needs one), watched for progress."""

    def __init__(self, engine, init: InitInfo):
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

        self.timeout_s = init.timeout_s
        self.load = StreamedLoad(engine.model, engine.model_config)
        self.watchdog: Watchdog | None = None
        self.vllm = _vllm_engine_class()(engine.config, engine.vllm_config, engine.device, _Loading(self))
        spec = init.group
        self.vllm.worker_rank = 1 + engine.worker_rank
        self.vllm.init_transfer_engine(NCCLWeightTransferInitInfo(
            nccl_unique_id_b64=spec["uid"], rank_offset=1, world_size=int(spec["world_size"]), packed=True,
            packed_buffer_size_bytes=int(spec["buffer_bytes"]), packed_num_buffers=NUM_BUFFERS))

    def start(self) -> None:
        self.load.start()

    def receive(self, update: WeightUpdate) -> None:
        manifest = update.manifest
        info = {"names": [s.name for s in manifest], "dtype_names": [DTYPE_NAMES[s.dtype] for s in manifest],
                "shapes": [list(s.shape) for s in manifest]}
        try:
            with Watchdog(self.timeout_s, self.vllm.model_update_group.destroy) as self.watchdog:
                self.vllm.receive_weights(self.vllm.parse_update_info(info))
            if self.watchdog.fired:
                raise ConnectionError(f"weights v{update.version}: nothing arrived for {self.timeout_s:.0f} s "
                                      "(weights.tcp_timeout_s); the transfer was aborted")
        except BaseException:
            self.load.abandon()
            raise
        finally:
            self.watchdog = None

    def finish(self) -> None:
        self.load.finish()

    def close(self) -> None:
        self.vllm.shutdown()


class _Loading:
    """What vLLM's engine sees as the model: each chunk it unpacks is loaded, and counts as progress."""

    def __init__(self, member: NcclMember):
        self.member = member

    def load_weights(self, weights):
        if self.member.watchdog is not None:
            self.member.watchdog.progress()
        self.member.load.load(weights)


_engine_class = None


def _vllm_engine_class():
    """vLLM's NCCL engine with its group formed through `communicator` (tidal's rank in the group,
    the worker's own device), built on first use: only a worker imports vLLM."""
    global _engine_class
    if _engine_class is None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        class TidalNcclEngine(NCCLWeightTransferEngine):
            worker_rank = 1

            def init_transfer_engine(self, init_info) -> None:
                import torch

                self.packed = init_info.packed
                self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
                self.packed_num_buffers = init_info.packed_num_buffers
                self.model_update_group = Abortable(communicator(
                    init_info.nccl_unique_id_bytes, self.worker_rank, init_info.world_size,
                    torch.accelerator.current_device_index()))

        _engine_class = TidalNcclEngine
    return _engine_class


TRANSPORT = CollectiveTransport(NcclPlane)
