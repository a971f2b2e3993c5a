"""The one typed config tree of tidal: dataclasses, YAML presets in configs/, key=value overrides.

Each component is built from its own sub-config (`cfg.actor`, `cfg.learner`, ...), never the
whole tree. The schema documents and checks itself:

    field      opt(default, "help")          the help `tidal config explain` prints
    closed set an Enum                       a value outside it fails as the YAML or override merges
    section    its check()                   its own rules, beside its fields (a choice such as
                                             weights.transport selects which of its keys matter)
    run        RunConfig.check()             every section's, then CROSS_SECTION_RULES

Every mistake fails at load with one line naming the key (load_config); what needs the model or
the task's data read fails at preflight, before any process starts (tidal/ops/preflight.py).

One module per part of the tree; each imports only those above it in this list:

    base.py      ConfigError, opt, Section, choices, Dtype: what every section is built from
    redact.py    redact_uri: URIs fit for logs
    model.py     model.*      (model.tiny, model.tiny.warmstart)
    task.py      task.*, sampling.* (interrupt, overlong), env.*
    actor.py     actor.*      (actor.vllm), parse_cores
    broker.py    broker.*     (zmq, redis), weights.*, curve_on, default_weights_dir
    learner.py   learner.*    (loss, optim, fsdp), staleness.*, curriculum.*, eval.*, checkpoint.*
    tracking.py  tracking.*
    run.py       RunConfig, the cross-section rules, resolve, to_yaml, write_config, flatten
    load.py      load_config, presets, preset_path
    help.py      explain, field_help: `tidal config explain KEY`

Import every name from here (`from tidal.config import RunConfig, load_config`).
"""

from __future__ import annotations

from tidal.config.actor import (
    CORES_PATTERN,
    CPU_LINEAR_LAYOUTS,
    TIDAL_ENGINE_ARGS,
    ActorConfig,
    CpuLinear,
    OnUpdate,
    VllmConfig,
    parse_cores,
)
from tidal.config.base import ConfigError, Dtype, Section, choices, opt
from tidal.config.broker import (
    LOOPBACK,
    BrokerConfig,
    BrokerType,
    Curve,
    RedisConfig,
    WeightsConfig,
    WeightTransport,
    ZmqConfig,
    curve_on,
    default_weights_dir,
)
from tidal.config.help import describe, explain, field_help, kind_of, summary
from tidal.config.learner import (
    AdvantageNorm,
    Aggregation,
    Attention,
    CheckpointConfig,
    CurriculumConfig,
    EvalConfig,
    FsdpConfig,
    KernelBackend,
    LearnerConfig,
    LoraConfig,
    LossConfig,
    LossType,
    LrScaling,
    LrSchedule,
    MixedPrecision,
    OnViolation,
    OptimConfig,
    Packing,
    RatioLevel,
    RatioMode,
    StalenessConfig,
    compute_dtype,
    served_lora_rank,
)
from tidal.config.load import (
    OUTSIDE_CLOSED_SET,
    YAML_BOOLEAN_WORDS,
    layers_of,
    load_config,
    preset_path,
    presets,
    read_yaml,
    yaml_words,
)
from tidal.config.model import LmHead, ModelConfig, TinyModelConfig, WarmStartConfig
from tidal.config.redact import REDACTED, SECRET_PARAM, redact_uri
from tidal.config.run import (
    CROSS_SECTION_RULES,
    RunConfig,
    check_actor_holds_a_group,
    check_colocated_weights,
    flatten,
    redacted_config,
    resolve,
    to_yaml,
    write_config,
)
from tidal.config.task import (
    EnvConfig,
    InterruptConfig,
    OverlongConfig,
    SamplingConfig,
    TaskConfig,
    absolute_reward_files,
    reward_file,
)
from tidal.config.tracking import TrackingConfig

__all__ = [
    # base
    "ConfigError",
    "Dtype",
    "Section",
    "choices",
    "opt",
    # model, task, actor, broker, learner, tracking: the sections and their closed sets
    "LmHead",
    "ModelConfig",
    "TinyModelConfig",
    "WarmStartConfig",
    "EnvConfig",
    "InterruptConfig",
    "OverlongConfig",
    "SamplingConfig",
    "TaskConfig",
    "absolute_reward_files",
    "reward_file",
    "CORES_PATTERN",
    "CPU_LINEAR_LAYOUTS",
    "TIDAL_ENGINE_ARGS",
    "ActorConfig",
    "CpuLinear",
    "OnUpdate",
    "VllmConfig",
    "parse_cores",
    "LOOPBACK",
    "BrokerConfig",
    "BrokerType",
    "Curve",
    "RedisConfig",
    "WeightsConfig",
    "WeightTransport",
    "ZmqConfig",
    "curve_on",
    "default_weights_dir",
    "AdvantageNorm",
    "Aggregation",
    "Attention",
    "CheckpointConfig",
    "CurriculumConfig",
    "EvalConfig",
    "FsdpConfig",
    "KernelBackend",
    "LearnerConfig",
    "LoraConfig",
    "LossConfig",
    "LossType",
    "LrScaling",
    "LrSchedule",
    "MixedPrecision",
    "OnViolation",
    "OptimConfig",
    "Packing",
    "RatioLevel",
    "RatioMode",
    "StalenessConfig",
    "compute_dtype",
    "served_lora_rank",
    "TrackingConfig",
    # the whole run, loading, redaction and help
    "CROSS_SECTION_RULES",
    "RunConfig",
    "check_actor_holds_a_group",
    "check_colocated_weights",
    "flatten",
    "redacted_config",
    "resolve",
    "to_yaml",
    "write_config",
    "OUTSIDE_CLOSED_SET",
    "YAML_BOOLEAN_WORDS",
    "layers_of",
    "load_config",
    "preset_path",
    "presets",
    "read_yaml",
    "yaml_words",
    "REDACTED",
    "SECRET_PARAM",
    "redact_uri",
    "describe",
    "explain",
    "field_help",
    "kind_of",
    "summary",
]
