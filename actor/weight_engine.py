"""tidal's engine in vLLM's weight-transfer API, registered in every vLLM process by tidal's plugin:
every weight channel enters vLLM the same way, through `AsyncLLM.init_weight_transfer_engine` (the
channel, and a collective channel's group) and `start_weight_update` / `update_weights` /
`finish_weight_update` per version. The registry (`TRANSPORTS`) says what each channel does here:
file and tcp load a whole version, checked first; gloo and nccl receive through the group formed
at init (nccl with vLLM's own NCCL engine) and load each piece as it lands.
"""

from __future__ import annotations

import functools

VLLM_BACKEND = "tidal"  # the name the worker-side engine is registered under in vLLM


class WorkerEngine:
    """The worker's side of every weight channel. vLLM builds it (mixed with its WeightTransferEngine
    base) in each worker; the unit tests build it around a scripted model."""

    def init_engine(self, model, model_config, device=None, config=None, vllm_config=None) -> None:
        self.model, self.model_config, self.device = model, model_config, device
        self.config, self.vllm_config = config, vllm_config
        self.transport = ""
        self.member = None  # a collective channel's side of the group, while one is formed
        self.stash = None  # serving a LoRA adapter: its versions as they arrive (tidal.actor.adapter.AdapterStash)

    @property
    def load_target(self):
        """What the channels load an update into: the model, or an adapter's stash."""
        return self.stash if self.stash is not None else self.model

    @property
    def worker_rank(self) -> int:
        """This worker's rank among its engine's workers (tensor x pipeline parallel)."""
        return self.vllm_config.parallel_config.rank if self.vllm_config is not None else 0

    def init_transfer_engine(self, init_info) -> None:
        from tidal.broker.weights import transport

        self.leave()
        self.transport = init_info.transport
        if init_info.adapter:
            self.adapter_stash()
        if init_info.group:
            self.member = transport(init_info.transport).join(self, init_info)

    def adapter_stash(self):
        """The adapter's versions as they arrive (tidal.actor.adapter.AdapterStash), made once and kept across channels
        and learners: its versions stay."""
        from tidal.actor.adapter import AdapterStash

        if self.stash is None:
            self.stash = AdapterStash()
        return self.stash

    @functools.cached_property
    def served_adapters(self):
        """What adapters this worker's model serves (tidal.actor.adapter.Served), read once its LoRA layers
        are in place; None outside vLLM (a scripted model) or without LoRA."""
        from tidal.actor.adapter import Served

        lora = getattr(self.vllm_config, "lora_config", None)
        return Served.of(self.model, lora.max_lora_rank) if lora is not None else None

    def start_weight_update(self) -> None:
        if self.member is not None:
            self.member.start()

    def finish_weight_update(self) -> None:
        if self.member is not None:
            self.member.finish()

    def update_weights(self, update_info: dict) -> None:
        # the base class also synchronizes the accelerator, which raises on a CPU-only machine
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info) -> None:
        import msgspec
        import torch

        from tidal.broker.schema import WeightUpdate
        from tidal.broker.weights import transport

        channel, update = transport(info.transport), msgspec.convert(info.update, WeightUpdate)
        if self.stash is not None:
            self.stash.begin(update, self.served_adapters)
        elif update.adapter is not None:
            raise ValueError(
                f"weights v{update.version} are a LoRA adapter, but this engine started without LoRA "
                "(learner.lora.rank was 0 for the actor): restart the actor with the run's config"
            )
        if self.member is not None and info.transport == self.transport:
            self.member.receive(update)
        else:
            channel.load(self.load_target, self.model_config, info)
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
        if self.stash is not None:
            self.stash.received()

    def leave(self) -> None:
        member, self.member = self.member, None
        if member is not None:
            member.close()

    def shutdown(self) -> None:
        self.leave()


def install_adapter(worker) -> int:
    """In a vLLM worker serving a LoRA adapter: the newest version received whole (a zero adapter before
    the first) into vLLM's LoRA manager; the version installed (-1: zeros)."""
    # the zero adapter at start comes before any weight channel is set up: the stash may be new here
    return worker.weight_transfer_engine.adapter_stash().install(worker.model_runner.lora_manager)


def build_engine(model, model_config, device=None, vllm_config=None) -> WorkerEngine:
    """The worker's side around a model outside vLLM (the scripted engines of the tests)."""
    from tidal.broker.weights import InitInfo, UpdateInfo

    engine = type(
        "ScriptedWorkerEngine",
        (WorkerEngine,),
        {
            "parse_init_info": staticmethod(lambda info: InitInfo(**info)),
            "parse_update_info": staticmethod(lambda info: UpdateInfo(**info)),
        },
    )()
    engine.init_engine(model, model_config, device, vllm_config=vllm_config)
    return engine


@functools.cache
def _vllm_engine_class() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from tidal.broker.weights import InitInfo, UpdateInfo

    class TidalWeightTransferEngine(WorkerEngine, WeightTransferEngine):
        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model):
            WeightTransferEngine.__init__(self, config, vllm_config, device, model)
            self.init_engine(model, self.model_config, device, config, vllm_config)

    TidalWeightTransferEngine.__module__ = __name__
    return TidalWeightTransferEngine


def __getattr__(name: str):
    # vLLM imports the engine class by name; it is built on first use so the learner never imports vLLM
    if name == "TidalWeightTransferEngine":
        return _vllm_engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_vllm_engine() -> None:
    """Called by tidal's vLLM plugin in each of vLLM's processes; the engine class is imported only
    where vLLM creates one (in the workers)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(VLLM_BACKEND, __name__, "TidalWeightTransferEngine")
    except ValueError:
        pass  # registered already: vLLM may load the plugins of one process twice
