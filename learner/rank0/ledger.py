"""The record of what happened to every prompt group, one JSON line per event.

    {"event": "released", "ids": [...]}                    the coordinator queued these groups
    {"event": "trained", "step": s, "ids": [...]}           step s trained on them
    {"event": "discarded", "reason": "zero_variance", "id"}  dropped at arrival
    {"event": "duplicate", "id": ...}                        a second copy (redelivery), not used
    {"event": "dead_letter", "id": ...}                      gave up after too many deliveries
    {"event": "actor_joined", "actor": ..., "version": v, "announced": a}

Every line also carries its wall-clock "time". Operators and the fault tests reconcile from
it. Checkpoints store its byte offset, and a resumed learner cuts it back there, so it always
describes the lineage of the live model. A crash can leave a torn last line: the next start drops
it with a warning (what came before is kept); a line that does not read anywhere else is damage,
named by line number.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


class Ledger:
    def __init__(self, path: Path, truncate_to: int | None = None):
        self.path = path
        if path.exists():
            repair(path, truncate_to)
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


def repair(path: Path, keep_bytes: int | None = None) -> None:
    """Cut the ledger back to `keep_bytes` (a checkpoint's offset; a shorter ledger is named, never
    padded), then drop a torn last line, each with a warning, so that appending goes on from whole lines."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if keep_bytes is not None and size > keep_bytes:
            size = f.truncate(keep_bytes)
        elif keep_bytes is not None and size < keep_bytes:
            log.warning(
                "%s holds %d bytes, the checkpoint covers %d: the events of the last %d bytes are lost",
                path,
                size,
                keep_bytes,
                keep_bytes - size,
            )
        start = _last_line_start(f, size)
        f.seek(start)
        last = f.read()
        if last and _record(last) is None:
            f.truncate(start)
            log.warning(
                "%s: dropped a torn last line of %d bytes (the learner stopped while writing it)", path, len(last)
            )
        elif last:
            f.write(b"\n")  # a whole record that lost its newline
    if keep_bytes:
        _name_damaged_lines(path)


def _name_damaged_lines(path: Path) -> None:
    """One warning naming the lines before the last that are not records (damage from outside: the
    learner writes whole lines); they stay, for whoever reads the ledger to see."""
    with open(path, "rb") as f:
        damaged = [number for number, line in enumerate(f, 1) if line.strip() and _record(line) is None]
    if damaged:
        log.warning(
            "%s: %d lines are not JSON records (lines %s): the ledger is damaged there",
            path,
            len(damaged),
            ", ".join(map(str, damaged[:10])) + (", ..." if len(damaged) > 10 else ""),
        )


def _last_line_start(f, size: int, chunk_bytes: int = 1 << 16) -> int:
    """Where the text after the file's last newline begins (`size` if it ends with one)."""
    end = size
    while end > 0:
        start = max(end - chunk_bytes, 0)
        f.seek(start)
        newline = f.read(end - start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


def _record(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_ledger(path: Path) -> list[dict]:
    """Every record of the ledger at `path`; a torn last line (a crash while writing it) is left out
    with a warning, a line in the middle that is not a record raises ValueError naming it."""
    lines = Path(path).read_bytes().split(b"\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _record(line)
        if record is not None:
            records.append(record)
        elif number == len(lines):  # no newline after it: the write was cut short
            log.warning("%s: left out a torn last line of %d bytes", path, len(line))
        else:
            raise ValueError(f"{path}: line {number} is not a JSON record ({line[:80]!r}): the ledger is damaged")
    return records
