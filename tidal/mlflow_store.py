"""A run's MLflow store: where it is (`tracking_uri`), opening it (`use_store`, one process at a time
on a new sqlite file), and how a user sees it (`mlflow_ui_lines`, the run's page). Shared by the
learner, which writes stores, and the commands around it (`tidal run`, `sweep`, `fit`, `plan-batch`),
which read them.

sqlite stores move: a store keeps its experiments' artifacts in `artifacts/` beside it, and MLflow
records them by absolute path, so a run folder moved or copied whole would lose them. Opening a
store re-roots them (`reroot_artifacts`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import sqlite3
import sys
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlparse

from tidal.config import TrackingConfig, load_config

ARTIFACTS_BESIDE = "tidal.artifacts"  # experiment tag: its artifacts live in artifacts/ beside its sqlite store
EXPERIMENT_KIND = "mlflow.experimentKind"
MLFLOW_UI_ADDRESS = "http://127.0.0.1:5000"  # where `mlflow ui` serves unless told --host or --port
MODEL_TRAINING = "workflowType=machine_learning"  # the UI's model-training mode; GenAI is its default

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
        log.warning(
            "could not re-root the artifacts of the MLflow store %s (%s); they stay where it says they were", store, err
        )


def _moved_experiments(db: sqlite3.Connection, beside: Path) -> list[tuple[int, str]]:
    """(experiment id, recorded artifact location) of the experiments to re-root to `beside`."""
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not {"experiments", "experiment_tags", "runs"} <= tables:
        return []  # a store MLflow has not set up yet
    tagged = {
        eid for (eid,) in db.execute("SELECT experiment_id FROM experiment_tags WHERE key = ?", (ARTIFACTS_BESIDE,))
    }
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
        db.execute(
            f"UPDATE {table} SET {column} = ? || substr({column}, ?) "  # noqa: S608 - fixed names
            f"WHERE experiment_id = ? AND substr({column}, 1, ?) = ?",
            (new + "/", len(under) + 1, experiment_id, len(under), under),
        )  # substr counts from 1


def tracking_uri(cfg: TrackingConfig, run_dir: Path) -> str:
    return cfg.uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def sqlite_file(uri: str) -> Path | None:
    """The file of a `sqlite:///path` store (None for any other store)."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(unquote(uri.removeprefix("sqlite:///").split("?")[0]))


def use_store(uri: str, experiment: str, artifacts: Path | None = None) -> None:
    """Point MLflow at `uri` and `experiment`. A local sqlite store's experiment is created with
    its artifacts in `artifacts` (by default `artifacts/` beside the file: not in the current
    directory, nor in the folder of the first run that used a shared store); a store that was
    moved is re-rooted first."""
    import mlflow

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    store = sqlite_file(uri)
    with first_open(store):
        if store is not None:
            reroot_artifacts(store)
        mlflow.set_tracking_uri(uri)
        if store is not None and mlflow.get_experiment_by_name(experiment) is None:
            folder = (artifacts or store.parent / "artifacts").resolve()
            tags = {ARTIFACTS_BESIDE: "beside the store"} if folder == store.resolve().parent / "artifacts" else {}
            mlflow.create_experiment(experiment, artifact_location=folder.as_uri(), tags=tags)
        found = mlflow.set_experiment(experiment)
    # MLflow's UI opens an experiment so tagged as model training (runs, charts), not GenAI (traces); the
    # UI of MLflow 3.17 reads the mode from the page's address instead (run_page_url)
    if EXPERIMENT_KIND not in found.tags:
        mlflow.MlflowClient().set_experiment_tag(found.experiment_id, EXPERIMENT_KIND, "custom_model_development")


@contextmanager
def first_open(store: Path | None):
    """Held while a process opens a sqlite store (None: any other store, nothing held): MLflow makes its
    tables on first use, and runs sharing a new file that open it at once fail in its migrations
    (measured: of three runs started together, at most one came up), as two would both create the
    experiment. A lock on the store's folder, so no lock file is left beside it."""
    if store is None:
        yield
        return
    store.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(store.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        yield
    finally:
        os.close(folder)  # releases the lock


def log_final_logs(run_dir: Path) -> None:
    """The launcher's last word: the process logs once every process has exited (the learner
    logged them while it was still writing its own), into the run its summary names."""
    from mlflow.tracking import MlflowClient

    summary, logs = run_dir / "summary.json", run_dir / "logs"
    if not (summary.is_file() and logs.is_dir()):
        return
    s = json.loads(summary.read_text())
    try:
        MlflowClient(open_run_store(run_dir, s["mlflow_uri"])).log_artifacts(s["mlflow_run_id"], str(logs), "logs")
    except Exception as err:  # the run is over; its logs are still in the run directory
        log.warning("could not log %s to MLflow run %s: %s", logs, s.get("mlflow_run_id"), err)


def open_run_store(run_dir: Path, shown: str) -> str:
    """`run_tracking_uri`, its sqlite store re-rooted where the run folder was moved or copied:
    what a reader of a finished run opens, so its artifacts are found where the folder is now."""
    uri, own = run_tracking_uri(run_dir, shown), run_dir / "mlflow.db"
    store = sqlite_file(uri)
    if (not uri or (store is not None and not store.is_file())) and own.is_file():
        uri, store = f"sqlite:///{own.resolve()}", own  # the summary names the store where the folder was
    if store is not None:
        reroot_artifacts(store)
    return uri


def mlflow_ui_lines(shown: str, run_dir: Path) -> list[str]:
    """The summary's ready-to-paste way to see the run: for a sqlite store, the `mlflow ui` command
    (the installed one, by full path) and, when the store is the run's own, how runs share one
    store to be compared side by side; for a tracking server, its address. Then the run's page,
    opened as model training, once summary.json names the run."""
    store = sqlite_file(shown)
    scheme = urlparse(shown).scheme
    if store is None and scheme in ("http", "https", "databricks"):
        server = [f"mlflow ui: {shown} (the tracking server)"]
        return server if scheme == "databricks" else [*server, *_run_page_line(shown, run_dir)]
    if store is None:
        return [
            f"mlflow ui: {_mlflow_command()} ui --backend-store-uri {shlex.quote(shown)}",
            *_run_page_line(MLFLOW_UI_ADDRESS, run_dir),
        ]
    lines = [
        f"mlflow ui: {_mlflow_command()} ui --backend-store-uri {shlex.quote(f'sqlite:///{store.resolve()}')}",
        *_run_page_line(MLFLOW_UI_ADDRESS, run_dir),
    ]
    if store.resolve().parent == run_dir.resolve():
        shared = run_dir.resolve().parent / "mlflow.db"
        lines.append(f"to compare runs in one UI, give them one store: tracking.uri=sqlite:///{shared}")
    return lines


def run_page_url(server: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI at `server` (without credentials), in model-training mode: MLflow
    3.17's UI takes the mode from this parameter, else from the browser's last choice (at first GenAI),
    and not from the experiment's mlflow.experimentKind tag."""
    parts = urlparse(server)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname  # an IPv6 address
    base = f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path.rstrip('/')}"
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?{MODEL_TRAINING}"


def _run_page_line(server: str, run_dir: Path) -> list[str]:
    summary = run_dir / "summary.json"
    found = json.loads(summary.read_text()) if summary.is_file() else {}
    if not {"mlflow_run_id", "mlflow_experiment_id"} <= found.keys():
        return []  # a run from before the summary named its experiment
    page = run_page_url(server, found["mlflow_experiment_id"], found["mlflow_run_id"])
    return [f"the run, as model training: {page}"]


def _mlflow_command() -> str:
    """The `mlflow` beside this Python (a virtual environment's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mlflow"
    return shlex.quote(str(beside)) if beside.is_file() else "mlflow"


def run_tracking_uri(run_dir: Path, shown: str) -> str:
    """The URI, credentials included, that the run's config resolves to (summary.json shows it
    redacted); `shown` where the run directory has no config."""
    config = run_dir / "config.yaml"
    if not config.is_file():
        return shown
    return tracking_uri(load_config(config).tracking, run_dir)
