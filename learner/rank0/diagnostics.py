"""What a run shows beyond its scalar metrics: a table of sample completions at every evaluation,
a table of sampled training rollouts every `tracking.rollout_table_every` steps, and figures at every
checkpoint and at the end (pass rate against steps and compute with the fitted sigmoid, the token-lag
histogram, behaviour against learner logprobs, rewards and lengths).

Everything here is drawn from bounded samples of the training stream (reservoirs, a lag histogram
by value), so memory stays flat however long the run. The samples are not checkpointed: after a
resume the figures describe what this process trained on (the pass-rate curve comes from MLflow
and covers the whole run).
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tidal.broker.schema import RolloutGroup
from tidal.config import TrackingConfig
from tidal.learner.every_rank.trainer import TokenSample
from tidal.learner.rank0.admission import pass_score
from tidal.learner.rank0.tracking import redacting_logger
from tidal.run_files import ROLLOUTS_FILE, rollout_text

log = redacting_logger(__name__)  # a figure that failed to reach MLflow names its URL

TITLE_WIDTH = 60  # characters per line of a panel's small-print title: a half-width panel holds about this many
MAX_REWARD_BARS = 12  # distinct rewards drawn a bar each; more are binned
PRINT_SAMPLES_ENV = "TIDAL_PRINT_SAMPLES"  # rollouts of each rollout table the learner also writes to its log


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
        return self.values[: min(self.seen, self.size)]


class Diagnostics:
    """Collects what the tables and figures show, and hands them to the tracker."""

    def __init__(
        self,
        tracker,
        decode: Callable[[np.ndarray], str],
        run_dir: Path,
        completions_per_eval: int,
        max_lag: int,
        reservoir: int = 4096,
        pass_threshold: float = 1.0,
        pass_on: str = "",
        rollout_table_every: int = TrackingConfig.rollout_table_every,
        rollout_table_rows: int = TrackingConfig.rollout_table_rows,
        print_samples: int | None = None,
    ):
        self.tracker, self.decode, self.run_dir = tracker, decode, run_dir
        self.rollout_table_every, self.rollout_table_rows = rollout_table_every, rollout_table_rows
        self.print_samples = _print_samples_from_env() if print_samples is None else print_samples
        self.completions_per_eval, self.max_lag = completions_per_eval, max_lag
        # task.pass_threshold and task.pass_on: the table's `passed` column and the figure's label
        self.pass_threshold, self.pass_on = pass_threshold, pass_on
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
            self.shown[version] = set(group_ids[: math.ceil(self.completions_per_eval / max(n, 1))])
            self.rows[version] = []

    def on_eval_group(self, group: RolloutGroup, arrived_at: int) -> None:
        if group.group_id not in self.shown.get(group.eval_version, ()):
            return
        prompt = self.decode(group.prompt_tokens.numpy("i4", "prompt_tokens"))
        for sample, tokens, _ in group.unpack():
            versions = [v for v, _, _ in sample.version_spans] or [group.eval_version]
            self.rows[group.eval_version].append(
                {
                    "prompt": prompt,
                    "completion": self.decode(tokens),
                    "reward": sample.task_reward,
                    "passed": pass_score(sample, self.pass_on) >= self.pass_threshold,
                    "finish_reason": sample.finish_reason,
                    "tokens": sample.num_tokens,
                    "versions": _versions_text(versions),
                    "lag": arrived_at - min(versions),
                    "actor": group.actor_id,
                    "group_id": group.group_id,
                    **(self.episode_columns(sample, tokens) if sample.episode is not None else {}),
                }
            )

    def episode_columns(self, sample, tokens: np.ndarray) -> dict:
        """An episode's turns one by one: what the model wrote and what the environment (its messages
        and tools' outputs, through the chat template) answered, with the versions of each model turn."""
        pieces, start = [], 0
        versions = sample.versions()
        for begin, end in [*sample.injected_spans, (sample.num_tokens, sample.num_tokens)]:
            if begin > start:
                turn = versions[start:begin]
                pieces.append(
                    {
                        "by": "model",
                        "text": self.decode(tokens[start:begin]),
                        "versions": sorted({int(v) for v in turn}),
                    }
                )
            if end > begin:
                pieces.append({"by": "environment", "text": self.decode(tokens[begin:end])})
            start = end
        e = sample.episode
        return {
            "turns": e.turns,
            "tool_calls": e.tool_calls,
            "tool_errors": e.tool_errors,
            "tool_timeouts": e.tool_timeouts,
            "env_error": e.env_error,
            "conversation": pieces,
        }

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

    # ---- sampled training rollouts --------------------------------------------------------------

    def rollouts_due(self, step: int) -> bool:
        """Whether step `step` (the one that makes version `step`) logs a rollout table."""
        return self.rollout_table_every > 0 and self.rollout_table_rows > 0 and step % self.rollout_table_every == 0

    def log_rollouts(self, groups: list[RolloutGroup], advantages: list[np.ndarray], version: int) -> list[dict]:
        """A table of up to rollout_table_rows rollouts the step at `version` trained on, chosen at random
        (seeded by the step) so that it does not favour the groups that arrived first; `advantages[group]
        [sample]` as the step computed them. Logged as rollouts/step-<step>.json in the MLflow run and as
        a line of run_dir/rollouts.jsonl; only the chosen rows are decoded."""
        step = version + 1
        rows = []
        for g, picked in _pick_rollouts(groups, self.rollout_table_rows, seed=step).items():
            group, arrays = groups[g], groups[g].unpack()
            prompt = self.decode(group.prompt_tokens.numpy("i4", "prompt_tokens"))
            rows += [
                self._rollout_row(step, version, group, arrays[i], prompt, float(advantages[g][i])) for i in picked
            ]
        if not rows:
            return rows
        keys = dict.fromkeys(key for row in rows for key in row)  # reward components: where a task gives them
        self.tracker.log_table({key: [row.get(key) for row in rows] for key in keys}, f"rollouts/step-{step:06d}.json")
        with open(self.run_dir / ROLLOUTS_FILE, "a") as f:
            f.write(json.dumps({"step": step, "rows": rows}) + "\n")
        for row in rows[: self.print_samples]:
            log.info("%s", rollout_text(row))
        return rows

    def _rollout_row(self, step: int, version: int, group: RolloutGroup, arrays, prompt: str, advantage: float) -> dict:
        sample, tokens, _ = arrays
        versions = [v for v, _, _ in sample.version_spans] or [version]
        components = getattr(sample, "reward_components", None) or {}  # the task's reward functions, by name
        return {
            "step": step,
            "prompt": prompt,
            "completion": self.decode(tokens),
            "reward": sample.reward,
            "task_reward": sample.task_reward,
            **{f"reward/{k}": float(v) for k, v in components.items()},
            "advantage": advantage,
            "versions": _versions_text(versions),
            "lag": version - min(versions),  # the learner's version at step start less the oldest token's
            "finish_reason": sample.finish_reason,
            "tokens": sample.num_tokens,
            "actor": group.actor_id,
            "group_id": group.group_id,
        }

    # ---- figures --------------------------------------------------------------------------------

    def draw(self, version: int, first_step: int = 1) -> list[Path]:
        """The figures as PNGs in run_dir/figures/step-<version>/, logged to MLflow under the same path.
        `first_step`: the first step this process trained (a resumed learner's checkpoint version + 1),
        so that the titles of the figures drawn from the training stream name the steps they cover.
        A figure that cannot be drawn yet (too few eval points for a fit) is left out, not an error."""
        folder = self.run_dir / "figures" / f"step-{version:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        trained = (first_step, version)  # the steps the samples behind the stream's figures come from
        paths = []
        for name, draw in (
            ("pass_rate", self._pass_rate),
            ("token_lag", lambda: self._token_lag(trained)),
            ("logprob_mismatch", lambda: self._mismatch(trained)),
            ("rewards_lengths", lambda: self._rewards_lengths(trained)),
        ):
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
        fig, (by_step, by_compute) = _subplots(2, self._heading((steps[0], steps[-1])))
        by_step.plot(steps, rate, "o-", ms=4)
        label = f"val pass rate ({self.pass_on or 'reward'} >= {self.pass_threshold:g})"  # never the mean reward
        by_step.set(xlabel="optimizer step", ylabel=label, ylim=(0, 1.02), title="pass rate by step")
        c, r = np.asarray(compute, dtype=float), np.asarray(rate, dtype=float)
        by_compute.scatter(c[c > 0], r[c > 0], s=16, label="measured")
        end = c.max()  # of the compute axis: the last eval, or past it where a fit extrapolates
        try:
            fit = scaling.fit_sigmoid(c, r, intervals=False)  # the curve only; `tidal fit` gives intervals
            # as `tidal fit` draws it: solid over the compute measured so far, dashed beyond
            end = 4 * c.max()
            if scaling.draw_curve(by_compute, fit, c[c > 0].min(), end, "C0", "sigmoid"):
                by_compute.plot([], [], "--", color="grey", label="extrapolated (past the measured compute)")
        except (scaling.ScalingFitError, ValueError) as err:  # too few or flat points so far
            # wrapped, never cut: the reason says how many points there are and how many the fit needs
            by_compute.set_title(textwrap.fill(f"no sigmoid fit yet: {err}", TITLE_WIDTH), fontsize=8)
        else:
            by_compute.set_title("pass rate by compute (ScaleRL sigmoid)")
        if (c > 0).any():
            by_compute.set_xscale("log")
            # from a label at or before the first point to one at or past the end, a little room each side
            by_compute.set_xlim(*scaling.log_limits(c[c > 0].min() / 1.1, end * 1.1))
            scaling.log_ticks(by_compute.xaxis)  # after the limits: the ticks suit the range they span
        by_compute.set(xlabel="compute (FLOPs)", ylabel=label, ylim=(0, 1.02))
        by_compute.legend(fontsize=7)
        return fig

    def _token_lag(self, trained: tuple[int, int]):
        from matplotlib.ticker import MaxNLocator

        if not self.lags:
            return None
        fig, (ax,) = _subplots(1, self._heading(trained))
        lags = sorted(self.lags)
        # linear counts, each bar labelled: on a log axis a bar of 30 tokens looked a third as tall as one of 10^5
        bars = ax.bar(lags, [self.lags[lag] for lag in lags], width=0.8)
        ax.bar_label(
            bars,
            labels=[_count_text(self.lags[lag]) for lag in lags],
            fontsize=7,
            rotation=90 if len(lags) > 12 else 0,
            padding=2,
        )
        ax.margins(y=0.12)  # room above the tallest bar for its label
        ax.axvline(self.max_lag + 0.5, color="C3", ls="--", label=f"staleness.max_lag = {self.max_lag}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # a lag is a whole number of versions
        total = sum(self.lags.values())
        mean = sum(lag * c for lag, c in self.lags.items()) / total
        ax.set(
            xlabel="token lag (learner version - token's version)",
            ylabel="trained tokens",
            title=f"token lag over {total:,} trained tokens (mean {mean:.2f})",
        )
        ax.legend(fontsize=7)
        return fig

    def _mismatch(self, trained: tuple[int, int]):
        b, lp = self.behavior.sample(), self.learner.sample()
        if not b.size:
            return None
        fig, (scatter, diff) = _subplots(2, self._heading(trained))
        scatter.scatter(b, lp, s=3, alpha=0.3)
        lo = float(min(b.min(), lp.min()))
        scatter.plot([lo, 0], [lo, 0], "k--", lw=0.8)
        scatter.set(
            xlabel="behaviour logprob (actor)",
            ylabel="learner logprob at step start",
            title=f"{b.size:,} sampled tokens",
        )
        diff.hist(lp - b, bins=60)
        diff.set(
            xlabel="log rho = learner - behaviour",
            ylabel="tokens",
            title=f"mean |log rho| = {np.abs(lp - b).mean():.3g}",
        )
        return fig

    def _rewards_lengths(self, trained: tuple[int, int]):
        rewards, lengths = self.rewards.sample(), self.lengths.sample()
        if not rewards.size:
            return None
        fig, (r, n) = _subplots(2, self._heading(trained))
        _reward_bars(r, rewards)
        r.set(ylabel="samples", title=f"mean reward {rewards.mean():.3f}")
        n.hist(lengths, bins=30)
        n.set(xlabel="completion tokens", ylabel="samples", title=f"mean length {lengths.mean():.1f}")
        return fig

    def _heading(self, steps: tuple[int, int]) -> str:
        """A figure's title: the run (its folder's name, which `runs/<name>-<time>` makes unique where
        the MLflow run name often is not) and the steps the figure covers."""
        return f"{self.run_dir.name}: steps {steps[0]}-{steps[1]}"


def _reward_bars(ax, rewards: np.ndarray) -> None:
    """The rewards' distribution: a bar per distinct value when there are few (a pass/fail reward with a
    format bonus takes 0, 0.2, 1 and 1.2: equal-width bins merged 0 with 0.2 and hid the bonus), else a
    histogram."""
    values, counts = np.unique(rewards, return_counts=True)
    if values.size > MAX_REWARD_BARS:
        ax.hist(rewards, bins=30)
        ax.set_xlabel("reward (as trained)")
        return
    from matplotlib.ticker import MaxNLocator

    bars = ax.bar(np.arange(values.size), counts, width=0.7, tick_label=[f"{v:.3g}" for v in values])
    ax.bar_label(bars, labels=[_count_text(int(k)) for k in counts], fontsize=7, padding=2)
    ax.margins(y=0.12)  # room above the tallest bar for its label
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of samples
    ax.set_xlabel("reward (as trained), a bar per value")


def _versions_text(versions: list[int]) -> str:
    """'3' for one version, '3..4' for a completion a weight update landed in."""
    return f"{min(versions)}..{max(versions)}" if min(versions) != max(versions) else str(versions[0])


def _pick_rollouts(groups: list[RolloutGroup], count: int, seed: int) -> dict[int, list[int]]:
    """group index -> indices of its chosen samples: `count` of all the step's samples, drawn
    uniformly without replacement, in batch order."""
    where = [(g, i) for g, group in enumerate(groups) for i in range(len(group.samples))]
    chosen = np.random.default_rng(seed).choice(len(where), size=min(count, len(where)), replace=False)
    picked: dict[int, list[int]] = {}
    for k in sorted(chosen.tolist()):
        picked.setdefault(where[k][0], []).append(where[k][1])
    return picked


def _print_samples_from_env() -> int:
    """How many of each rollout table's rows the learner writes to its log: $TIDAL_PRINT_SAMPLES, else 0."""
    value = os.environ.get(PRINT_SAMPLES_ENV, "").strip() or "0"
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"${PRINT_SAMPLES_ENV}={value!r}: expected a count of rollouts (0 or more)")
    return count


def _subplots(count: int, heading: str):
    from tidal import scaling  # scipy with it: imported when a figure is drawn, as in _pass_rate

    fig, axes = scaling.figure(count, figsize=(5.5 * count, 4), squeeze=False)
    fig.suptitle(heading, fontsize=10)
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
    return fig, axes[0]


def _count_text(count: int) -> str:
    """A bar's count in at most six characters, so that neighbouring labels do not run together:
    9,500, 12.3k, 4.5M."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if count >= max(scale, 10_000):
            return f"{count / scale:.3g}{suffix}"
    return f"{count:,}"


def _save(fig, path: Path) -> Path:
    from tidal import scaling

    return scaling.save_figure(fig, path, dpi=110)
