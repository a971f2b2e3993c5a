"""tidal's engine in vLLM's weight-transfer API, registered in every vLLM process by tidal's plugin.
One engine serves every network channel: each update names its transport (`tcp`, `gloo`, `nccl`),
and that channel's module receives and loads it in the worker. So an actor's engine takes updates
from whichever network channel the learner announces, and one engine in the tests covers them all.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

VLLM_BACKEND = "tidal"  # the name the worker-side engine is registered under in vLLM


@dataclass
class InitInfo:
    """Nothing to set up at start: each update names its learner, and a channel that keeps a
    connection forms it on its first update (and again after a failure or a new learner)."""


@dataclass
class UpdateInfo:
    transport: str  # the channel that carries this update: tcp, gloo or nccl
    update: dict  # the WeightUpdate announcement, as plain values
    staged: str = ""  # tcp: the prefetched payload's path; empty: fetch from the learner in the worker
    timeout_s: float = 30.0  # a worker gives up on a learner silent this long


def update_info(transport: str, update, staged: str = "", timeout_s: float = 30.0) -> dict:
    """What `AsyncLLM.update_weights` carries to every worker (UpdateInfo's fields): plain values
    only, as it must serialize."""
    import msgspec

    return {"transport": transport, "update": msgspec.to_builtins(update), "staged": staged, "timeout_s": timeout_s}


def receive(model, model_config, info: UpdateInfo) -> str:
    """In a worker: the update received and loaded by its channel's own means; returns how it loaded."""
    from tidal.broker.weights import TRANSPORTS

    channel = TRANSPORTS.get(info.transport)
    if channel is None or not hasattr(channel, "load_received"):
        known = ", ".join(t for t, m in TRANSPORTS.items() if hasattr(m, "load_received"))
        raise ValueError(f"weight update over {info.transport!r}, which tidal's vLLM engine does not carry "
                         f"(known: {known})")
    return channel.load_received(model, model_config, info)


def prefetch_in_worker(info: dict) -> None:
    """In a worker, before the engine pauses: start receiving the update in the background where its
    channel is the collective one (the tcp channel prefetches in the actor instead)."""
    from tidal.broker.weights import collective

    update = UpdateInfo(**info)
    if update.transport in collective.BACKENDS:
        collective.prefetch(update)


def prefetched_in_worker() -> bool:
    """In a worker: whatever `prefetch_in_worker` began has ended (the load then only loads)."""
    from tidal.broker.weights import collective

    return collective.prefetched()


def load_in_worker(worker, info: dict) -> float:
    """Through tidal's own worker entry point (and the scripted engine of the tests): the same
    update, received and loaded as the weight-transfer engine does it; returns seconds spent."""
    import time

    start = time.perf_counter()
    receive(worker.get_model(), worker.model_config, UpdateInfo(**info))
    return time.perf_counter() - start


class _TidalEngine:
    """The worker side of tidal's network channels in vLLM's weight-transfer API. The load runs
    inside `receive_weights`, once every byte is in hand and checked (vLLM's own engines begin a
    layer-wise reload in `start_weight_update`, but a reload begun and then abandoned would leave
    the model broken)."""

    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        pass  # see the class docstring: nothing may change before the bytes are checked

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        # the base class also synchronizes the accelerator, which raises on a CPU-only machine
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: UpdateInfo) -> None:
        import torch

        receive(self.model, self.model_config, info)
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def shutdown(self) -> None:
        from tidal.broker.weights import collective

        collective.leave()  # the one channel that holds a connection between updates


@functools.cache
def _vllm_engine_class() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return type("TidalWeightTransferEngine", (_TidalEngine, WeightTransferEngine), {"__module__": __name__})


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
