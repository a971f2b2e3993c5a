"""The record of what happened to every prompt group, one JSON line per event.

    {"event": "released", "ids": [...]}                    the coordinator queued these groups
    {"event": "trained", "step": s, "ids": [...]}           step s trained on them
    {"event": "discarded", "reason": "zero_variance", "id"}  dropped at arrival
    {"event": "duplicate", "id": ...}                        a second copy (redelivery), not used
    {"event": "dead_letter", "id": ...}                      gave up after too many deliveries
    {"event": "actor_joined", "actor": ..., "version": v, "announced": a}

Every line also carries its wall-clock "time". Operators and the fault tests reconcile from
it. Checkpoints store its byte offset, and a resumed learner cuts it back there, so it always
describes the lineage of the live model.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path


class Ledger:
    def __init__(self, path: Path, truncate_to: int | None = None):
        self.path = path
        if truncate_to is not None and path.exists():
            with open(path, "r+b") as f:
                f.truncate(truncate_to)
        self._file = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def record(self, event: str, **fields) -> None:
        with self._lock:
            self._file.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")

    def offset(self) -> int:
        """Byte length so far, flushed to disk: what a checkpoint stores."""
        with self._lock:
            self._file.flush()
            os.fsync(self._file.fileno())
            return self._file.tell()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_ledger(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
