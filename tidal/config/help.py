"""Asking the schema: `tidal config explain KEY` prints a key's type, default and help, or a
section's keys, read from the dataclasses and their `opt` help (never from the source)."""

from __future__ import annotations

import dataclasses
import enum

from tidal.config.base import ConfigError, choices
from tidal.config.run import RunConfig


def field_help(cls: type) -> dict[str, str]:
    """Each field's help, as the schema holds it (opt's); a section's is its class's summary."""
    import typing

    hints = typing.get_type_hints(cls)
    return {f.name: f.metadata.get("help") or summary(hints[f.name]) for f in dataclasses.fields(cls)}


def summary(cls) -> str:
    """The first paragraph of a section's docstring, on one line ("" for anything else)."""
    doc = (cls.__doc__ or "") if dataclasses.is_dataclass(cls) else ""
    if doc.startswith(f"{cls.__name__}("):  # what dataclass writes for a class without a docstring
        return ""
    return " ".join(doc.split("\n\n")[0].split())


def kind_of(hint) -> str:
    """A field's type as `explain` prints it: a closed set as its choices."""
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " | ".join(choices(hint))
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def describe(name: str, hint, default, help_text: str) -> str:
    """One key: `name (type, default value): help`; a section: `name (section): summary`."""
    if dataclasses.is_dataclass(hint):
        return f"{name} (section): {help_text}"
    shown = default.value if isinstance(default, enum.Enum) else default
    return f"{name} ({kind_of(hint)}, default {shown!r}): {help_text or '(no help)'}"


def explain(key: str) -> str:
    """What a config key is: its type, default and help; for a section (or the whole run), each of its keys."""
    import typing

    cls, default, parts = RunConfig, RunConfig(), [p for p in key.split(".") if p]
    for i, part in enumerate(parts):
        where = ".".join(parts[:i]) or "the top level"
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"config key '{where}' is a value, not a section: '{key}' does not exist")
        hints = typing.get_type_hints(cls)
        if part not in hints:
            known = ", ".join(f.name for f in dataclasses.fields(cls))
            raise ConfigError(f"config key '{'.'.join(parts[: i + 1])}' does not exist; {where} has: {known}")
        if i == len(parts) - 1 and not dataclasses.is_dataclass(hints[part]):
            return describe(key, hints[part], getattr(default, part), field_help(cls)[part])
        cls, default = hints[part], getattr(default, part)
    hints, helps = typing.get_type_hints(cls), field_help(cls)
    rows = [describe(f.name, hints[f.name], getattr(default, f.name), helps[f.name]) for f in dataclasses.fields(cls)]
    return "\n".join([f"{key or 'the whole run'}: {summary(cls)}", *(f"  {row}" for row in rows)])
