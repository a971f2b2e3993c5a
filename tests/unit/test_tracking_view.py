"""How a run shows in MLflow's UI: its name (the task and the config, not the preset alone), and the
page the summary links to, which MLflow 3.17's UI opens as model training only when the link says so."""

import json

import pytest

from conftest import ROOT
from tidal.config import load_config
from tidal.learner.rank0.tracking import run_name
from tidal.mlflow_store import mlflow_ui_lines, run_page_url


@pytest.mark.parametrize(
    "config, overrides, name",
    [
        ("tiny", ["task.name=count"], "count-tiny"),  # a task of its own on the tiny preset: no longer "tiny"
        ("tiny", [], "arithmetic-tiny"),
        ("math", [], "math"),  # the task is the preset's name: said once
        ("tiny", ["tracking.run_name=my run"], "my run"),
        ("tiny", ["tracking.parent_run_id=abc", "name=staleness.max_lag-2"], "staleness.max_lag-2"),  # a sweep's child
    ],
)
def test_a_run_is_named_after_its_task_and_config_unless_named(config, overrides, name):
    assert run_name(load_config(ROOT / f"configs/{config}.yaml", overrides)) == name


def test_the_run_page_opens_as_model_training_without_credentials():
    assert run_page_url("https://me:***@mlflow.example:8443/team/?token=***", "7", "abc") == (
        "https://mlflow.example:8443/team/#/experiments/7/runs/abc?workflowType=machine_learning"
    )


def test_the_summary_links_the_run_page_once_it_names_the_run(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert mlflow_ui_lines("http://mlflow:5000", run_dir) == ["mlflow ui: http://mlflow:5000 (the tracking server)"]
    (run_dir / "summary.json").write_text(json.dumps({"mlflow_run_id": "abc", "mlflow_experiment_id": "3"}))
    assert mlflow_ui_lines("http://mlflow:5000", run_dir) == [
        "mlflow ui: http://mlflow:5000 (the tracking server)",
        "the run, as model training: http://mlflow:5000/#/experiments/3/runs/abc?workflowType=machine_learning",
    ]
    own = mlflow_ui_lines(f"sqlite:///{run_dir / 'mlflow.db'}", run_dir)
    assert own[1] == (
        "the run, as model training: http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    )  # where `mlflow ui` serves
