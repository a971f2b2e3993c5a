"""The NCCL data plane of the collective weight channel (`weights.transport: nccl`, GPUs), built on
vLLM's own NCCL weight transfer (vllm.distributed.weight_transfer, 0.32):

    learner  one communicator per actor engine, rank 0 (vLLM's PyNcclCommunicator from an NCCL unique
             id the learner mints and sends over the control connection: no store, nothing unpickled);
             a version goes out in the chunks vLLM's packed consumer expects (whole tensors, about
             weights.bucket_mib each), copied from the page-locked payload into one of
             weights.max_sends send slots (two streams, never the training stream, and two device
             buffers each, made once)
    worker   vLLM's NCCL engine (`NCCLWeightTransferEngine`): its double-buffered packed consumer
             receives each chunk on its own stream and loads it on that same stream (nothing is
             read before it lands), into the worker's own device, each chunk as it arrives: no
             worker holds more than two chunks beyond its weights (and, where a layer is
             reloaded layer-wise, that layer's weights until all of them are in)
    both     a keyed tag of every tensor (tags.py), the learner's as it packs a version, the worker's
             on the stream each chunk lands on; compared once the version is in

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
from tidal.broker.weights import tags
from tidal.broker.weights.base import InitInfo, StreamedLoad
from tidal.broker.weights.collective import CollectiveTransport, Plane, Watchdog
from tidal.broker.weights.payload import DTYPE_NAMES
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


def landed(tensor):
    """`tensor` as a kernel on the current stream reads it: on a GPU the stream's order makes every
    read wait for the receive before it (the fake stands in here to model that order on CPU)."""
    return tensor


class _LearnerGroup:
    """The learner's end of one actor's group: its communicator and the chunk size its workers expect."""

    def __init__(self, comm: Abortable, chunk_bytes: int):
        self.comm, self.chunk_bytes = comm, chunk_bytes

    def abort(self) -> None:
        self.comm.destroy()  # ncclCommAbort: pending collectives end, later ones are never issued


def chunks(manifest: list, chunk_bytes: int):
    """(tensors, bytes) of each chunk vLLM's packed consumer receives: whole tensors, unpadded, each
    chunk closed by the tensor that takes it past `chunk_bytes` (so at most that plus the largest)."""
    specs, total = [], 0
    for spec in manifest:
        specs.append(spec)
        total += spec.nbytes
        if total > chunk_bytes:
            yield specs, total
            specs, total = [], 0
    if specs:
        yield specs, total


class SendSlot:
    """What one transfer sends from, made once and reused by every group: two streams of its own (never
    the training stream; one chunk is copied in on one while the other's is broadcast) and a device
    buffer for each. Fresh streams or buffers per transfer would leave memory behind in the caching
    allocator, which keeps a freed block for the stream that used it."""

    def __init__(self, device_index: int, nbytes: int):
        import torch

        self.nbytes = nbytes
        self.streams = [torch.cuda.Stream(device=device_index) for _ in range(NUM_BUFFERS)]
        self.buffers = [
            torch.empty(nbytes, dtype=torch.uint8, device=tensor_device(device_index)) for _ in range(NUM_BUFFERS)
        ]


class NcclPlane(Plane):
    name = NAME
    pin = True
    tags = True

    def __init__(self, cfg):
        import threading

        super().__init__(cfg)
        self.free: list[SendSlot] = []  # at most weights.max_sends exist: the server lets that many send
        self.lock = threading.Lock()
        self.warmup_streams: list = []  # streams whose communicator warm-up is done, for the next ones

    @classmethod
    def check_learner(cls) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                "config key 'weights.transport' = 'nccl' needs CUDA on the learner and the actors; "
                "on CPUs use gloo or tcp"
            )

    def device_index(self) -> int:
        import torch

        return torch.cuda.current_device()

    def bind(self, device_index: int) -> None:
        import torch

        torch.cuda.set_device(device_index)

    def tag_device(self):
        return tensor_device(self.device_index())

    @classmethod
    def check_announcement(cls, update: WeightUpdate) -> None:
        if len(update.tag_key) != tags.KEY_BYTES or len(update.tags) != len(update.manifest):
            raise ValueError(
                f"weights v{update.version} by nccl: the announcement carries {len(update.tags)} tensor "
                f"tags for {len(update.manifest)} tensors and a {len(update.tag_key)}-byte key (expected "
                f"one each and {tags.KEY_BYTES}): refused, its bytes could not be checked"
            )

    def mint(self, num_workers: int, bucket_bytes: int) -> dict:
        return {
            "uid": base64.b64encode(unique_id()).decode(),
            "world_size": 1 + num_workers,
            "buffer_bytes": bucket_bytes,
        }

    def form(self, spec: dict, timeout_s: float) -> _LearnerGroup:
        """The learner's side of a new group, formed on a thread of its own: NCCL's init waits for
        every rank with no timeout and cannot be cancelled, so an actor that dies before its workers
        join costs one waiting thread, not the connection's (which gives up after `timeout_s`)."""
        import threading

        device, formed = self.device_index(), {}

        def build() -> None:
            self.bind(device)
            stream = self._warmup_stream()
            try:
                formed["comm"] = Abortable(communicator(base64.b64decode(spec["uid"]), 0, spec["world_size"], device))
            except BaseException as err:  # noqa: BLE001 - handed to the connection's thread
                formed["error"] = err
            with self.lock:
                self.warmup_streams.append(stream)  # done with it: the next group's warm-up may run there

        thread = threading.Thread(target=build, name="tidal-nccl-form", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise RuntimeError(
                f"the actor's workers did not form their group within {timeout_s:.0f} s "
                "(weights.tcp_timeout_s); NCCL's init cannot be cancelled, so one thread waits on"
            )
        if "error" in formed:
            raise RuntimeError(f"forming the group failed: {formed['error']}") from formed["error"]
        return _LearnerGroup(formed["comm"], int(spec["buffer_bytes"]))

    def _warmup_stream(self):
        """The current stream for a communicator's warm-up all-reduce (vLLM runs one as it forms one):
        never the training stream, where a peer gone mid-warm-up would stall training for ever; a
        stream of a finished warm-up where there is one, so that formed groups do not each leave a
        block behind in the allocator's pool of a stream of their own."""
        import torch

        with self.lock:
            stream = self.warmup_streams.pop() if self.warmup_streams else torch.cuda.Stream()
        torch.cuda.set_stream(stream)
        return stream

    def send(self, group: _LearnerGroup, served: Served, progress) -> None:
        """Each chunk copied from the page-locked payload into a slot's buffer and broadcast, on one of
        the slot's streams while the other's chunk is in flight."""
        import torch

        plan = list(chunks(served.manifest, group.chunk_bytes))
        slot = self._take(max((total for _, total in plan), default=0))
        try:
            for index, (specs, total) in enumerate(plan):
                stream, buffer = slot.streams[index % NUM_BUFFERS], slot.buffers[index % NUM_BUFFERS]
                stream.synchronize()  # its previous chunk is out: the buffer is free
                progress()
                if group.comm.aborted:
                    return
                with torch.cuda.stream(stream):
                    at = 0
                    for spec in specs:
                        buffer[at : at + spec.nbytes].copy_(
                            served.payload[spec.offset : spec.offset + spec.nbytes], non_blocking=True
                        )
                        at += spec.nbytes
                    group.comm.broadcast(buffer[:total], src=0, stream=stream)
            for stream in slot.streams:
                stream.synchronize()
                progress()
        finally:
            for stream in slot.streams:
                stream.synchronize()  # an aborted transfer's copies end before another transfer reuses the buffers
            with self.lock:
                self.free.append(slot)

    def _take(self, nbytes: int) -> SendSlot:
        """A free slot whose buffers hold `nbytes`; one made (or remade larger) where none does."""
        import torch

        with self.lock:
            slot = self.free.pop() if self.free else None
        if slot is None or slot.nbytes < nbytes:
            del slot  # its buffers go back to the allocator before the larger ones are taken
            slot = SendSlot(torch.cuda.current_device(), nbytes)
        return slot

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
        self.load = StreamedLoad(engine.load_target, engine.model_config)
        self.watchdog: Watchdog | None = None
        self.tagger: tags.Tagger | None = None  # the tags of the version being received
        self.vllm = _vllm_engine_class()(engine.config, engine.vllm_config, engine.device, _Loading(self))
        spec = init.group
        self.vllm.worker_rank = 1 + engine.worker_rank
        self.vllm.init_transfer_engine(
            NCCLWeightTransferInitInfo(
                nccl_unique_id_b64=spec["uid"],
                rank_offset=1,
                world_size=int(spec["world_size"]),
                packed=True,
                packed_buffer_size_bytes=int(spec["buffer_bytes"]),
                packed_num_buffers=NUM_BUFFERS,
            )
        )

    def start(self) -> None:
        self.load.start()

    def receive(self, update: WeightUpdate) -> None:
        """Every tensor received, tagged on its stream as it lands and loaded; then every tag checked
        (one wait for the device). A tensor altered on the way fails the update: the model is torn,
        and the engine serves nothing until a version loads whole and checked."""
        manifest = update.manifest
        info = {
            "names": [s.name for s in manifest],
            "dtype_names": [DTYPE_NAMES[s.dtype] for s in manifest],
            "shapes": [list(s.shape) for s in manifest],
        }
        self.tagger = tags.Tagger(update.tag_key)  # on the device the tensors land on
        try:
            with Watchdog(self.timeout_s, self.vllm.model_update_group.destroy) as self.watchdog:
                self.vllm.receive_weights(self.vllm.parse_update_info(info))
            if self.watchdog.fired:
                raise ConnectionError(
                    f"weights v{update.version}: nothing arrived for {self.timeout_s:.0f} s "
                    "(weights.tcp_timeout_s); the transfer was aborted"
                )
            self._check_tags(update)
        except BaseException:
            self.load.abandon()
            raise
        finally:
            self.watchdog = self.tagger = None

    def _check_tags(self, update: WeightUpdate) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the tags were computed on the receive streams
        got = self.tagger.digests()
        for spec, mine, announced in zip(update.manifest, got, update.tags):
            if mine != announced:
                raise ValueError(
                    f"weights v{update.version} by nccl: tensor {spec.name!r} arrived with tag "
                    f"{mine.hex()[:16]}…, the announcement says {announced.hex()[:16]}…: "
                    "altered on the way"
                )
        if len(got) != len(update.manifest):
            raise ValueError(f"weights v{update.version} by nccl: {len(got)} of {len(update.manifest)} tensors arrived")

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
        weights = list(weights)
        for _, tensor in weights:  # enqueued on the stream it arrived on, before the next receive reuses it
            self.member.tagger.tag(landed(tensor))
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
                self.model_update_group = Abortable(
                    communicator(
                        init_info.nccl_unique_id_bytes,
                        self.worker_rank,
                        init_info.world_size,
                        torch.accelerator.current_device_index(),
                    )
                )

        _engine_class = TidalNcclEngine
    return _engine_class


TRANSPORT = CollectiveTransport(NcclPlane)
