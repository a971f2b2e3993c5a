"""Running totals of a run and where each point sits on the compute axes a scaling fit uses.

FLOPs: 2 N per generated or prompt token on the actors, 6 N per token the learner computes
(forward and backward), N the policy's parameters. Device-hours: wall time x devices in use
(the live actors and the learner's ranks), integrated since the start. Totals survive a resume,
so the axes continue where the checkpoint left them.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque

COMPONENT = "reward_component_"  # stats keys of reward functions' values: <COMPONENT>{n,sum,sq}/<name>
RATE_WINDOW_STEPS = 10  # throughputs are measured over this many recent steps, not since the start


class RecentRate:
    """How fast a running total grew over the last `steps` observations: (total now - total then) /
    (time now - time then). A since-start average would hide a slowdown for the rest of a long run."""

    def __init__(self, steps: int = RATE_WINDOW_STEPS):
        self.points: deque[tuple[float, float]] = deque(maxlen=steps + 1)  # (time, running total)

    def add(self, when: float, total: float) -> float | None:
        """The rate with this observation; None until two are in the window."""
        self.points.append((when, total))
        (t0, total0), (t1, total1) = self.points[0], self.points[-1]
        return (total1 - total0) / (t1 - t0) if t1 > t0 else None


class Accounting:
    def __init__(self, num_params: int, learner_devices: int):
        self.num_params = num_params
        self.learner_devices = learner_devices
        self.totals: Counter = Counter()
        self.by_actor: Counter = Counter()  # rollout groups received per actor id
        self.start_time = time.monotonic()
        self.device_seconds = 0.0
        self.last_axis_time = self.start_time
        self.gen_rate = RecentRate()  # from the first step on: the start-up (engines, first evaluation) is no step

    def received(self, actor_id: str) -> None:
        self.by_actor[actor_id] += 1

    def compute_axis(self, num_actors: int) -> dict[str, float]:
        now = time.monotonic()
        self.device_seconds += (now - self.last_axis_time) * (num_actors + self.learner_devices)
        self.last_axis_time = now
        t, n = self.totals, self.num_params
        flops = 2 * n * (t["gen_tokens"] + t["prompt_tokens"]) + 6 * n * t["computed_tokens"]
        return {
            "compute/samples": float(t["samples"]),
            "compute/gen_tokens": float(t["gen_tokens"]),
            "compute/flops": float(flops),
            "compute/device_hours": self.device_seconds / 3600,
            "compute/wall_s": now - self.start_time,
        }

    def add_step(self, stats: Counter, computed_tokens: int) -> dict[str, float]:
        """Fold one step's counts into the totals; returns the step's rollout and staleness metrics."""
        self.totals.update(stats)
        self.totals["steps"] += 1
        self.totals["computed_tokens"] += computed_tokens
        samples = max(stats["samples"], 1)
        gen_rate = self.gen_rate.add(time.monotonic(), self.totals["gen_tokens"])
        return {
            "rollout/reward": stats["reward_sum"] / samples,
            "rollout/reward_mean": stats["task_reward_sum"] / samples,
            "rollout/pass_rate": stats["passed"] / samples,
            "rollout/truncation_rate": stats["truncated"] / samples,
            "rollout/completion_len_mean": stats["gen_tokens"] / samples,
            "rollout/prompt_len_mean": stats["prompt_tokens"] / samples,
            "rollout/zero_variance_frac": stats["zero_variance"] / max(stats["groups_received"], 1),
            **({} if gen_rate is None else {"rollout/gen_tokens_per_s": gen_rate}),
            "rollout/multi_version_samples": float(stats["multi_version_samples"]),
            "rollout/injected_token_frac": stats["injected_tokens"] / max(stats["gen_tokens"], 1),
            **episode_metrics(stats),
            **reward_component_metrics(stats),
            "offpolicy/dropped_stale_groups": float(stats["dropped_stale"]),
            "offpolicy/stale_tokens": float(stats["stale_tokens"]),
            "offpolicy/masked_stale_tokens": float(stats["masked_stale_tokens"]),
        }

    def wall_s(self) -> float:
        return time.monotonic() - self.start_time

    def state_dict(self) -> dict:
        return {
            "totals": dict(self.totals),
            "by_actor": dict(self.by_actor),
            "device_seconds": self.device_seconds,
            "wall_s": self.wall_s(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.totals, self.by_actor = Counter(state["totals"]), Counter(state["by_actor"])
        self.device_seconds = state["device_seconds"]
        self.start_time = time.monotonic() - state["wall_s"]  # compute axes continue where they were
        self.last_axis_time = time.monotonic()
        self.gen_rate = RecentRate()  # the time between the checkpoint and the resume is nobody's rate


def episode_metrics(stats: Counter) -> dict[str, float]:
    """Episodes of several turns (or whose environment failed) in the step; none for single-turn tasks."""
    episodes = stats["episodes"]
    if not episodes:
        return {}
    return {
        "episode/turns_mean": stats["episode_turns"] / episodes,
        "episode/tool_calls_mean": stats["tool_calls"] / episodes,
        "episode/tool_error_rate": stats["tool_errors"] / max(stats["tool_calls"], 1),
        "episode/tool_timeout_rate": stats["tool_timeouts"] / max(stats["tool_calls"], 1),
        "episode/env_failed_frac": stats["env_errors"] / episodes,
        "episode/env_s_mean": stats["env_ms"] / 1000 / episodes,
    }


def reward_component_metrics(stats: Counter) -> dict[str, float]:
    """rewards/<name>/mean and /std of each reward function (task.reward_funcs) over the step's samples,
    from the sums `admission.count` keeps; none without reward functions."""
    out = {}
    for key in stats:
        if not key.startswith(f"{COMPONENT}n/"):
            continue
        name, num = key.split("/", 1)[1], stats[key]
        mean = stats[f"{COMPONENT}sum/{name}"] / num
        variance = max(stats[f"{COMPONENT}sq/{name}"] / num - mean * mean, 0.0)  # rounding can dip below 0
        out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = mean, math.sqrt(variance)
    return out
