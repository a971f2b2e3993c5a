"""Eval curves read back from a real MLflow store for `tidal fit --runs`."""

import numpy as np
import pytest

from tidal import scaling
from tidal.scaling import ScalingFitError


def test_points_from_mlflow(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("scaling")
    run = client.create_run(experiment, run_name="baseline").info.run_id
    empty = client.create_run(experiment, run_name="no-evals").info.run_id
    for step, (flops, rate) in enumerate([(None, 0.30), (1e3, 0.40), (2e3, 0.50), (3e3, 0.55)]):
        if flops is not None:  # step 0 logs no compute: it counts as compute 0 (R0)
            client.log_metric(run, "compute/flops", flops, step=step * 10)
        client.log_metric(run, "eval/pass_rate", rate, step=step * 10)
    points = scaling.points_from_mlflow(uri, [run])
    compute, pass_rate = points["baseline"]
    np.testing.assert_array_equal(compute, [0, 1e3, 2e3, 3e3])
    np.testing.assert_array_equal(pass_rate, [0.30, 0.40, 0.50, 0.55])
    with pytest.raises(ScalingFitError, match="no 'eval/pass_rate' points"):
        scaling.points_from_mlflow(uri, [empty])
