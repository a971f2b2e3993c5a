"""Runs inside vLLM's worker processes: the entry point for a weight update.

Tensors cannot travel through `collective_rpc` in multiprocess mode (they do not pickle), so
each weight channel sends only what its worker side needs (a file path, an address) and loads
the tensors itself, through the layer-wise reload that works on every backend.
"""
from __future__ import annotations

import logging

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


class TidalWorker:
    """Mixed into vLLM's worker class via `worker_extension_cls`."""

    def tidal_load_weights(self, transport: str, payload) -> float:
        """Load one version by the named weight channel's means; returns seconds spent."""
        from tidal.broker.weights import load_in_worker

        quiet_harmless_reload_warnings()  # in this worker process, where vLLM logs them
        return load_in_worker(self, transport, payload)
