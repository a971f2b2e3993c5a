"""The gloo data plane of the collective weight channel (`weights.transport: gloo`, CPUs): a torch
gloo process group per actor engine, formed over a TCPStore the learner keeps; a version goes out as
its buckets (byte ranges of whole tensors, a crc32 each), and each worker checks and loads every
bucket as it lands. gloo's operations block and raise, so a peer that dies or stalls surfaces as an
error after the group's timeout (weights.tcp_timeout_s). GLOO_SOCKET_IFNAME picks the interface."""
from __future__ import annotations

import datetime
import threading
import uuid
import zlib

from tidal.broker.schema import WeightUpdate
from tidal.broker.weights.base import InitInfo, StreamedLoad
from tidal.broker.weights.collective import CollectiveTransport, Plane
from tidal.broker.weights.payload import in_bucket, tensors_of
from tidal.broker.weights.server import Served

NAME = "gloo"


def new_group(store, name: str, rank: int, world_size: int, timeout_s: float):
    """A gloo process group under `name` in `store`; blocks until every rank is in, or `timeout_s`.
    Built directly, not through init_process_group: the learner's own default group (its training
    ranks) stays untouched."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world_size,
                                 datetime.timedelta(seconds=timeout_s))


def broadcast(group, tensor) -> None:
    """Rank 0's `tensor` into every other rank's; a peer gone or timed out raises RuntimeError."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class _LearnerGroup:
    def __init__(self, group):
        self.group = group

    def abort(self) -> None:
        self.group.abort()


class GlooPlane(Plane):
    name = NAME
    checksums = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.store = None  # the learner's TCPStore, made with its first group
        self.lock = threading.Lock()  # actors join on connection threads of their own, maybe at once

    def mint(self, num_workers: int, bucket_bytes: int) -> dict:
        import torch.distributed as dist

        with self.lock:
            if self.store is None:
                self.store = dist.TCPStore(self.cfg.tcp_host, 0, None, True, wait_for_workers=False,
                                           timeout=datetime.timedelta(seconds=self.cfg.tcp_timeout_s))
        return {"store_port": self.store.port, "group": f"tidal-weights-{uuid.uuid4().hex[:12]}",
                "world_size": 1 + num_workers}

    def form(self, spec: dict, timeout_s: float) -> _LearnerGroup:
        return _LearnerGroup(new_group(self.store, spec["group"], 0, spec["world_size"], timeout_s))

    def send(self, group: _LearnerGroup, served: Served, progress) -> None:
        for bucket in served.buckets:
            broadcast(group.group, served.payload[bucket.offset:bucket.offset + bucket.nbytes])
            progress()

    @classmethod
    def join(cls, engine, init: InitInfo) -> GlooMember:
        import torch.distributed as dist

        from tidal.broker.weights.server import parse_location

        spec = init.group
        host, _ = parse_location(spec["location"])
        store = dist.TCPStore(host, int(spec["store_port"]), None, False,
                              timeout=datetime.timedelta(seconds=init.timeout_s))
        group = new_group(store, spec["group"], 1 + engine.worker_rank, int(spec["world_size"]), init.timeout_s)
        return GlooMember(store, group, StreamedLoad(engine.model, engine.model_config))


class GlooMember:
    """A worker's side of its engine's group: receives each bucket and loads it at once."""

    def __init__(self, store, group, load: StreamedLoad):
        self.store, self.group, self.load = store, group, load

    def start(self) -> None:
        self.load.start()

    def receive(self, update: WeightUpdate) -> None:
        import torch

        try:
            for index, bucket in enumerate(update.buckets):
                buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
                broadcast(self.group, buffer)
                crc = zlib.crc32(buffer.numpy())
                if crc != bucket.crc32:
                    raise ValueError(f"weights v{update.version} bucket {index}: crc32 {crc:08x}, announced "
                                     f"{bucket.crc32:08x}: damaged in transit, refused")
                self.load.load(tensors_of(in_bucket(update.manifest, bucket), buffer, base=bucket.offset))
        except BaseException:
            self.load.abandon()
            raise

    def finish(self) -> None:
        self.load.finish()

    def close(self) -> None:
        self.group.abort()


TRANSPORT = CollectiveTransport(GlooPlane)
