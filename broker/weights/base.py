"""The two sides of a weight channel; each transport's module implements both (and the worker's part).
What every channel's worker side shares sits at the end."""
from __future__ import annotations

import abc
import logging
import zlib
from concurrent.futures import ThreadPoolExecutor

from tidal.broker.schema import WeightBucket, WeightUpdate


class WeightPublisher(abc.ABC):
    """Learner side: makes a version's tensors available to the actors."""

    @abc.abstractmethod
    def publish(self, named_tensors: dict, version: int) -> WeightUpdate:
        """Make the tensors available; returns the announcement for the broker to carry."""

    def close(self) -> None:
        """Release what the channel holds for this run (files, sockets)."""


class WeightReceiver(abc.ABC):
    """Actor side: brings an announced version into the engine."""

    vllm_backend: str | None = None  # the vLLM weight-transfer engine this channel loads through, if any

    @abc.abstractmethod
    async def apply(self, update: WeightUpdate, engine) -> float:
        """Load `update` into `engine` while its requests in flight wait; returns seconds paused."""


# ---- integrity: a crc32 per byte range (never one hash of a multi-GB whole) ---------------------

def split_buckets(payload: memoryview, bucket_bytes: int) -> list[WeightBucket]:
    """`payload` cut into ranges of `bucket_bytes`, each with the crc32 of its bytes."""
    return [WeightBucket(offset=start, nbytes=len(payload[start:start + bucket_bytes]),
                         crc32=zlib.crc32(payload[start:start + bucket_bytes]))
            for start in range(0, len(payload), bucket_bytes)]


def bucket_problem(payload: memoryview, update: WeightUpdate) -> str | None:
    """What is wrong with `payload` against the announced ranges (the first range whose crc32 differs),
    or None. Ranges are checked on several threads (zlib lets go of the GIL). Returned, not raised:
    a traceback would keep `payload`, a view of the caller's map, from being released."""
    covered = sum(b.nbytes for b in update.buckets)
    if covered != len(payload):
        return f"{len(payload)} bytes, the announced ranges cover {covered}"
    with ThreadPoolExecutor(max_workers=4) as pool:
        crcs = list(pool.map(lambda b: zlib.crc32(payload[b.offset:b.offset + b.nbytes]), update.buckets))
    for i, (bucket, crc) in enumerate(zip(update.buckets, crcs)):
        if crc != bucket.crc32:
            return (f"bytes [{bucket.offset}, {bucket.offset + bucket.nbytes}) (range {i}) have crc32 {crc:08x}, "
                    f"the announcement says {bucket.crc32:08x}: damaged")
    return None


# ---- inside vLLM's workers ----------------------------------------------------------------------

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _RotaryReloadFilter(logging.Filter):
    """On every weight reload vLLM warns "RotaryEmbedding: Failed to load weights" once per layer:
    the rotary cos/sin cache is a buffer computed from the config, never in a checkpoint, and vLLM
    puts the computed one back. The warning says nothing wrong and would fill the actor's log
    (one per layer per update); the same warning for any other layer is a real problem and stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


def quiet_harmless_reload_warnings() -> None:
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _RotaryReloadFilter) for f in logger.filters):
        logger.addFilter(_RotaryReloadFilter())
