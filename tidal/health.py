"""Liveness for probes: a process touches its health file while it makes progress, and
`tidal health FILE --max-age-s N` (a Kubernetes exec probe) checks the file's age."""

from __future__ import annotations

import os
import time


class HealthFile:
    """Touches `path` at most every `every_s` seconds; a no-op when path is empty."""

    def __init__(self, path: str, every_s: float = 5.0):
        self.path = path
        self.every_s = every_s
        self._last = 0.0

    def touch(self) -> None:
        now = time.monotonic()
        if not self.path or now - self._last < self.every_s:
            return
        self._last = now
        with open(self.path, "a"):
            os.utime(self.path)
