"""What every part of the config tree is built from: ConfigError, `opt` (a field with its help),
Section (a sub-config that checks itself), and the closed sets' helpers: `choices`, and Dtype, the
one closed set two sections share (model.dtype, learner.param_dtype)."""

from __future__ import annotations

import enum
from dataclasses import field


class ConfigError(ValueError):
    """A config that cannot run: the message names the key and the value."""


def opt(default, help: str):
    """A field of the schema with its help: the one text for the code, the docs and `tidal config
    explain`. An empty list or dict default is made afresh for every config."""
    if isinstance(default, (list, dict)):
        assert not default, "a list or dict default must be empty: every config gets its own"
        return field(default_factory=type(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _require(ok: bool, key: str, value, why: str) -> None:
    if not ok:
        shown = value.value if isinstance(value, enum.Enum) else value
        raise ConfigError(f"config key '{key}' = {shown!r}: {why}")


class Section:
    """A sub-config: `check` raises ConfigError naming the first of its keys that cannot run."""

    def check(self) -> None:
        """Its own rules (none here); a section that holds others checks them too."""


# The closed sets that reach code outside the config and libraries (torch, Accelerate, vLLM) as words
# (Dtype here; the others beside their sections) are StrEnums: each member is its word
# (`cfg.learner.packing == "shared"`, f-strings, getattr(torch, dtype) and os.environ all see the string).
# An enum hashes by its name, so a dict keyed by the plain word finds a member only while every name
# equals its value (tests/unit/test_config_checks.py).


class Dtype(enum.StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def choices(kind: type[enum.Enum]) -> list[str]:
    """The words a closed set takes, in order."""
    return [member.value for member in kind]
