"""NCCL's semantics on CPU, for the unit tier: what a GPU run does that gloo hides.

    streams        work enqueued on a stream runs later, in order, on a thread of the stream's own;
                   the host waits only where told (synchronize), and a stream waits for another only
                   where told (wait_stream, wait_event, a ProcessGroup Work's wait())
    devices        the current device is per host thread, and a new thread starts on device 0
    communicators  a collective completes once every rank has issued it, some milliseconds later; a
                   rank that never issues it (dead, stalled) leaves the others waiting forever, with no
                   error, until their communicator is aborted (destroy()); an aborted communicator's ops
                   end at once and carry nothing
    reads          tensors live in host memory, so the one thing that can tell an ordered read from a
                   racy one is the reader: `read(tensor)` (the fake models call it) waits for a pending
                   write into the tensor only if the reading thread's current stream is ordered after
                   it, and otherwise reads whatever is there now

`installed()` puts the stream and device parts in place of torch.cuda's and torch.accelerator's for
the duration of a test (torch is the CPU build here, so nothing real is displaced); the
communicators replace vLLM's PyNcclCommunicator where tidal creates one (`communicator`,
`unique_id`). Every wait is bounded by SAFETY_S so that a test that hangs fails instead.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

SAFETY_S = 60.0  # no wait in a test lasts longer: a hang becomes a failure
# Work lands lazily: as soon as something ordered after it waits for it (a synchronize, an ordered
# read), else after this long. A read that nothing orders after the work therefore sees the old bytes.
LAND_AFTER_S = 1.0
# vLLM's destroy() marks its communicator disabled only once ncclCommAbort returns, on a thread of its
# own: a collective issued in between reaches a communicator being torn down (on a GPU: undefined).
DISABLED_AFTER_S = 0.5
misuse: list[str] = []  # collectives issued on an aborted communicator that vLLM had not disabled yet
disabling: list[threading.Thread] = []  # aborts still inside their window; `settle()` waits them out


class FakeTimeout(AssertionError):
    """A wait that NCCL would have let hang for ever."""


def _wait(op: Op, what: str) -> None:
    _demand(op)
    if not op.landed.wait(SAFETY_S):
        raise FakeTimeout(f"fake NCCL: {what} still waiting after {SAFETY_S:.0f} s (on a GPU: for ever)")


def _demand(op: Op) -> None:
    """Someone waits for `op`: it, everything before it on its stream and everything it waits for may land."""
    todo = [op]
    while todo:
        item = todo.pop()
        if item.demanded.is_set():
            continue
        item.demanded.set()
        todo.extend(item.stream.ops[: item.seq])
        todo.extend(item.waits_for)


# ---- devices and streams ------------------------------------------------------------------------

_all_streams: list = []  # every stream made while installed, for torch.cuda.synchronize

_tls = threading.local()  # .device: this thread's current device; .streams: {device: current stream}


def current_device() -> int:
    return getattr(_tls, "device", 0)  # a new thread starts on device 0, whatever its parent ran on


def set_device(device) -> None:
    _tls.device = _index(device)


def _index(device) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    return device.index if device.index is not None else current_device()


@dataclass(eq=False)
class Op:
    stream: FakeStream
    seq: int
    waits_for: list[Op]  # what the stream was told to wait for when this op was enqueued
    body: object = None  # callable run on the stream's thread, or None (a marker)
    writes: torch.Tensor | None = None  # the tensor this op fills, for `read`
    landed: threading.Event = field(default_factory=threading.Event)
    demanded: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class FakeStream:
    """A CUDA stream: ops run on its own thread in the order they were enqueued."""

    _default: dict[int, FakeStream] = {}  # the legacy default stream of each device, shared by threads

    def __init__(self, device=None, priority: int = 0, **_):
        self.device_index = _index(device)
        self.device = torch.device("cuda", self.device_index)  # what torch's StreamContext compares
        self.ops: list[Op] = []
        self.waiting: list[Op] = []  # ops of other streams this one must wait for, from now on
        self.lock = threading.Lock()
        self.queue: queue.Queue = queue.Queue()
        _all_streams.append(self)
        threading.Thread(target=self._run, name=f"fake-stream-{id(self):x}", daemon=True).start()

    def _run(self) -> None:
        while (op := self.queue.get()) is not None:  # None: the fake was uninstalled, the thread ends
            try:
                for dep in op.waits_for:
                    _wait(dep, "a stream waiting for another")
                if op.body is not None:
                    op.body(op)
            except BaseException as err:  # surfaces late: where someone looks
                op.error = err
            op.landed.set()

    def enqueue(self, body=None, writes: torch.Tensor | None = None) -> Op:
        """`body(op)` runs on the stream's thread once the ops before it and those it waits for landed."""
        with self.lock:
            op = Op(self, len(self.ops), list(self.waiting), body, writes)
            self.ops.append(op)
        self.queue.put(op)
        return op

    def last(self) -> Op:
        return self.enqueue()  # a marker: lands once everything before it has

    # torch.cuda.Stream's API
    def synchronize(self) -> None:
        _wait(self.last(), "Stream.synchronize")

    def wait_stream(self, other: FakeStream) -> None:
        if other is not self:
            marker = other.last()
            with self.lock:
                self.waiting.append(marker)

    def wait_event(self, event: FakeEvent) -> None:
        if event.op is not None:
            with self.lock:
                self.waiting.append(event.op)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return all(op.landed.is_set() for op in list(self.ops))

    def ordered_after(self, op: Op) -> bool:
        """Whether work enqueued on this stream now runs after `op` lands."""
        if op.stream is self:
            return True
        return any(dep.stream is op.stream and dep.seq >= op.seq for dep in list(self.waiting))

    @property
    def cuda_stream(self) -> int:
        return id(self)


class FakeEvent:
    def __init__(self, *_, **__):
        self.op: Op | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.op = (stream or current_stream()).last()

    def synchronize(self) -> None:
        if self.op is not None:
            _wait(self.op, "Event.synchronize")

    def query(self) -> bool:
        return self.op is None or self.op.landed.is_set()

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or current_stream()).wait_event(self)


def default_stream(device=None) -> FakeStream:
    index = _index(device)
    if index not in FakeStream._default:
        FakeStream._default[index] = FakeStream(index)
    return FakeStream._default[index]


def current_stream(device=None) -> FakeStream:
    index = _index(device)
    streams = getattr(_tls, "streams", None)
    if streams is None:
        streams = _tls.streams = {}
    return streams.get(index) or default_stream(index)


def set_stream(stream: FakeStream | None) -> None:
    if stream is None:
        return
    if not hasattr(_tls, "streams"):
        _tls.streams = {}
    _tls.streams[stream.device_index] = stream
    _tls.device = stream.device_index  # as torch's setStream: the stream's device becomes current


@contextlib.contextmanager
def stream_context(stream: FakeStream | None):
    if stream is None:
        yield
        return
    device, previous = current_device(), current_stream(stream.device_index)
    set_stream(stream)
    try:
        yield
    finally:
        set_stream(previous)
        set_device(device)


@contextlib.contextmanager
def device_context(device):
    previous = current_device()
    set_device(device)
    try:
        yield
    finally:
        set_device(previous)


def synchronize(device=None) -> None:
    index = _index(device) if device is not None else None
    for s in list(_all_streams):
        if index is None or s.device_index == index:
            s.synchronize()


def read(tensor: torch.Tensor) -> torch.Tensor:
    """What a kernel on this thread's current stream reads from `tensor`: a pending write into it
    is waited for when that stream is ordered after the write, else the bytes are read as they are."""
    reader = current_stream()
    start = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
    end = start + tensor.numel() * tensor.element_size()
    for op in list(_pending_writes):
        target = op.writes
        t_start = target.untyped_storage().data_ptr() + target.storage_offset() * target.element_size()
        t_end = t_start + target.numel() * target.element_size()
        if t_start < end and start < t_end and not op.landed.is_set() and reader.ordered_after(op):
            _wait(op, "a read ordered after a receive")
    return tensor.clone()


_pending_writes: list[Op] = []


def write_later(stream: FakeStream, into: torch.Tensor, source: torch.Tensor) -> None:
    """A copy of `source` into `into` enqueued on `stream`, landing lazily like any other work."""
    _pending_writes.append(stream.enqueue(lambda op: (op.demanded.wait(LAND_AFTER_S), into.copy_(source)), writes=into))


# ---- communicators (vLLM's PyNcclCommunicator's API) --------------------------------------------


class _Rendezvous:
    """Matches the n-th collective of every rank of one communicator group and moves its data once,
    for every rank, when the first of them is waited for."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.lock = threading.Lock()
        self.calls: dict[int, dict[int, tuple]] = {}  # seq -> rank -> (kind, tensor, out, src)
        self.complete: dict[int, threading.Event] = {}
        self.moved: set[int] = set()

    def arrive(self, seq: int, rank: int, call: tuple, comm: FakeCommunicator, op: Op) -> bool:
        """False when `comm` was aborted before the collective completed."""
        with self.lock:
            self.calls.setdefault(seq, {})[rank] = call
            complete = self.complete.setdefault(seq, threading.Event())
            if len(self.calls[seq]) == self.world_size:
                complete.set()
        deadline = time.monotonic() + SAFETY_S * 2
        while not complete.wait(0.01):  # NCCL spins until every rank is there, or its comm is aborted
            if comm.aborted:
                return False
            if time.monotonic() > deadline:
                raise FakeTimeout("fake NCCL: a collective never matched")
        op.demanded.wait(LAND_AFTER_S)
        with self.lock:
            if seq not in self.moved:
                self.moved.add(seq)
                self._move(self.calls[seq])
        return True

    @staticmethod
    def _move(calls: dict[int, tuple]) -> None:
        kind = next(iter(calls.values()))[0]
        if kind == "broadcast":
            src = next(iter(calls.values()))[3]
            for rank, (_, tensor, _, _) in calls.items():
                if rank != src:
                    tensor.copy_(calls[src][1])
        else:  # all_reduce (sum)
            total = sum(tensor.clone() for _, tensor, _, _ in calls.values())
            for _, _, out, _ in calls.values():
                out.copy_(total)


_groups: dict[bytes, _Rendezvous] = {}
_groups_lock = threading.Lock()


def unique_id() -> bytes:
    return os.urandom(128)


class FakeCommunicator:
    """One rank of an NCCL communicator: collectives are enqueued on a stream and complete later."""

    def __init__(self, uid: bytes, rank: int, world_size: int, device=None):
        with _groups_lock:
            self.group = _groups.setdefault(uid, _Rendezvous(world_size))
        self.rank, self.world_size = rank, world_size
        self.device_index = _index(device)
        self.device = torch.device("cpu")  # where its tensors live in this fake
        self.seq = 0
        self.aborted = self.disabled = False
        self.num_ops = 0
        # as PyNcclCommunicator: a one-element all-reduce once every rank is in, and the host waits for it
        warm = torch.zeros(1)
        self.all_reduce(warm, stream=current_stream(self.device_index))
        current_stream(self.device_index).synchronize()

    def _issue(self, call: tuple, stream) -> None:
        if self.disabled:
            return  # as PyNcclCommunicator once destroyed: nothing happens, nothing is raised
        if self.aborted:
            misuse.append(f"rank {self.rank}: a {call[0]} issued while its communicator was being aborted")
            return
        stream = stream if stream is not None else current_stream()
        if stream.device_index != self.device_index:
            raise RuntimeError(
                f"NCCL: a collective of a communicator on cuda:{self.device_index} enqueued on a "
                f"stream of cuda:{stream.device_index} (invalid usage)"
            )
        seq, self.seq = self.seq, self.seq + 1
        self.num_ops += 1
        _pending_writes.append(
            stream.enqueue(lambda op: self.group.arrive(seq, self.rank, call, self, op), writes=call[2])
        )

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        self._issue(("broadcast", tensor, tensor, src), stream)

    def all_reduce(self, in_tensor, out_tensor=None, op=None, stream=None):
        out = in_tensor if out_tensor is None else out_tensor
        self._issue(("all_reduce", in_tensor, out, None), stream)
        return out

    def destroy(self) -> None:
        """ncclCommAbort: this rank's pending collectives end at once, carrying nothing; as vLLM's
        destroy, the communicator counts as disabled only DISABLED_AFTER_S later."""
        if self.aborted:
            return
        self.aborted = True

        def disable():
            time.sleep(DISABLED_AFTER_S)
            self.disabled = True

        thread = threading.Thread(target=disable, daemon=True)
        disabling.append(thread)
        thread.start()


def settle() -> None:
    """Returns once every aborted communicator is disabled: a side still sending after an abort has
    been seen (in `misuse`) by then. Without an abort there is no window to wait out."""
    while disabling:
        disabling.pop().join()


def communicator(uid: bytes, rank: int, world_size: int, device) -> FakeCommunicator:
    return FakeCommunicator(uid, rank, world_size, device)


# ---- installing it ---------------------------------------------------------------------------------


@contextlib.contextmanager
def installed(monkeypatch=None):
    """torch.cuda's and torch.accelerator's stream and device calls replaced by the fake's; restored after."""
    patches = {
        (torch.cuda, "Stream"): FakeStream,
        (torch.cuda, "Event"): FakeEvent,
        (torch.cuda, "stream"): stream_context,
        (torch.cuda, "current_stream"): current_stream,
        (torch.cuda, "default_stream"): default_stream,
        (torch.cuda, "set_stream"): set_stream,
        (torch.cuda, "set_device"): set_device,
        (torch.cuda, "current_device"): current_device,
        (torch.cuda, "device"): device_context,
        (torch.cuda, "synchronize"): synchronize,
        (torch.accelerator, "current_device_index"): current_device,
        (torch.accelerator, "set_device_index"): set_device,
        (torch.accelerator, "device_index"): device_context,
        (torch.accelerator, "synchronize"): synchronize,
    }
    saved = {key: getattr(*key) for key in patches}
    _clear_vllm_stream_cache()
    _tls.__dict__.clear()  # this thread starts on device 0 with its default stream, as a new process would
    for (module, name), value in patches.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
        _clear_vllm_stream_cache()
        _tls.__dict__.clear()
        _pending_writes.clear()
        _groups.clear()
        misuse.clear()
        FakeStream._default.clear()
        for stream in _all_streams:
            stream.queue.put(None)
        _all_streams.clear()


def _clear_vllm_stream_cache() -> None:
    """vLLM caches its packed transfer's streams per device: none made under the fake outlives it."""
    import sys

    packed = sys.modules.get("vllm.distributed.weight_transfer.packed_tensor")
    if packed is not None:
        packed._get_streams.cache_clear()
