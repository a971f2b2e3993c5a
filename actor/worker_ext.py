"""Runs inside vLLM's worker processes: the entry point for a weight update.

Tensors cannot travel through `collective_rpc` in multiprocess mode (they do not pickle), so
each weight channel sends only what its worker side needs (a file path, an address) and loads
the tensors itself, through the layer-wise reload that works on every backend.
"""
from __future__ import annotations

from tidal.broker.weights.base import RELOAD_LOGGER, quiet_harmless_reload_warnings

__all__ = ["RELOAD_LOGGER", "TidalWorker", "quiet_harmless_reload_warnings"]


class TidalWorker:
    """Mixed into vLLM's worker class via `worker_extension_cls`."""

    def tidal_load_weights(self, transport: str, payload) -> float:
        """Load one version by the named weight channel's means; returns seconds spent."""
        from tidal.broker.weights import load_in_worker

        quiet_harmless_reload_warnings()  # in this worker process, where vLLM logs them
        return load_in_worker(self, transport, payload)
