"""What a run shows beyond its scalar metrics: a table of sample completions at every evaluation,
and figures at every checkpoint and at the end (pass rate against steps and compute with the fitted
sigmoid, the token-lag histogram, behaviour against learner logprobs, rewards and lengths).

Everything here is drawn from bounded samples of the training stream (reservoirs, a lag histogram
by value), so memory stays flat however long the run. The samples are not checkpointed: after a
resume the figures describe what this process trained on (the pass-rate curve comes from MLflow
and covers the whole run).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tidal.broker.schema import RolloutGroup
from tidal.learner.tracking import redacting_logger

log = redacting_logger(__name__)  # a figure that failed to reach MLflow names its URL


@dataclass
class TokenSample:
    """One step's trained tokens as the learner saw them at step start: every token's lag (as
    counts per lag) and a bounded random subset of (behaviour, learner) logprob pairs."""

    lag_counts: np.ndarray  # int64 [max lag + 1]: tokens per lag
    behavior: np.ndarray  # float32 [k]
    learner: np.ndarray  # float32 [k]


class Reservoir:
    """A uniform sample of at most `size` values from a stream of any length."""

    def __init__(self, size: int, seed: int = 0):
        self.size, self.seen = size, 0
        self.values = np.empty(size, dtype=np.float64)
        self.rng = np.random.default_rng(seed)

    def extend(self, values) -> None:
        for value in np.asarray(values, dtype=np.float64).ravel():
            if self.seen < self.size:
                self.values[self.seen] = value
            else:
                slot = self.rng.integers(0, self.seen + 1)
                if slot < self.size:
                    self.values[slot] = value
            self.seen += 1

    def sample(self) -> np.ndarray:
        return self.values[:min(self.seen, self.size)]


class Diagnostics:
    """Collects what the tables and figures show, and hands them to the tracker."""

    def __init__(self, tracker, decode: Callable[[np.ndarray], str], run_dir: Path, completions_per_eval: int,
                 max_lag: int, reservoir: int = 4096, pass_threshold: float = 1.0):
        self.tracker, self.decode, self.run_dir = tracker, decode, run_dir
        self.completions_per_eval, self.max_lag = completions_per_eval, max_lag
        self.pass_threshold = pass_threshold  # task.pass_threshold: the table's `passed` column and the figure's label
        self.shown: dict[int, set[str]] = {}  # eval version -> group ids whose completions go in its table
        self.rows: dict[int, list[dict]] = {}
        self.lags: Counter = Counter()  # lag -> trained tokens, over every step of this process
        self.behavior, self.learner = Reservoir(reservoir, 1), Reservoir(reservoir, 1)
        self.rewards, self.lengths = Reservoir(reservoir, 2), Reservoir(reservoir, 3)

    # ---- completions ----------------------------------------------------------------------------

    def expect_eval(self, version: int, group_ids: list[str], n: int) -> None:
        """Which of an evaluation's groups its table shows: the first in dispatch order, so the
        table does not favour the prompts that finish fastest."""
        if self.completions_per_eval > 0:
            self.shown[version] = set(group_ids[:math.ceil(self.completions_per_eval / max(n, 1))])
            self.rows[version] = []

    def on_eval_group(self, group: RolloutGroup, arrived_at: int) -> None:
        if group.group_id not in self.shown.get(group.eval_version, ()):
            return
        prompt = self.decode(group.prompt_tokens.numpy("i4", "prompt_tokens"))
        for sample, tokens, _ in group.unpack():
            versions = [v for v, _, _ in sample.version_spans] or [group.eval_version]
            self.rows[group.eval_version].append({
                "prompt": prompt, "completion": self.decode(tokens),
                "reward": sample.task_reward, "passed": sample.task_reward >= self.pass_threshold,
                "finish_reason": sample.finish_reason, "tokens": sample.num_tokens,
                "versions": f"{min(versions)}..{max(versions)}" if min(versions) != max(versions) else str(versions[0]),
                "lag": arrived_at - min(versions), "actor": group.actor_id, "group_id": group.group_id,
                **(self.episode_columns(sample, tokens) if sample.episode is not None else {})})

    def episode_columns(self, sample, tokens: np.ndarray) -> dict:
        """An episode's turns one by one: what the model wrote and what the environment (its messages
        and tools' outputs, through the chat template) answered, with the versions of each model turn."""
        pieces, start = [], 0
        versions = sample.versions()
        for begin, end in [*sample.injected_spans, (sample.num_tokens, sample.num_tokens)]:
            if begin > start:
                turn = versions[start:begin]
                pieces.append({"by": "model", "text": self.decode(tokens[start:begin]),
                               "versions": sorted({int(v) for v in turn})})
            if end > begin:
                pieces.append({"by": "environment", "text": self.decode(tokens[begin:end])})
            start = end
        e = sample.episode
        return {"turns": e.turns, "tool_calls": e.tool_calls, "tool_errors": e.tool_errors,
                "tool_timeouts": e.tool_timeouts, "env_error": e.env_error, "conversation": pieces}

    def eval_done(self, version: int) -> None:
        """Log the evaluation's table: eval/completions-step-<version>.json in the MLflow run."""
        rows = self.rows.pop(version, None)
        self.shown.pop(version, None)
        if rows:
            keys = dict.fromkeys(key for row in rows for key in row)  # episode columns: rows of episodes only
            columns = {key: [row.get(key) for row in rows] for key in keys}
            self.tracker.log_table(columns, f"eval/completions-step-{version:06d}.json")

    # ---- the training stream --------------------------------------------------------------------

    def on_step(self, groups: list[RolloutGroup], tokens: TokenSample | None) -> None:
        for group in groups:
            self.rewards.extend([s.reward for s in group.samples])
            self.lengths.extend([s.num_tokens for s in group.samples])
        if tokens is not None:
            self.lags.update({lag: int(c) for lag, c in enumerate(tokens.lag_counts) if c})
            self.behavior.extend(tokens.behavior)
            self.learner.extend(tokens.learner)

    # ---- figures --------------------------------------------------------------------------------

    def draw(self, version: int) -> list[Path]:
        """The figures as PNGs in run_dir/figures/step-<version>/, logged to MLflow under the same path.
        A figure that cannot be drawn yet (too few eval points for a fit) is left out, not an error."""
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        folder = self.run_dir / "figures" / f"step-{version:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, draw in (("pass_rate", self._pass_rate), ("token_lag", self._token_lag),
                           ("logprob_mismatch", self._mismatch), ("rewards_lengths", self._rewards_lengths)):
            try:
                fig = draw()
            except Exception as err:  # a figure is worth a warning, never the run
                log.warning("figure %s at step %d not drawn: %s", name, version, err)
                continue
            if fig is not None:
                paths.append(_save(fig, folder / f"{name}.png"))
        if paths:
            self.tracker.log_artifacts(folder, f"figures/step-{version:06d}")
        return paths

    def _pass_rate(self):
        from tidal import scaling

        steps, compute, rate = self.tracker.eval_curve("compute/flops")
        if not steps:
            return None
        fig, (by_step, by_compute) = _subplots(2)
        by_step.plot(steps, rate, "o-", ms=4)
        label = f"val pass rate (reward >= {self.pass_threshold:g})"  # eval/pass_rate, never the mean reward
        by_step.set(xlabel="optimizer step", ylabel=label, ylim=(0, 1.02), title="pass rate by step")
        c, r = np.asarray(compute, dtype=float), np.asarray(rate, dtype=float)
        by_compute.scatter(c[c > 0], r[c > 0], s=16, label="measured")
        try:
            fit = scaling.fit_sigmoid(c, r, intervals=False)  # the curve only; `tidal fit` gives intervals
            grid = np.geomspace(c[c > 0].min(), 4 * c.max(), 200)
            by_compute.plot(grid, fit.predict(grid), "-", label=f"sigmoid A={fit.A:.2f} B={fit.B:.2f}")
        except (scaling.ScalingFitError, ValueError) as err:  # too few or flat points so far
            by_compute.set_title(f"no sigmoid fit yet: {str(err)[:60]}", fontsize=8)
        else:
            by_compute.set_title("pass rate by compute (ScaleRL sigmoid)")
        if (c > 0).any():
            by_compute.set_xscale("log")
        by_compute.set(xlabel="compute (FLOPs)", ylabel=label, ylim=(0, 1.02))
        by_compute.legend(fontsize=7)
        return fig

    def _token_lag(self):
        if not self.lags:
            return None
        fig, (ax,) = _subplots(1)
        lags = sorted(self.lags)
        ax.bar(lags, [self.lags[lag] for lag in lags], width=0.8)
        ax.axvline(self.max_lag + 0.5, color="C3", ls="--", label=f"staleness.max_lag = {self.max_lag}")
        total = sum(self.lags.values())
        mean = sum(lag * c for lag, c in self.lags.items()) / total
        ax.set(xlabel="token lag (learner version - token's version)", ylabel="trained tokens",
               title=f"token lag over {total:,} trained tokens (mean {mean:.2f})")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        return fig

    def _mismatch(self):
        b, lp = self.behavior.sample(), self.learner.sample()
        if not b.size:
            return None
        fig, (scatter, diff) = _subplots(2)
        scatter.scatter(b, lp, s=3, alpha=0.3)
        lo = float(min(b.min(), lp.min()))
        scatter.plot([lo, 0], [lo, 0], "k--", lw=0.8)
        scatter.set(xlabel="behaviour logprob (actor)", ylabel="learner logprob at step start",
                    title=f"{b.size:,} sampled tokens")
        diff.hist(lp - b, bins=60)
        diff.set(xlabel="log rho = learner - behaviour", ylabel="tokens",
                 title=f"mean |log rho| = {np.abs(lp - b).mean():.3g}")
        return fig

    def _rewards_lengths(self):
        rewards, lengths = self.rewards.sample(), self.lengths.sample()
        if not rewards.size:
            return None
        fig, (r, n) = _subplots(2)
        r.hist(rewards, bins=min(30, max(len(np.unique(rewards)), 2)))
        r.set(xlabel="reward (as trained)", ylabel="samples", title=f"mean reward {rewards.mean():.3f}")
        n.hist(lengths, bins=30)
        n.set(xlabel="completion tokens", ylabel="samples", title=f"mean length {lengths.mean():.1f}")
        return fig


def _subplots(count: int):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, count, figsize=(5.5 * count, 4), squeeze=False)
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
    return fig, axes[0]


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
