"""Loading a config: the schema <- YAML presets or files (each after the `base` it names) <-
key=value overrides, checked (load_config); the presets shipped in the package (presets, preset_path)."""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tidal.config.base import ConfigError
from tidal.config.run import RunConfig
from tidal.config.task import absolute_reward_files

# OmegaConf's words for a value outside an Enum field's set
OUTSIDE_CLOSED_SET = re.compile(r"Invalid value '.*', expected one of \[(.*)\]")


def _one_line(err: OmegaConfBaseException, overrides: list[str] = ()) -> str:
    """OmegaConf errors span several lines with a 'full_key' entry; keep the key and the reason
    (a value outside a closed set reads like the checks': the key, the value, the choices; a text
    that YAML read as a mapping or a list says how to quote it)."""
    key = getattr(err, "full_key", None) or getattr(err, "key", None)
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    outside = OUTSIDE_CLOSED_SET.fullmatch(reason)
    if key and outside and hasattr(err, "value"):
        return f"config key '{key}' = {err.value!r}: expected one of {outside.group(1)}"
    given = next((o.partition("=")[2] for o in reversed(overrides) if o.partition("=")[0] == key), None)
    if key and given and given[0] in "{[" and schema_type(key) is str:
        shape = "a mapping" if given[0] == "{" else "a list"
        return f"config key '{key}': {given} was read as {shape}, not text: quote it, \"{key}='{given}'\""
    return f"config key '{key}': {reason}" if key else f"config: {reason}"


def load_config(
    path: str | Path | list | tuple | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Schema <- YAML presets or files, in order (each after the `base` it names) <- key=value
    overrides, validated; raises ConfigError naming the key or the file. Reward functions named by
    file are made absolute here, once, so every process a run starts finds them."""
    paths = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not key=value")
    overrides = [cleared(o) for o in overrides]
    try:
        merged = OmegaConf.structured(RunConfig)
        for layer in paths:
            merged = OmegaConf.merge(merged, *map(yaml_words, layers_of(preset_path(layer))))
        merged = OmegaConf.merge(merged, yaml_words(parse_overrides(overrides)))
        cfg: RunConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_one_line(err, overrides)) from None
    cfg = replace(cfg, task=replace(cfg.task, reward_funcs=absolute_reward_files(cfg.task.reward_funcs)))
    cfg.check()
    return cfg


def schema_type(key: str):
    """The type the schema gives a dotted key; None for a key it does not have (or inside a dict)."""
    hint = RunConfig
    for part in key.split("."):
        hints = typing.get_type_hints(hint) if dataclasses.is_dataclass(hint) else {}
        if part not in hints:
            return None
        hint = hints[part]
    return hint


# what an empty override (`task.pass_on=`) means for a key of each type: the type's empty value (a dict
# has none: an override's mapping is merged into the one before it, never replacing it)
EMPTY_VALUES = {str: "''", list: "[]"}


def cleared(override: str) -> str:
    """`key=` as the key's empty value (`key=''` for a string, `key=[]` for a list): YAML reads nothing
    as null, which neither takes."""
    key, _, value = override.partition("=")
    hint = schema_type(key)
    empty = EMPTY_VALUES.get(typing.get_origin(hint) or hint) if hint is not None else None
    return f"{key}={empty}" if value == "" and empty else override


def parse_overrides(overrides: list[str]) -> DictConfig:
    """key=value overrides as one layer; a value YAML cannot read is one line naming the override."""
    import yaml

    try:
        return OmegaConf.from_dotlist(overrides)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        bad = next((o for o in overrides if not _reads(o)), overrides[0])
        key, _, value = bad.partition("=")
        hint = schema_type(key)
        fix = (
            f"close its brackets ({key}=[a, b])"
            if typing.get_origin(hint) is list
            else f"quote it to pass it as text (\"{key}='{value}'\")"
        )
        raise ConfigError(f"override {bad!r}: its value is not valid YAML ({problem}): {fix}") from None


def _reads(override: str) -> bool:
    import yaml

    try:
        OmegaConf.from_dotlist([override])
    except yaml.YAMLError:
        return False
    return True


def layers_of(path: Path, seen: tuple[Path, ...] = ()) -> list:
    """A YAML file's layers: those of the config its `base` key names (a preset's name, or a file
    relative to this one), then its own keys. An overlay holds only what it changes."""
    if path.resolve() in seen:
        chain = " -> ".join(str(p) for p in (*seen, path.resolve()))
        raise ConfigError(f"config {path}: `base` goes round in a circle ({chain})")
    node = read_yaml(path)
    base = node.pop("base", None) if isinstance(node, DictConfig) else None
    if base is None:
        return [node]
    if not isinstance(base, str):
        raise ConfigError(f"config {path}: `base` must name one config, got {base!r}")
    nearby = path.parent / base
    return [*layers_of(nearby if nearby.is_file() else preset_path(base), (*seen, path.resolve())), node]


def read_yaml(path: Path):
    """A YAML file as OmegaConf nodes; a syntax error is one line naming the file and the line."""
    import yaml

    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (UTF-8)") from None


def presets() -> dict[str, Path]:
    """The presets shipped inside the package, by name: tiny, math, scalerl, loo/tiny-loo-sync, ..."""
    from importlib.resources import files

    root = Path(str(files("tidal.presets")))
    return {str(p.relative_to(root).with_suffix("")): p for p in sorted(root.rglob("*.yaml"))}


def preset_path(name_or_path: str | Path) -> Path:
    """A YAML file, or the name of a shipped preset (`tiny` for tiny.yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = presets()
    name = str(name_or_path).removesuffix(".yaml")
    if name in shipped:
        return shipped[name]
    if name.split(".")[0] in {f.name for f in dataclasses.fields(RunConfig)} and "/" not in name:
        raise ConfigError(f"{name!r} has no value: overrides are key=value ({name}=VALUE)")
    raise ConfigError(f"config {str(name_or_path)!r}: no such file, and not a preset ({', '.join(shipped)})")


# keys whose words YAML 1.1 reads as booleans (on/off, yes/no): the words the schema expects for
# (false, true); None where a boolean has no word, so it fails as the wrong value it is
YAML_BOOLEAN_WORDS = {"broker.zmq.curve": ("off", "on"), "learner.mixed_precision": ("no", None)}


def yaml_words(layer):
    """A config layer with `curve: on` (parsed by YAML as True) given back as the word "on"."""
    if not isinstance(layer, DictConfig):
        return layer
    for key, words in YAML_BOOLEAN_WORDS.items():
        value = OmegaConf.select(layer, key, default=None)
        if isinstance(value, bool) and words[value] is not None:
            OmegaConf.update(layer, key, words[value], merge=False)
    return layer
