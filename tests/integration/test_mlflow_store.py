"""A run folder's MLflow store (sqlite, artifacts beside it) survives being moved or copied: its
artifacts are found where the folder is now, read through the paths tidal reads them by. And a
store several runs share keeps its artifacts beside it, not in the first run's folder."""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

# The learner's part, in a process of its own as in a run (MLflow caches each run's artifact folder in
# the process that wrote it; a reader of a moved folder is a later process: the launcher, `tidal fit`).
WRITE_RUNS = """
import json, os, shutil, sys
from pathlib import Path
from mlflow.tracking import MlflowClient
from tidal.config import TrackingConfig
from tidal.learner.rank0.tracking import Tracker

empty = Path(sys.argv[2])
MlflowClient(f"sqlite:///{empty}").search_experiments()  # MLflow's tables, made once (seconds each time)
ids = {}
for run_dir, uri in json.loads(sys.argv[1]):
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True)
    if not uri:
        shutil.copy(empty, run_dir / "mlflow.db")
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # MLflow sets it on opening a store; each learner starts without
    tracker = Tracker(TrackingConfig(uri=uri, system_metrics_interval_s=0), run_dir, run_dir.name)
    tracker.log_metrics({"eval/pass_rate": 0.5, "compute/flops": 1.0}, step=0)
    tracker.log_table({"prompt": ["1+1"], "completion": ["2"]}, "rollouts/step-000001.json")
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "learner.log").write_text("step 1/1\\n")
    tracker.finish({"steps": 1})
    ids[str(run_dir)] = tracker.run_id
print(json.dumps(ids))
"""
OWN = ("moved", "final_logs", "original", "fit", "legacy")  # each a run folder with its own store


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """Finished tiny runs logged through tidal's Tracker: (their folder, name -> MLflow run id); the
    runs in shared/ share shared/mlflow.db, as runs pointed at one project store do."""
    root = tmp_path_factory.mktemp("written")
    shared = f"sqlite:///{root / 'shared' / 'mlflow.db'}"
    runs = [(str(root / name), "") for name in OWN] + [(str(root / "shared" / n), shared) for n in ("a", "b")]
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")}
    done = subprocess.run(
        [sys.executable, "-c", WRITE_RUNS, json.dumps(runs), str(root / "empty.db")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ids = json.loads(done.stdout.strip().splitlines()[-1])
    return root, {str(Path(k).relative_to(root)): v for k, v in ids.items()}


@pytest.fixture(autouse=True)
def own_store(monkeypatch):
    """The run's own store: no store named by the environment, before the test or after it (MLflow
    sets $MLFLOW_TRACKING_URI when a store is opened)."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.setenv(name, "")  # recorded as it was, so the test's own setting is undone too
        monkeypatch.delenv(name)


def artifact_paths(uri: str, run_id: str, path: str = "") -> set[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = set()
    for item in client.list_artifacts(run_id, path):
        found |= artifact_paths(uri, run_id, item.path) if item.is_dir else {item.path}
    return found


def test_artifacts_of_a_moved_run_folder_are_read_where_it_is_now(written, tmp_path):
    from mlflow.tracking import MlflowClient

    from tidal.mlflow_store import open_run_store

    root, ids = written
    moved = Path(shutil.move(root / "moved", tmp_path / "after"))
    uri = open_run_store(moved, json.loads((moved / "summary.json").read_text())["mlflow_uri"])
    assert uri == f"sqlite:///{(moved / 'mlflow.db').resolve()}"
    assert {"rollouts/step-000001.json", "summary.json", "logs/learner.log"} <= artifact_paths(uri, ids["moved"])
    table = Path(MlflowClient(uri).download_artifacts(ids["moved"], "rollouts/step-000001.json", str(tmp_path)))
    assert json.loads(table.read_text())["data"] == [["1+1", "2"]]
    assert not (root / "moved").exists()  # nothing read or written at the old place


def test_final_logs_of_a_moved_run_go_into_its_folder_not_the_old_one(written, tmp_path):
    from tidal.mlflow_store import log_final_logs

    root, ids = written
    moved = Path(shutil.move(root / "final_logs", tmp_path / "after"))
    (moved / "logs" / "actor-0.log").write_text("done\n")
    log_final_logs(moved)
    assert (moved / "artifacts" / ids["final_logs"] / "artifacts" / "logs" / "actor-0.log").is_file()
    assert not (root / "final_logs").exists()


def test_a_copied_run_folder_keeps_its_own_artifacts(written, tmp_path):
    """A copy resumed (as `--resume` continues the run) logs into the copy; the original's record still
    names the original."""
    from tidal.config import TrackingConfig
    from tidal.learner.rank0.tracking import Tracker

    root, ids = written
    run_id, original = ids["original"], root / "original"
    copy = Path(shutil.copytree(original, tmp_path / "copy"))
    tracker = Tracker(TrackingConfig(system_metrics_interval_s=0), copy, "copy", resume_run_id=run_id)
    tracker.log_table({"prompt": ["2+2"]}, "after-copy.json")
    tracker.finish({"steps": 2})
    assert (copy / "artifacts" / run_id / "artifacts" / "after-copy.json").is_file()
    assert not (original / "artifacts" / run_id / "artifacts" / "after-copy.json").exists()
    assert (
        recorded_artifact_uri(original / "mlflow.db", run_id)
        == (original / "artifacts" / run_id / "artifacts").resolve().as_uri()
    )


def test_tidal_fit_and_the_bench_read_a_moved_store(written, tmp_path, monkeypatch):
    from conftest import ROOT
    from tidal.scaling import open_store, points_from_mlflow

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from runs import mlflow_run

    root, ids = written
    moved = Path(shutil.move(root / "fit", tmp_path / "after"))
    uri = f"sqlite:///{moved / 'mlflow.db'}"
    assert "summary.json" in {a.path for a in open_store(uri).list_artifacts(ids["fit"])}
    assert points_from_mlflow(uri, [ids["fit"]])["fit"][1].tolist() == [0.5]
    assert mlflow_run(moved) == (f"sqlite:///{(moved / 'mlflow.db').resolve()}", ids["fit"])


def test_a_store_written_before_re_rooting_is_re_rooted_once_its_old_folder_is_gone(written, tmp_path):
    """An older run folder's experiment has no tidal tag; it is re-rooted when moved (the old folder
    is gone and the one beside the store is there)."""
    from tidal.mlflow_store import ARTIFACTS_BESIDE, open_run_store

    root, ids = written
    with sqlite3.connect(root / "legacy" / "mlflow.db") as db:
        db.execute("DELETE FROM experiment_tags WHERE key = ?", (ARTIFACTS_BESIDE,))
    db.close()
    moved = Path(shutil.move(root / "legacy", tmp_path / "after"))
    open_run_store(moved, "")
    assert (
        recorded_artifact_uri(moved / "mlflow.db", ids["legacy"])
        == (moved / "artifacts" / ids["legacy"] / "artifacts").resolve().as_uri()
    )


def recorded_artifact_uri(store: Path, run_id: str) -> str:
    """The artifact URI a store records for a run, read without MLflow (which caches it per process)."""
    with sqlite3.connect(store) as db:
        (uri,) = db.execute("SELECT artifact_uri FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()
    db.close()
    return uri


def test_an_experiment_with_artifacts_elsewhere_is_left_alone(written, tmp_path):
    """A store's experiment whose artifacts a user put in a folder of their own (still there) is
    not tidal's to move."""
    import mlflow

    from tidal.mlflow_store import reroot_artifacts

    elsewhere = tmp_path / "team" / "artifacts"
    elsewhere.mkdir(parents=True)
    store = tmp_path / "mine" / "mlflow.db"
    store.parent.mkdir()
    shutil.copy(written[0] / "empty.db", store)
    mlflow.set_tracking_uri(f"sqlite:///{store}")
    experiment_id = mlflow.create_experiment("theirs", artifact_location=elsewhere.as_uri())
    (store.parent / "artifacts").mkdir()
    reroot_artifacts(store)
    assert (
        mlflow.MlflowClient(f"sqlite:///{store}").get_experiment(experiment_id).artifact_location == elsewhere.as_uri()
    )


def test_a_shared_store_keeps_artifacts_beside_it_and_moves_with_its_folder(written, tmp_path):
    """Two runs in one project store (`tracking.uri=sqlite:///<project>/runs/mlflow.db`): the
    artifacts of both sit in runs/artifacts, not in the first run's folder, and the folder moves whole."""
    from tidal.scaling import open_store

    root, ids = written
    runs = root / "shared"
    assert not (runs / "a" / "artifacts").exists()
    assert {p.name for p in (runs / "artifacts").iterdir()} == {ids["shared/a"], ids["shared/b"]}
    moved = Path(shutil.move(runs, tmp_path / "elsewhere"))
    client = open_store(f"sqlite:///{moved / 'mlflow.db'}")
    assert all("summary.json" in {a.path for a in client.list_artifacts(ids[f"shared/{n}"])} for n in "ab")


def test_the_summary_shows_a_ready_to_paste_mlflow_ui_line(tmp_path):
    from tidal.mlflow_store import mlflow_ui_lines

    run_dir = tmp_path / "runs" / "demo"
    own = mlflow_ui_lines(f"sqlite:///{run_dir / 'mlflow.db'}", run_dir)
    assert own[0].startswith("mlflow ui: ") and own[0].endswith(
        f" ui --backend-store-uri sqlite:///{(run_dir / 'mlflow.db').resolve()}"
    )
    assert (
        own[1] == f"to compare runs in one UI, give them one store: "
        f"tracking.uri=sqlite:///{(tmp_path / 'runs' / 'mlflow.db').resolve()}"
    )
    shared = mlflow_ui_lines(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}", run_dir)
    assert len(shared) == 1  # already shared: nothing to suggest
    assert mlflow_ui_lines("http://mlflow:5000", run_dir) == ["mlflow ui: http://mlflow:5000 (the tracking server)"]


def test_a_new_store_is_opened_by_one_run_at_a_time(tmp_path):
    """Runs started together on one new shared store take turns to open it (MLflow makes its tables
    then; of three runs doing it at once, at most one came up): a second opener waits until the first is done."""
    import threading

    from tidal.mlflow_store import first_open

    store, entered = tmp_path / "runs" / "mlflow.db", threading.Event()

    def second_run():
        with first_open(store):
            entered.set()

    with first_open(store):
        waiting = threading.Thread(target=second_run)
        waiting.start()
        assert not entered.wait(0.2)  # held: the second cannot be in
    assert entered.wait(10)
    waiting.join()
