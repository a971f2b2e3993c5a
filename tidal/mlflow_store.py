"""MLflow sqlite stores that move: a store keeps its experiments' artifacts in `artifacts/` beside it,
and MLflow records them by absolute path, so a run folder moved or copied whole would lose them.
Opening a store re-roots them (`reroot_artifacts`). Shared by the learner, which writes stores, and
the analysis commands (`tidal fit`, `plan-batch`), which read them.
"""
from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from urllib.parse import unquote, urlparse

ARTIFACTS_BESIDE = "tidal.artifacts"  # experiment tag: its artifacts live in artifacts/ beside its sqlite store

log = logging.getLogger(__name__)


def reroot_artifacts(store: Path) -> None:
    """Point the artifacts of a sqlite store's experiments that keep them beside the store at
    `artifacts/` beside it where it is now. MLflow records absolute paths (an experiment's artifact
    location, each run's and logged model's artifact URI), so a moved or copied run folder would
    otherwise lose them all. An experiment is re-rooted when tidal made it so (ARTIFACTS_BESIDE),
    or when its recorded folder is gone and there is one beside the store (a store tidal wrote before).
    A store that cannot be written (read-only) is left as it is, with a warning."""
    if not store.is_file():
        return  # MLflow makes a new one; nothing is recorded yet
    beside = store.resolve().parent / "artifacts"
    try:
        with sqlite3.connect(store, timeout=20) as db:  # commits the rewrite as one transaction
            for experiment_id, recorded in _moved_experiments(db, beside):
                _rewrite_prefix(db, experiment_id, recorded, beside.as_uri())
                log.info("MLflow store %s moved: artifacts re-rooted from %s to %s", store, recorded, beside.as_uri())
        db.close()
    except sqlite3.Error as err:
        log.warning("could not re-root the artifacts of the MLflow store %s (%s); they stay where it "
                    "says they were", store, err)


def _moved_experiments(db: sqlite3.Connection, beside: Path) -> list[tuple[int, str]]:
    """(experiment id, recorded artifact location) of the experiments to re-root to `beside`."""
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not {"experiments", "experiment_tags", "runs"} <= tables:
        return []  # a store MLflow has not set up yet
    tagged = {eid for (eid,) in db.execute("SELECT experiment_id FROM experiment_tags WHERE key = ?",
                                           (ARTIFACTS_BESIDE,))}
    moved = []
    for experiment_id, recorded in db.execute("SELECT experiment_id, artifact_location FROM experiments"):
        folder = _local_path(recorded or "")
        if folder is None or folder.name != "artifacts" or folder == beside:
            continue
        legacy = not folder.exists() and beside.is_dir()
        if experiment_id in tagged or legacy:
            moved.append((experiment_id, recorded))
    return moved


def _local_path(location: str) -> Path | None:
    """The folder of a `file://` URI or a plain absolute path; None for any remote location."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    return Path(location) if parsed.scheme == "" and location.startswith("/") else None


def _rewrite_prefix(db: sqlite3.Connection, experiment_id: int, recorded: str, new: str) -> None:
    """The experiment's artifact location, and the URIs under it of its runs and logged models, to `new`."""
    db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (new, experiment_id))
    under = recorded.rstrip("/") + "/"
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    for table, column in (("runs", "artifact_uri"), ("logged_models", "artifact_location")):
        if table not in tables:
            continue  # a store from before MLflow had logged models
        db.execute(f"UPDATE {table} SET {column} = ? || substr({column}, ?) "  # noqa: S608 - fixed names
                   f"WHERE experiment_id = ? AND substr({column}, 1, ?) = ?",
                   (new + "/", len(under) + 1, experiment_id, len(under), under))  # substr counts from 1
