"""Runs inside vLLM's worker process: loads an announced safetensors weight file in place.

Tensors cannot travel through `collective_rpc` in multiprocess mode, so the learner writes a
file and the actor sends only its path; the layer-wise reload path is the one that works on
the CPU backend (its linear layers are repacked, so plain `load_weights` fails there).
"""
from __future__ import annotations

import time


class WeightReceiver:
    """Mixed into vLLM's worker class via `worker_extension_cls`."""

    def tidal_load_weight_file(self, path: str) -> float:
        """Reload every tensor of the safetensors file at `path`; returns seconds spent."""
        from safetensors import safe_open

        start = time.perf_counter()
        with safe_open(path, framework="pt") as f:
            weights = [(name, f.get_tensor(name)) for name in f.keys()]
        self.reload_weights(weights_iterator=weights)
        return time.perf_counter() - start
