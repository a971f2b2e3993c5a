"""The whole run: RunConfig (every section in the order of the tree), the rules that span
sections, and what is done with a loaded config: resolve (the one place it changes), to_yaml,
write_config, flatten (MLflow params) and redacted_config."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from omegaconf import OmegaConf

from tidal.config.actor import ActorConfig
from tidal.config.base import Section, _require, opt
from tidal.config.broker import BrokerConfig, WeightsConfig, WeightTransport, default_weights_dir
from tidal.config.learner import CheckpointConfig, CurriculumConfig, EvalConfig, LearnerConfig, StalenessConfig
from tidal.config.model import ModelConfig
from tidal.config.redact import redact_uri
from tidal.config.task import EnvConfig, SamplingConfig, TaskConfig
from tidal.config.tracking import TrackingConfig

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # what k8s/base/redis-users.sh reads as a name too


@dataclass(frozen=True)
class RunConfig(Section):
    """The whole run. Components receive only their own part."""

    name: str = opt(
        "tidal",
        "run name: part of the run folder's, the weights folder's and the Redis streams' names; "
        "letters, digits and _ . - (at most 128, starting with a letter or digit)",
    )
    run_dir: str = opt("", "output folder; empty = runs/<name>-<timestamp>")
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def check(self) -> None:
        """Each section's own rules, in the order of the tree, then the rules that span sections."""
        for part in dataclasses.fields(self):
            value = getattr(self, part.name)
            if isinstance(value, Section):
                value.check()
        _require(
            RUN_NAME.fullmatch(self.name) is not None,
            "name",
            self.name,
            "letters, digits and _ . - only, starting with a letter or digit, at most 128 characters (it names "
            "folders and Redis keys: a / or .. would put them outside their place)",
        )
        for rule in CROSS_SECTION_RULES:
            rule(self)


# ---- rules that span sections, each a named check ---------------------------------------------


def check_actor_holds_a_group(cfg: RunConfig) -> None:
    _require(
        cfg.actor.max_inflight >= cfg.sampling.n,
        "actor.max_inflight",
        cfg.actor.max_inflight,
        f"must hold at least one group (sampling.n = {cfg.sampling.n})",
    )


def check_colocated_weights(cfg: RunConfig) -> None:
    _require(
        not (cfg.actor.colocate and cfg.weights.transport == WeightTransport.nccl),
        "actor.colocate",
        cfg.actor.colocate,
        "actors on the learner's GPUs cannot take weights by nccl (NCCL refuses two ranks "
        "of one communicator on one GPU): use weights.transport=tcp or file",
    )


CROSS_SECTION_RULES = (check_actor_holds_a_group, check_colocated_weights)


def resolve(
    cfg: RunConfig, *, model_path: str | None = None, redis_url: str | None = None, actor: bool = False
) -> RunConfig:
    """The one place a loaded config changes: a new frozen config with what every process of a run
    must agree on filled in. Resolving a resolved config changes nothing but what is passed.

    - run_dir: absolute; runs/<name>-<time> when empty
    - model.path: `model_path` when given (the caller found or built the model)
    - weights.dir: the run's own folder in /dev/shm when empty (default_weights_dir)
    - broker.redis.url: `redis_url` when given (an embedded redis-server's)
    - actor.id, in an actor's own process (`actor=True`): actor-<actor.index> when empty
    """
    import time

    run_dir = Path(cfg.run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    broker = cfg.broker if redis_url is None else replace(cfg.broker, redis=replace(cfg.broker.redis, url=redis_url))
    actor_cfg = replace(cfg.actor, id=cfg.actor.id or f"actor-{cfg.actor.index}") if actor else cfg.actor
    return replace(
        cfg,
        run_dir=str(run_dir),
        broker=broker,
        actor=actor_cfg,
        model=cfg.model if model_path is None else replace(cfg.model, path=model_path),
        weights=replace(cfg.weights, dir=cfg.weights.dir or default_weights_dir(cfg.name, run_dir)),
    )


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def write_config(cfg: RunConfig, run_dir: Path) -> None:
    """The resolved config in the run directory (what `tidal run` writes too), for resumes and `tidal export`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(to_yaml(cfg))
    tmp.replace(run_dir / "config.yaml")  # atomic: actors may be reading it


def flatten(cfg: RunConfig) -> dict[str, str]:
    """Dotted keys -> values as strings, for MLflow params."""
    out: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, name + ".")
            else:
                out[name] = redact_uri(str(value)) if key.endswith(("url", "uri")) else str(value)

    walk(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True), "")
    return out


def redacted_config(cfg: RunConfig) -> RunConfig:
    """The config as it may be shown: the URIs that can carry credentials redacted (remote rewards'
    among task.reward_funcs too)."""
    redis = replace(cfg.broker.redis, url=redact_uri(cfg.broker.redis.url))
    funcs = [redact_uri(f) if f.startswith(("http://", "https://")) else f for f in cfg.task.reward_funcs]
    return replace(
        cfg,
        tracking=replace(cfg.tracking, uri=redact_uri(cfg.tracking.uri)),
        broker=replace(cfg.broker, redis=redis),
        task=replace(cfg.task, reward_funcs=funcs),
    )
