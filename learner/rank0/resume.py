"""What a checkpoint holds of the learner's own state, and metrics that reach MLflow exactly once.

A resumed learner trains again the steps after its checkpoint. So with periodic checkpoints a
step's metrics reach MLflow only once a checkpoint covers that step; the checkpoint keeps the
ones not yet logged, and a resumed learner logs those MLflow does not have yet (a crash between
a save and the logging would lose them otherwise). No step is logged twice.
"""

from __future__ import annotations

from tidal.learner.rank0.accounting import Accounting
from tidal.learner.rank0.evaluation import Evaluations

HEALED_KEYS = ("learner/version", "eval/pass_rate")  # a training step's record has the first, an eval's the second


class MetricsLog:
    def __init__(self, tracker, periodic_checkpoints: bool):
        self.tracker = tracker
        self.periodic = periodic_checkpoints
        self.unlogged: list[tuple[int, dict]] = []  # (step, metrics) waiting for a checkpoint to cover them

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.unlogged.append((step, metrics))
        if not self.periodic:
            self.flush()

    def flush(self) -> None:
        """A checkpoint covers everything logged so far."""
        for step, metrics in self.unlogged:
            self.tracker.log_metrics(metrics, step=step)
        self.unlogged = []

    def heal(self, stored: list) -> None:
        """Log the checkpoint's unlogged metrics that MLflow does not have yet."""
        last = {key: self.tracker.last_step(key) for key in HEALED_KEYS}
        for step, metrics in stored:
            key = HEALED_KEYS[0] if HEALED_KEYS[0] in metrics else HEALED_KEYS[1]
            if last[key] is None or step > last[key]:
                self.tracker.log_metrics(metrics, step=step)


def learner_state(accounting: Accounting, evals: Evaluations) -> dict:
    return {
        **accounting.state_dict(),
        "evals": evals.results,
        "evals_pending": evals.pending_versions(),
        "eval_multi_version": evals.multi_version_samples,
    }


def restore_learner_state(state: dict, accounting: Accounting, evals: Evaluations) -> list[int]:
    """Put a checkpoint's learner state back; returns the versions whose evaluations were under way."""
    accounting.load_state_dict(state)
    evals.results = {int(k): v for k, v in state["evals"].items()}
    evals.multi_version_samples = state["eval_multi_version"]
    return state.get("evals_pending", [])


NUMBER = (int, float)
RESUMED_FIELDS = {  # what a resumed learner reads of a checkpoint's tidal state, by where it sits
    "": {"version": int, "mlflow_run_id": (str, type(None)), "coordinator": dict, "learner": dict, "unlogged": list},
    "coordinator": {
        "epoch": int,
        "cursor": int,
        "num_released": int,
        "version": int,
        "ledger_offset": int,
        "outstanding": dict,
        "consumed": list,
        "dead": list,
        "counts": dict,
    },
    "learner": {
        "totals": dict,
        "by_actor": dict,
        "device_seconds": NUMBER,
        "wall_s": NUMBER,
        "evals": dict,
        "eval_multi_version": int,
    },
}


def check_resume_state(state) -> None:
    """A checkpoint's tidal state holds what a resumed learner reads, each of its type; ValueError
    naming the first field that does not (before anything is restored from it)."""
    for where, fields in RESUMED_FIELDS.items():
        table = state.get(where) if where else state
        if not isinstance(table, dict):
            raise ValueError(f"{where or 'the state'} is not a table")
        for key, kind in fields.items():
            if not isinstance(table.get(key), kind) or isinstance(table.get(key), bool):
                kinds = kind if isinstance(kind, tuple) else (kind,)
                raise ValueError(
                    f"{'.'.join(filter(None, (where, key)))} is missing or not {' or '.join(k.__name__ for k in kinds)}"
                )
    if state["coordinator"]["ledger_offset"] < 0 or not all(k.lstrip("-").isdigit() for k in state["learner"]["evals"]):
        raise ValueError("coordinator.ledger_offset is negative or learner.evals is not keyed by version")
