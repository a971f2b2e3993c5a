"""Environments written for skyrl-gym, trained on tidal unchanged (`pip install tidal[skyrl]`).

    task.name: skyrl
    task.data_path: train.parquet      # skyrl-gym's dataset rows: prompt (chat messages), env_class,
                                       # reward_spec, extra_info, ... (JSON Lines too)
    task.chat_template: true
    env.kwargs: {env_class: ..., env_config: {...}, imports: [my_pkg.envs], max_turns: 5}

Each episode makes its own environment (`skyrl_gym.make(env_class, env_config, extras)`, the row's
fields as extras), calls its `init` with the prompt, then `step` with each model turn's text; each
step's observations are the environment's messages, its reward is added to the episode's (so an
environment with turn-level rewards gets their sum) and `done` ends the episode, which then `close`s
its environment. A row's `env_class` wins over `env.kwargs.env_class`; modules in
`env.kwargs.imports` are imported first, so that environments they register (`skyrl_gym.register`)
can be made. What tidal does not take from skyrl-gym: the prompt `init` returns (tidal's prompt is
the row's, encoded on the learner) and a step's `postprocessed_action` (tidal trains on the tokens
as sampled).
"""

from __future__ import annotations

import json

from tidal.config import ConfigError, TaskConfig
from tidal.tasks import Prompt, Split
from tidal.tasks.data import load_rows, split_rows
from tidal.tasks.env import Env, Turn
from tidal.tasks.user_code import import_module

PAYLOAD_CHARS = 65_536  # a payload value's bound on the wire
DEFAULT_MAX_TURNS = 5  # told to an environment whose row does not say (skyrl-gym's generator always does)


def load_prompts(cfg: TaskConfig) -> Split:
    """The dataset's rows, each with its fields (the prompt aside) as the episode's extras."""
    read = lambda source, key, split: load_rows(
        source, key, cfg.prompt_field, "", split=split, config=cfg.data_config, every_column=True
    )
    rows = read(cfg.data_path, "task.data_path", cfg.data_split)
    val_rows = read(cfg.val_path, "task.val_path", cfg.val_split) if cfg.val_path else []
    return split_rows(cfg, rows, val_rows, lambda i, row: _prompt(i, row, cfg))


def _prompt(prompt_id: int, row: dict, cfg: TaskConfig) -> Prompt:
    messages = row[cfg.prompt_field]
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    extras = {k: v for k, v in row.items() if k != cfg.prompt_field}
    payload = {
        "env_class": str(row.get("env_class") or ""),
        "extras": json.dumps(extras, default=str),
        "prompt": json.dumps(messages),
    }
    long = [k for k, v in payload.items() if len(v) > PAYLOAD_CHARS]
    if long:
        raise ConfigError(
            f"{cfg.data_path}: row {prompt_id}: its {long[0]} is over {PAYLOAD_CHARS} characters "
            "as JSON, more than a prompt's payload may carry"
        )
    return Prompt(prompt_id, "", payload, messages=tuple(messages))


OPTIONS: dict[str, str] = {}  # task.kwargs: none; the environment's are env.kwargs


class Environment(Env):
    """One skyrl-gym environment per episode, made from the row's class and fields."""

    options = {
        "imports": "modules that register environments with skyrl-gym, imported first",
        "env_class": "the class for rows without one",
        "env_config": "skyrl-gym's config of each environment",
        "max_turns": "model turns per episode, at most",
    }

    def __init__(self, cfg: TaskConfig, kwargs: dict | None = None):
        super().__init__(cfg, kwargs)
        try:
            import skyrl_gym
        except ModuleNotFoundError:
            raise ConfigError(
                "config key 'task.name' = 'skyrl': skyrl-gym is not installed (pip install tidal[skyrl])"
            ) from None
        from omegaconf import OmegaConf

        for module in self.kwargs.get("imports", []):  # each registers its environments with skyrl-gym
            import_module(module, f"config key 'env.kwargs.imports' entry {module!r}")
        self.make = skyrl_gym.make
        self.env_class = self.kwargs.get("env_class", "")  # for rows without one
        self.env_config = OmegaConf.create(dict(self.kwargs.get("env_config", {})))
        self.max_turns_hint = int(self.kwargs.get("max_turns", DEFAULT_MAX_TURNS))

    def start(self, payload: dict[str, str]):
        env_class = payload["env_class"] or self.env_class
        if not env_class:
            raise ValueError("the row has no env_class, and env.kwargs.env_class is unset")
        extras = json.loads(payload["extras"])
        extras.setdefault("max_turns", self.max_turns_hint)
        env = self.make(env_class, env_config=self.env_config, extras=extras)
        env.init(json.loads(payload["prompt"]))
        return env

    def step(self, env, reply: str) -> Turn:
        out = env.step(reply)
        if not (isinstance(out, dict) and "done" in out):
            raise TypeError(
                f"{type(env).__name__}.step returned {type(out).__name__} {repr(out)[:60]}, not a "
                "BaseTextEnvStepOutput (observations, reward, done)"
            )
        return Turn(
            messages=list(out.get("observations") or []), done=bool(out["done"]), reward=float(out.get("reward") or 0.0)
        )

    def finish(self, env) -> None:
        env.close()
