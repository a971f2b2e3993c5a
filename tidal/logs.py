"""Warnings about what peers send, at a rate no peer sets: a kind of refusal is logged at its 1st, 10th,
100th ... occurrence, with its count. A key holder's junk once wrote a line per frame (12.6 GiB of log an
hour from one key); the counts themselves stay exact in the metrics that carry them."""

from __future__ import annotations

import logging
from collections import Counter


def power_of_ten(n: int) -> bool:
    """1, 10, 100, ...: the occurrences of a kind worth a line."""
    return n > 0 and str(n).rstrip("0") == "1"


class SparseLog:
    """`warning(kind, ...)` logs the 1st, 10th, 100th ... call of each kind, its count appended."""

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self.counts: Counter[str] = Counter()

    def warning(self, kind: str, msg: str, *args) -> None:
        self.counts[kind] += 1  # a count lost to a race between threads costs a line, not a refusal
        count = self.counts[kind]
        if power_of_ten(count):
            self.logger.warning(f"{msg} (#%d of {kind})", *args, count)
