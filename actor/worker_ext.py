"""Runs inside vLLM's processes: the plugin vLLM loads in each of them, and what the actor asks its
workers directly. Weight updates themselves enter through vLLM's weight-transfer API, with the engine
the plugin registers (tidal.actor.weight_engine).
"""

from __future__ import annotations

import logging
import os

from tidal.broker.weights import RELOAD_LOGGER, quiet_harmless_reload_warnings, weight_layout

__all__ = ["CPU_LINEAR_ENV", "RELOAD_LOGGER", "TidalWorker", "quiet_harmless_reload_warnings", "vllm_plugin"]

CPU_LINEAR_ENV = "TIDAL_CPU_LINEAR"  # actor.vllm.cpu_linear, handed to vLLM's processes by the environment
log = logging.getLogger("tidal.actor")


def vllm_plugin() -> None:
    """The `vllm.general_plugins` entry point: vLLM calls it in each of its processes before it
    builds the model. Registers tidal's weight-transfer engine (every weight channel's), and keeps
    the CPU backend's linear weights in their plain layout where the actor asked for it."""
    from tidal.actor import weight_engine

    weight_engine.register_vllm_engine()
    if os.environ.get(CPU_LINEAR_ENV) == "plain":
        import vllm._custom_ops as ops

        if hasattr(ops, "_supports_onednn"):
            # the CPU backend re-lays a linear layer's weight out for oneDNN only where it says it supports
            # oneDNN; without it the layer computes torch's linear on the weight as loaded
            ops._supports_onednn = False
        else:
            log.warning(
                "actor.vllm.cpu_linear=plain: this vLLM has no oneDNN switch; linear layers stay packed "
                "and each weight update re-packs them"
            )


class TidalWorker:
    """Mixed into vLLM's worker class via `worker_extension_cls`."""

    def tidal_weight_layout(self) -> str:
        """How a weight update enters this worker's model: "copy" in place, or "reload" layer-wise
        where kernels hold some weights in a layout of their own or a quantization method rewrites them."""
        return weight_layout(self.get_model())

    def tidal_install_adapter(self) -> int:
        """Serving a LoRA adapter: the newest version received whole (zeros before the first) into the
        LoRA manager under the one id every request carries; the version installed (-1: zeros)."""
        from tidal.actor.weight_engine import install_adapter

        return install_adapter(self)

    def tidal_round_weights(self, dtype: str) -> int:
        """Every floating parameter rounded to `dtype` and stored back in its own (benchmarks only:
        `BENCH_ROUND_ENV`); how many were rounded."""
        import torch

        target, count = getattr(torch, dtype), 0
        with torch.no_grad():
            for param in self.get_model().parameters():
                if param.is_floating_point() and param.dtype != target:
                    param.copy_(param.to(target).to(param.dtype))
                    count += 1
        return count

    def tidal_adapters(self) -> list[int]:
        """The LoRA ids the worker holds (registered, in host memory or a GPU slot): one, when serving one."""
        manager = self.model_runner.lora_manager
        return sorted(manager.list_adapters()) if manager is not None else []
