"""Runs inside vLLM's processes: the plugin vLLM loads in each of them, and the worker's entry point
for a weight update.

Tensors cannot travel through `collective_rpc` in multiprocess mode (they do not pickle), so
each weight channel sends only what its worker side needs (a file path, an address) and loads
the tensors itself (`tidal.broker.weights.base.load_into_model`).
"""
from __future__ import annotations

import logging
import os

from tidal.broker.weights.base import RELOAD_LOGGER, quiet_harmless_reload_warnings, weight_layout

__all__ = ["CPU_LINEAR_ENV", "RELOAD_LOGGER", "TidalWorker", "quiet_harmless_reload_warnings", "vllm_plugin"]

CPU_LINEAR_ENV = "TIDAL_CPU_LINEAR"  # actor.vllm.cpu_linear, handed to vLLM's processes by the environment
log = logging.getLogger("tidal.actor")


def vllm_plugin() -> None:
    """The `vllm.general_plugins` entry point: vLLM calls it in each of its processes before it
    builds the model. Registers tidal's weight-transfer engine (the network channels'), and keeps
    the CPU backend's linear weights in their plain layout where the actor asked for it."""
    from tidal.broker.weights import vllm_engine

    vllm_engine.register_vllm_engine()
    if os.environ.get(CPU_LINEAR_ENV) == "plain":
        import vllm._custom_ops as ops

        if hasattr(ops, "_supports_onednn"):
            # the CPU backend re-lays a linear layer's weight out for oneDNN only where it says it supports
            # oneDNN; without it the layer computes torch's linear on the weight as loaded
            ops._supports_onednn = False
        else:
            log.warning("actor.vllm.cpu_linear=plain: this vLLM has no oneDNN switch; linear layers stay packed "
                        "and each weight update re-packs them")


class TidalWorker:
    """Mixed into vLLM's worker class via `worker_extension_cls`."""

    def tidal_load_weights(self, transport: str, payload) -> float:
        """Load one version by the named weight channel's means; returns seconds spent."""
        from tidal.broker.weights import load_in_worker

        return load_in_worker(self, transport, payload)  # quiets the harmless reload warnings in this process

    def tidal_prefetch_weights(self, update_info: dict) -> None:
        """Start receiving a weight update in the background, before the engine pauses for it."""
        from tidal.broker.weights.vllm_engine import prefetch_in_worker

        prefetch_in_worker(update_info)

    def tidal_weights_prefetched(self) -> bool:
        """The background receive begun by `tidal_prefetch_weights` has ended."""
        from tidal.broker.weights.vllm_engine import prefetched_in_worker

        return prefetched_in_worker()

    def tidal_weight_layout(self) -> str:
        """How a weight update enters this worker's model: "copy" in place, or "reload" layer-wise
        where kernels hold some weights in a layout of their own."""
        return weight_layout(self.get_model())
