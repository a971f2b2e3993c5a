"""Lines a user must see while a run goes on (a reward scale the learner refuses, a ratio that drifts):
logged by the learner under the `tidal.notice` logger, which goes to its log like any other and to
run_dir/notices.log, which `tidal run` follows and prints on the console."""

from __future__ import annotations

import logging
from pathlib import Path

from tidal.run_files import NOTICES_FILE

notice = logging.getLogger("tidal.notice")


def attach(run_dir: Path) -> logging.Handler:
    """Every notice from now on also goes to run_dir/notices.log, one line each, as it is logged."""
    handler = logging.FileHandler(run_dir / NOTICES_FILE, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    notice.addHandler(handler)
    return handler
