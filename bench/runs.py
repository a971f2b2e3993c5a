"""What the bench scripts share: a tidal run in its own processes, and its metrics read back."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

METRICS = ("eval/pass_rate", "compute/wall_s", "compute/samples")


def tidal_run(config: list[str], overrides: list[str], run_dir: Path, label: str, env: dict | None = None) -> Path:
    """`tidal run CONFIG... run_dir=RUN_DIR OVERRIDES...` (learner and actors, pinned as the launcher
    pins them), with `env` added to the environment; exits the script with the run's log tail when it fails."""
    cmd = [sys.executable, "-m", "tidal", "run", *config, f"run_dir={run_dir}", "checkpoint.every=0", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise SystemExit(f"{label}: the run in {run_dir} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return run_dir


def timed_tidal_run(
    config: str, run_dir: Path, every: int, overrides: list[str], profile: tuple[str, ...] = (), env: dict | None = None
) -> dict:
    """One tidal run with no evaluation inside it but at the start and the end (the actor's, as a user's
    run has them); the file channel keeps every version, which the bench evaluates afterwards with one
    evaluator for every system. whole_s: from launch to exit; profile: the median of each named metric."""
    from tidal.config import load_config, preset_path

    weights = Path("/dev/shm") / f"tidal-bench-{run_dir.name}"
    shutil.rmtree(weights, ignore_errors=True)
    launched = time.time()
    tidal_run(
        [config], ["eval.every=0", f"weights.dir={weights}", "weights.keep=1000000", *overrides], run_dir, "bench", env
    )
    whole_s = time.time() - launched
    hist = history(run_dir, (*METRICS, *profile, "learner/num_samples"))
    last = max(hist["compute/wall_s"])
    cfg = load_config(preset_path(config), overrides)
    try:
        hist["eval/pass_rate"] = evaluate_weight_files(cfg, weights, sorted({*range(0, last, every), last}))
    finally:
        shutil.rmtree(weights, ignore_errors=True)
    medians = {name.split("/")[1]: statistics.median(hist[name].values()) for name in profile if hist[name]}
    return {
        "history": {k: hist[k] for k in METRICS},
        "whole_s": whole_s,
        "profile": medians,
        "samples_generated": hist["compute/samples"][last],
        "samples_trained": sum(hist["learner/num_samples"].values()),
    }


def mlflow_run(run_dir: Path) -> tuple[str, str]:
    """The tracking URI and MLflow run id a finished run wrote into its summary (its store re-rooted
    where the run folder was moved or copied since)."""
    from tidal.mlflow_store import open_run_store

    summary = json.loads((run_dir / "summary.json").read_text())
    return open_run_store(run_dir, summary["mlflow_uri"]), summary["mlflow_run_id"]


def history(run_dir: Path, names: tuple[str, ...] = METRICS) -> dict[str, dict[int, float]]:
    """metric -> {step: value} of the run's MLflow record. A compute axis is logged at a step twice, when the
    step ends and when its evaluation completes: the earlier point is kept, the moment the weights of that
    version existed (an in-process loop's evaluation is timed the same way: from before it runs)."""
    from mlflow.tracking import MlflowClient

    from tidal.scaling import by_step

    uri, run_id = mlflow_run(run_dir)
    client = MlflowClient(uri)
    return {name: by_step(name, client.get_metric_history(run_id, name)) for name in names}


class HeldOut:
    """The one evaluation both sides of a comparison get, off their training path: `eval.n` samples of
    every held-out prompt at `eval.temperature` (mean@n, as a run's own evaluations), by tidal's
    warm-start evaluator on one CPU model into which each version's weights are loaded. Seeded per
    version, so two systems' weights of equal quality get the same sampling noise."""

    def __init__(self, cfg):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tidal.models import resolve_model_path
        from tidal.tasks import get_reward, get_task

        path = resolve_model_path(cfg.model, cfg.task)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.prompts = [p for p in get_task(cfg.task.name).load_prompts(cfg.task).val for _ in range(cfg.eval.n)]
        self.reward = get_reward(cfg.task)
        self.temperature, self.max_tokens = cfg.eval.temperature, cfg.sampling.max_tokens

    def __call__(self, state: dict, version: int) -> float:
        """The held-out pass rate of the weights in `state` (name -> tensor, the model's own names)."""
        import torch

        from tidal.learner.tools.warmstart import pass_rate

        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding where the model ties it
        if missing or unexpected:
            raise SystemExit(
                f"bench: version {version}'s weights do not fit the model: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )
        self.model.tie_weights()
        torch.manual_seed(version)
        with torch.no_grad():
            return pass_rate(self.model, self.tokenizer, self.prompts, self.reward, self.temperature, self.max_tokens)


def evaluate_weight_files(cfg, folder: Path, steps: list[int]) -> dict[int, float]:
    """{step: held-out pass rate} of the weight files a run's file channel kept in `folder`
    (weights-v<step>.safetensors, what the actors served at that version)."""
    from safetensors.torch import load_file

    held_out = HeldOut(cfg)
    return {step: held_out(load_file(folder / f"weights-v{step:06d}.safetensors"), step) for step in steps}


def time_to_target(hist: dict[str, dict[int, float]], target: float) -> dict:
    """Samples and seconds until the weights whose eval/pass_rate first reached `target` existed (None when
    none did). Seconds count from the end of the step-0 evaluation, so start-up is left out; the learner's
    steps and the evaluations on the way are in."""
    evals = sorted(hist["eval/pass_rate"].items())
    start = hist["compute/wall_s"].get(0, 0.0)
    hit = next(((step, rate) for step, rate in evals if step > 0 and rate >= target), None)
    return {
        "final_pass_rate": round(evals[-1][1], 4),
        "steps": evals[-1][0],
        "samples": hist["compute/samples"].get(evals[-1][0]),
        "wall_s": round(hist["compute/wall_s"].get(evals[-1][0], 0.0) - start, 2),
        "samples_to_target": hist["compute/samples"][hit[0]] if hit else None,
        "time_to_target_s": round(hist["compute/wall_s"][hit[0]] - start, 2) if hit else None,
        "step_at_target": hit[0] if hit else None,
    }


def bootstrap_ratio(base: list[float], other: list[float], rng: np.random.Generator, n: int = 2000) -> list:
    """90% interval of median(base) / median(other), resampling the seeds of each side."""
    if not base or not other:
        return [None, None]
    ratios = [np.median(rng.choice(base, len(base))) / np.median(rng.choice(other, len(other))) for _ in range(n)]
    return [round(float(q), 3) for q in np.quantile(ratios, [0.05, 0.95])]


def finish_pass_rate_figure(fig, ax, target: float, title: str, png: Path, dpi: int = 100) -> None:
    """A pass-rate-against-wall-time figure's target line, labels and legend, saved to `png`."""
    from tidal.scaling import save_figure

    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.2f}")
    ax.set(xlabel="wall time since the step-0 evaluation (s)", ylabel="val pass rate", title=title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, png, dpi=dpi)
