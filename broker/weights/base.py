"""The two sides of a weight channel; each transport's module implements both (and the worker's part).
What every channel's worker side shares sits at the end."""

from __future__ import annotations

import abc
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tidal.broker.schema import TOKEN_BYTES, WeightBucket, WeightUpdate


class WeightPublisher(abc.ABC):
    """Learner side: makes a version's tensors available to the actors."""

    # what the actors serve, and weights travel in (None: as the learner holds them); a tied tensor
    # (lm_head = embed_tokens) travels under each of its names: where vLLM reloads a layer at a time (a
    # quantized or re-packed layer) the LM head is a layer of its own, stale unless its name arrives
    dtype: str | None = None

    @abc.abstractmethod
    def publish(self, named_tensors, version: int, entries=None) -> WeightUpdate:
        """Make the tensors available (a mapping, or (name, tensor) pairs described by `entries` as
        payload.pack takes them); returns the announcement for the broker to carry."""

    def retain(self, version: int) -> None:
        """The actors are told of `version` now: keep it available beyond `keep` until another is. While
        an evaluation holds newer announcements back, the newest `keep` versions may all be newer than the
        one announced, and an actor that still has to load it (one that was away) must find it."""

    def metrics(self) -> dict[str, float]:
        """The channel's counters for the learner's step metrics (none by default)."""
        return {}

    def close(self) -> None:
        """Release what the channel holds for this run (files, sockets, groups)."""


class EngineStuck(RuntimeError):
    """The engine can take no further update: a worker waits inside a call that cannot be cancelled
    (NCCL's initialization, for a learner gone meanwhile). The actor stops, to be restarted."""


@dataclass
class Received:
    """Bytes of weights an actor's channel took in: whole byte ranges, deltas (weights.delta), and the
    ranges whose delta did not rebuild them (the base was not held as named) and came whole after it."""

    whole: int = 0
    delta: int = 0
    refetched: int = 0

    def add(self, other: Received) -> None:
        self.whole += other.whole
        self.delta += other.delta
        self.refetched += other.refetched


class WeightReceiver(abc.ABC):
    """Actor side: brings an announced version into the engine, through vLLM's weight-transfer API.
    `received`, where a channel counts them: the bytes it took in all (its actor's metrics)."""

    received: Received | None = None

    @abc.abstractmethod
    async def apply(self, update: WeightUpdate, engine) -> float:
        """Load `update` into `engine` while its requests in flight wait; returns seconds paused."""


class Transport(abc.ABC):
    """One weight channel: its two sides, and its part inside vLLM's workers (tidal's weight-transfer
    engine, actor/weight_engine.py, asks the registry for it by the update's transport)."""

    name: str

    @abc.abstractmethod
    def publisher(self, cfg, incarnation: str, dtype: str | None, owns_dir: bool = False) -> WeightPublisher:
        """The learner's side; weights travel in `dtype` (None: as they are). `owns_dir`: weights.dir
        is the run's own folder, to be removed when the publisher closes (a channel that writes one)."""

    @abc.abstractmethod
    def receiver(self, cfg) -> WeightReceiver:
        """The actor's side."""

    def join(self, engine, init: InitInfo):
        """In a worker: form this channel's group with the learner (InitInfo.group), returning the
        member that receives every later update into the model; None where the channel keeps none."""
        return None

    def load(self, model, model_config, info: UpdateInfo) -> str:
        """In a worker, for a channel without a group: load one update, every byte of it in hand and
        checked first; returns how it loaded."""
        raise ValueError(
            f"weights over {self.name!r} arrive through a group formed beforehand "
            "(init_weight_transfer_engine with its spec): none is formed"
        )


@dataclass
class InitInfo:
    """What `AsyncLLM.init_weight_transfer_engine` carries to every worker: the channel of the updates
    that follow, and for a collective channel the group to form with the learner (its spec)."""

    transport: str = ""
    group: dict = field(default_factory=dict)
    timeout_s: float = 30.0  # a worker gives up on a learner silent this long
    adapter: bool = False  # the updates are a LoRA adapter's tensors (adapter.py), not the model's


@dataclass
class UpdateInfo:
    """What `AsyncLLM.update_weights` carries to every worker (plain values: it must serialize)."""

    transport: str  # the channel that carries this update
    update: dict  # the WeightUpdate announcement, as plain values
    staged: str = ""  # tcp: the prefetched payload's path; file: the actor's checked copy; empty: fetch in the worker
    timeout_s: float = 30.0  # a worker gives up on a learner silent this long
    delta: bool = False  # tcp, fetching in the worker: keep the version fetched, a base for the next (weights.delta)


def update_info(
    transport: str, update: WeightUpdate, staged: str = "", timeout_s: float = 30.0, delta: bool = False
) -> dict:
    import msgspec

    return {
        "transport": transport,
        "update": msgspec.to_builtins(update),
        "staged": staged,
        "timeout_s": timeout_s,
        "delta": delta,
    }


def check_transport(update: WeightUpdate, expected: str) -> None:
    if update.transport != expected:
        raise ValueError(f"weights v{update.version} came by {update.transport!r}; this actor takes {expected!r}")


def check_token(update: WeightUpdate) -> None:
    """A network channel's announcement must carry the token its learner's weight port asks for."""
    if len(update.token) != TOKEN_BYTES:
        raise ValueError(
            f"weights v{update.version}: the announcement carries no token for the learner's weight "
            f"port ({len(update.token)} bytes, expected {TOKEN_BYTES}): refused"
        )


# ---- integrity: a sha256 per byte range (never one hash of a multi-GB whole) --------------------
# The digests are announced over the broker, whose peers are authenticated; a checksum (crc32) would
# let whoever writes the weights folder or sits on the data path alter bytes and keep it matching.


def digest(data) -> bytes:
    """The sha256 of `data` (bytes-like); hashlib lets go of the GIL while it hashes a large buffer."""
    return hashlib.sha256(data).digest()


def split_buckets(payload: memoryview, bucket_bytes: int) -> list[WeightBucket]:
    """`payload` cut into ranges of `bucket_bytes`, each with the sha256 of its bytes."""
    return [
        WeightBucket(
            offset=start,
            nbytes=len(payload[start : start + bucket_bytes]),
            sha256=digest(payload[start : start + bucket_bytes]),
        )
        for start in range(0, len(payload), bucket_bytes)
    ]


def digest_problem(data, bucket: WeightBucket, index: int) -> str | None:
    """What is wrong with `data`, the bytes of range `index`, against its announced digest, or None."""
    got = digest(data)
    if got == bucket.sha256:
        return None
    return (
        f"bytes [{bucket.offset}, {bucket.offset + bucket.nbytes}) (range {index}) have sha256 "
        f"{got.hex()[:16]}…, the announcement says {bucket.sha256.hex()[:16]}…: altered or damaged"
    )


def bucket_problem(payload: memoryview, update: WeightUpdate) -> str | None:
    """What is wrong with `payload` against the announced ranges (the first range whose sha256 differs),
    or None. Ranges are checked on several threads (hashlib lets go of the GIL). Returned, not raised:
    a traceback would keep `payload`, a view of the caller's map, from being released."""
    covered = sum(b.nbytes for b in update.buckets)
    if covered != len(payload):
        return f"{len(payload)} bytes, the announced ranges cover {covered}"
    with ThreadPoolExecutor(max_workers=4) as pool:
        problems = pool.map(
            lambda ib: digest_problem(payload[ib[1].offset : ib[1].offset + ib[1].nbytes], ib[1], ib[0]),
            enumerate(update.buckets),
        )
        return next((p for p in problems if p is not None), None)


# ---- inside vLLM's workers ----------------------------------------------------------------------

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def weight_layout(model) -> str:
    """ "reload" where loading a checkpoint's tensors is not a copy into the parameters: a kernel has
    moved some parameter's weights into a layout of its own and left the parameter empty (the CPU
    backend's packed linear layers), or a quantization method post-processes what is loaded (fp8
    and the like: raw weights copied in place would be served as they are); else "copy"."""
    if any(param.numel() == 0 for param in model.parameters()):
        return "reload"
    return "reload" if any(post_processed(module) for module in model.modules()) else "copy"


def post_processed(module) -> bool:
    """Whether a vLLM layer rewrites its weights after loading them: a quantization method's doing, or
    vLLM's CPU backend packing an unquantized MoE layer's experts for its grouped GEMM."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return False
    return not type(method).__name__.startswith("Unquantized") or cpu_packed_experts(module)


def cpu_packed_experts(module) -> bool:
    weight = getattr(module, "w13_weight", None)
    return weight is not None and weight.device.type == "cpu"


def begin_reload(model) -> None:
    """vLLM's layer-wise reload, begun: every layer's loads are buffered until it has them all, then
    processed as at start-up. vLLM's CPU backend packs a MoE layer's experts only when it first builds
    the layer's kernel and treats a reload as an update in place, so that kernel is let go first."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    for module in model.modules():
        if cpu_packed_experts(module) and hasattr(module.quant_method, "moe_kernel"):
            module.quant_method.moe_kernel = None
    initialize_layerwise_reload(model)


class StreamedLoad:
    """One version loaded piece by piece as its bytes arrive (the collective channels), into the
    model's own storage: by copies where they serve, else inside one layer-wise reload. Nothing of
    the version is held beyond the piece in hand, so a transfer that fails part-way leaves the model
    torn (some layers new, some old): `abandon` puts the reload's bookkeeping back, and the actor
    serves nothing from the model until a whole version has loaded."""

    def __init__(self, model, model_config):
        self.model, self.model_config = model, model_config
        self.reload = False
        self.loaded: set[str] = set()
        self.aliases: set[str] = set()  # a tied parameter's second name (lm_head.weight = the embedding)

    def start(self) -> None:
        quiet_harmless_reload_warnings()
        self.reload, self.loaded = weight_layout(self.model) == "reload", set()
        if self.reload:
            begin_reload(self.model)
        else:
            every = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
            self.aliases = every - {name for name, _ in self.model.named_parameters()}

    def load(self, weights) -> None:
        """One piece. Copied in place, a tied parameter is loaded under its first name and its alias
        dropped: vLLM refuses an alias whose first name is not in the same piece. Reloaded layer by
        layer, the alias is the LM head's own weight, a layer of its own, and goes in."""
        if self.aliases:
            weights = [(name, tensor) for name, tensor in weights if name not in self.aliases]
        loaded = self.model.load_weights(weights)
        self.loaded |= set(loaded or ())

    def finish(self) -> None:
        if self.reload:
            self._finalize()
            return
        missing = sorted({name for name, _ in self.model.named_parameters()} - self.loaded)
        if missing:  # the learner sends every tensor: a short update is a bug, and must not pass quietly
            raise ValueError(
                f"the weight update left {len(missing)} parameters of the engine's model unloaded "
                f"(e.g. {missing[:3]}); the engine now mixes two versions"
            )

    def abandon(self) -> None:
        if self.reload:
            self._finalize()

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self.reload = False
        finalize_layerwise_reload(self.model, self.model_config)


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
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        begin_reload(model)
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
        raise ValueError(
            f"the weight update left {len(missing)} parameters of the engine's model unloaded "
            f"(e.g. {missing[:3]}); the engine now mixes two versions"
        )
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
                into_model = (
                    bool(args) and isinstance(args[0], torch.Tensor) and args[0].untyped_storage().data_ptr() in targets
                )
                if (
                    into_model
                    and func is torch.ops.aten.copy_.default
                    and args[1].untyped_storage().data_ptr() == source
                ):
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
