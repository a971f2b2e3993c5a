"""tracking.*: MLflow tracking, system metrics, rollout tables and the learner's progress lines."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config.base import Section, _require, opt


@dataclass(frozen=True)
class TrackingConfig(Section):
    """MLflow tracking and the learner's progress lines."""

    uri: str = opt("", "MLflow tracking URI; empty = $MLFLOW_TRACKING_URI, else sqlite:///<run_dir>/mlflow.db")
    experiment: str = opt("", 'MLflow experiment name; empty = $MLFLOW_EXPERIMENT_NAME, else "tidal"')
    run_name: str = opt(
        "",
        "MLflow run name; empty = the task and the config's name, e.g. rows-tiny for task.name "
        "rows on the tiny preset (one name when they are the same: math)",
    )
    parent_run_id: str = opt("", "the MLflow run this run is a child of (tidal sweep sets it)")
    system_metrics_interval_s: float = opt(
        10.0,
        "CPU, memory, disk, network and (where nvidia-ml-py finds GPUs) GPU "
        "metrics every this many seconds, as system/* metrics of the "
        "learner's run; 0 = none",
    )
    eval_completions: int = opt(64, "sample completions logged as a table at every evaluation; 0 = none")
    log_model: bool = opt(
        False,
        "also log the final exported model folder (run_dir/model) to MLflow, as artifacts, "
        "and under learner.lora the adapter (run_dir/adapter)",
    )
    log_every_steps: int = opt(
        1,
        "one line in the learner's log every this many steps (step, reward, pass rate, loss, "
        "lag, tokens/s over the recent window, time per step), so `kubectl logs -f` shows "
        "progress; 0 = none",
    )
    rollout_table_every: int = opt(
        25,
        "a table of sampled training rollouts (prompt, completion, reward and its "
        "components, advantage, versions, lag) in MLflow every this many steps; 0 = "
        "none",
    )
    rollout_table_rows: int = opt(16, "rollouts in each such table")
    metrics_port: int = opt(
        0,
        "serve Prometheus metrics (flow, throughput, lag, queue depth) on this port of every process: the "
        "learner here, each actor the same (one per pod); on one machine the launcher gives actor i the "
        "port metrics_port + 1 + i. 0 = none",
    )
    metrics_host: str = opt(
        "127.0.0.1",
        "address the metrics port binds: loopback on a laptop; 0.0.0.0 in a pod, so that Prometheus reaches "
        "it over the pod network (the metrics carry no secrets: counts, seconds and versions)",
    )

    def check(self) -> None:
        _require(
            self.system_metrics_interval_s >= 0,
            "tracking.system_metrics_interval_s",
            self.system_metrics_interval_s,
            "must be >= 0 (0 = no system metrics)",
        )
        _require(
            self.eval_completions >= 0,
            "tracking.eval_completions",
            self.eval_completions,
            "must be >= 0 (0 = no table)",
        )
        _require(
            0 <= self.metrics_port <= 65535, "tracking.metrics_port", self.metrics_port, "must be a port, or 0 = none"
        )
