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


def weight_layout(model) -> str:
    """"reload" where a kernel has moved some parameter's weights into a layout of its own and left
    the parameter empty, else "copy"."""
    return "reload" if any(param.numel() == 0 for param in model.parameters()) else "copy"


def load_into_model(model, weights, model_config, payload=None, key=None) -> str:
    """Load one version's (name, tensor) pairs into a vLLM model in place; returns how ("reload",
    "copy" or "replay"). Where every parameter still holds its weights as loaded (GPU backends;
    the CPU one with actor.vllm.cpu_linear: plain) the model's own `load_weights` copies them in;
    when the tensors are views of one `payload` laid out as `key` says, those copies are recorded
    once and replayed for later versions of the same layout. Where a kernel has re-laid a layer's
    weight out in a layout of its own and left the parameter empty (the CPU backend's packed
    linear layers), only the layer-wise reload can rebuild it."""
    global _plan
    quiet_harmless_reload_warnings()
    if weight_layout(model) == "reload":
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(model)
        model.load_weights(weights)
        finalize_layerwise_reload(model, model_config)
        return "reload"
    if payload is not None and _plan is not None and _plan.key == key and _plan.replay(model, payload):
        return "replay"
    expected = {name for name, _ in model.named_parameters()}
    if payload is None:
        loaded = model.load_weights(weights)
    else:
        loaded, _plan = CopyPlan.record(model, weights, payload, key)
    missing = sorted(expected - set(expected if loaded is None else loaded))
    if missing:  # the learner sends every tensor: a short update is a bug, and must not pass quietly
        _plan = None
        raise ValueError(f"the weight update left {len(missing)} parameters of the engine's model unloaded "
                         f"(e.g. {missing[:3]}); the engine now mixes two versions")
    return "copy"


class CopyPlan:
    """The copies a model's `load_weights` makes from one payload's layout into its parameters
    (slices of a fused qkv or gate-up weight included), recorded as they happen and replayed for
    later versions: the same bytes move, without the loader's Python per tensor. Recorded only
    when every change the loader makes is such a copy from the payload or a constant fill (an
    embedding's padded rows); any other in-place op leaves the model to its own loader."""

    def __init__(self, key, model, copies: list):
        self.key = key
        self.params = [p.data_ptr() for p in model.parameters()]  # a parameter moved elsewhere: plan void
        # in the loader's order, (destination view, source): the source is (dtype, offset in its
        # elements, shape, stride) of a payload view, or a constant the loader filled in
        self.copies = copies

    @classmethod
    def record(cls, model, weights, payload, key) -> tuple[set | None, CopyPlan | None]:
        """(what `load_weights` returns, the plan or None) from loading `weights`, views of `payload`."""
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        source = payload.untyped_storage().data_ptr()
        targets = {p.untyped_storage().data_ptr() for p in model.parameters()}
        copies, other = [], []

        class Recorder(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                into_model = bool(args) and isinstance(args[0], torch.Tensor) \
                    and args[0].untyped_storage().data_ptr() in targets
                if into_model and func is torch.ops.aten.copy_.default \
                        and args[1].untyped_storage().data_ptr() == source:
                    src = args[1]
                    copies.append((args[0], (src.dtype, src.storage_offset(), tuple(src.shape), tuple(src.stride()))))
                elif into_model and func is torch.ops.aten.fill_.Scalar:  # e.g. an embedding's padded rows
                    copies.append((args[0], args[1]))
                elif func._schema.is_mutable:
                    other.append(func)
                return func(*args, **(kwargs or {}))

        with Recorder():
            loaded = model.load_weights(weights)
        usable = copies and not other and payload.storage_offset() == 0
        return loaded, cls(key, model, copies) if usable else None

    def replay(self, model, payload) -> bool:
        """The recorded copies from `payload`; False (nothing done) if the parameters have moved."""
        if [p.data_ptr() for p in model.parameters()] != self.params or payload.storage_offset() != 0:
            return False
        typed = {}
        for target, source in self.copies:
            if not isinstance(source, tuple):
                target.fill_(source)
                continue
            dtype, offset, shape, stride = source
            if dtype not in typed:
                typed[dtype] = payload.view(dtype)
            target.copy_(typed[dtype].as_strided(shape, stride, offset))
        return True


_plan: CopyPlan | None = None  # in a vLLM worker: the newest layout's plan (one model per worker)


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
