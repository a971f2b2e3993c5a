"""Rows of a dataset for a task: a local JSON Lines or Parquet file, a local folder of them, or a
Hugging Face Hub dataset id (`org/name`, at `task.data_config` / a split), read with `datasets`.

The prompt column holds a string, or chat messages ([{"role": ..., "content": ...}, ...], the
conversational format TRL datasets use); the answer column a string. A bad row is an error that
names the file and line (JSON Lines), or the row.

It is also the `rows` task: task.data_path's rows scored by task.reward_funcs alone, so a user's task can
be one reward function (tidal.tasks.rewards).
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Callable
from pathlib import Path

from tidal.config import ConfigError, TaskConfig
from tidal.tasks import Prompt, Split
from tidal.tasks.env import bad_messages

OPTIONS: dict[str, str] = {}  # task.kwargs: this task takes none

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # file suffix -> datasets builder
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the Hub spells dataset ids
_MISSING = object()


def load_rows(
    source: str,
    key: str,
    prompt_field: str,
    answer_field: str,
    split: str = "train",
    config: str = "",
    every_column: bool = False,
) -> list[dict]:
    """The rows of `source` (config key `key`) with both columns checked (no answer column when
    `answer_field` is ""); raises ValueError naming the key, the file and the line or row of the first
    bad one. The rows hold those two columns, or with `every_column` all of them."""
    if not source:
        raise ConfigError(
            f"config key '{key}' is empty: name a JSON Lines or Parquet file, a folder of them, "
            "or a Hub dataset id (org/name)"
        )
    try:
        data, path, builder = _open(source, key, split, config)
    except _Unreadable as err:  # datasets' errors rarely say where; a JSON Lines file itself can
        located = _find_bad_json_row(err.path, prompt_field, answer_field) if err.path else None
        raise ConfigError(located or str(err)) from None
    columns = {prompt_field: "task.prompt_field", **({answer_field: "task.answer_field"} if answer_field else {})}
    for field, field_key in columns.items():
        if field not in data.column_names:
            raise ConfigError(
                f"{source}: no column {field!r} (config key {field_key}); columns: {', '.join(data.column_names)}"
            )
    if len(data) == 0:
        raise ConfigError(f"{source}: no rows ({key})")
    rows = []
    for index, row in enumerate(data if every_column else data.select_columns(list(columns))):
        why = bad_row(row, prompt_field, answer_field)
        if why:
            # datasets may have coerced a JSON column's types; the file itself names the first bad line
            located = _find_bad_json_row(path, prompt_field, answer_field) if builder == "json" else None
            raise ConfigError(located or f"{source}: row {index} (counting from 0): {why}")
        rows.append(row)
    return rows


class _Unreadable(ConfigError):
    def __init__(self, message: str, path: Path | None):
        super().__init__(message)
        self.path = path  # a JSON Lines file to search for the bad line, or None


def _open(source: str, key: str, split: str, config: str):
    """(datasets.Dataset, the local file or None, its builder or None)."""
    path = Path(source).expanduser()
    if path.is_file() and path.stat().st_size == 0:
        raise ConfigError(f"{path}: the file is empty ({key})")
    if path.is_file():
        builder = FORMATS.get(path.suffix.lower())
        if builder is None:
            raise ConfigError(f"config key '{key}' = {source!r}: expected a {', '.join(FORMATS)} file")
        data = _load(
            source, key, builder, path if builder == "json" else None, builder, data_files=str(path), split="train"
        )
        return data, path, builder
    if path.is_dir() or HUB_ID.match(source):
        # a folder is read as the Hub would serve it: data files named by split, or a loading script's config
        data = _load(
            source,
            key,
            f"a dataset (split {split!r})",
            None,
            str(path) if path.is_dir() else source,
            name=config or None,
            split=split,
        )
        return data, None, None
    raise FileNotFoundError(
        f"config key '{key}' = {source!r}: no such file or folder, and not a Hub dataset id (org/name)"
    )


def _load(source: str, key: str, kind: str, json_path: Path | None, *args, **kwargs):
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar per split in the learner's log says nothing
    quiet = logging.getLogger("datasets")
    level, quiet.level = quiet.level, logging.CRITICAL  # its own error log (a traceback) says less than ours
    try:
        return datasets.load_dataset(*args, **kwargs)
    except Exception as err:
        reason = str(err).splitlines()[0] if str(err) else ""
        raise _Unreadable(
            f"{source}: cannot be read as {kind} ({key}): {type(err).__name__}: {reason}", json_path
        ) from None
    finally:
        quiet.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def bad_row(row: dict, prompt_field: str, answer_field: str) -> str | None:
    """Why a row cannot be used, or None."""
    prompt = row.get(prompt_field, _MISSING)
    if isinstance(prompt, list):
        why = bad_messages(prompt)
        if why:
            return f"{prompt_field!r} {why} (config key task.prompt_field)"
    else:
        why = _bad_string(prompt, prompt_field, "task.prompt_field")
        if why:
            return why
    return _bad_string(row.get(answer_field, _MISSING), answer_field, "task.answer_field") if answer_field else None


def _bad_string(value, field: str, key: str) -> str | None:
    if value is _MISSING or value is None:
        return f"{field!r} is missing or null (config key {key})"
    if not isinstance(value, str):
        return (
            f"{field!r} is {type(value).__name__} {repr(value)[:40]}, expected a string "
            f"(config key {key}; quote numbers in the file)"
        )
    if not value.strip():
        return f"{field!r} is empty (config key {key})"
    return None


def _find_bad_json_row(path: Path, prompt_field: str, answer_field: str) -> str | None:
    """'FILE:LINE: why' for the first bad line of a JSON Lines file; None if all are fine (or it is a JSON array)."""
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                return f"{path}:{line_no}: not UTF-8"
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                if line_no == 1 and line.lstrip().startswith("["):
                    return None  # a JSON array: no line per row to name
                return f"{path}:{line_no}: not valid JSON ({err.msg})"
            if not isinstance(row, dict):
                return f"{path}:{line_no}: expected a JSON object, found {type(row).__name__}"
            why = bad_row(row, prompt_field, answer_field)
            if why:
                return f"{path}:{line_no}: {why}"
    return None


def split_rows(cfg: TaskConfig, rows: list[dict], val_rows: list[dict], make: Callable[[int, dict], Prompt]) -> Split:
    """Training and held-out prompts (`make(prompt_id, row)`): task.num_val rows drawn by task.seed from
    `val_rows` (read from task.val_path; their ids follow the training rows'), else split off `rows`."""
    if cfg.num_val < 0:
        raise ConfigError(f"config key 'task.num_val' = {cfg.num_val}: must be >= 0")
    if val_rows:
        val_ids = _draw(len(val_rows), cfg.num_val, cfg.seed)
        return Split(
            train=[make(i, row) for i, row in enumerate(rows)], val=[make(len(rows) + i, val_rows[i]) for i in val_ids]
        )
    if cfg.num_val >= len(rows):
        raise ConfigError(
            f"config key 'task.num_val' = {cfg.num_val} leaves no training prompts "
            f"({len(rows)} rows in {cfg.data_path}; or set task.val_path)"
        )
    val_ids = _draw(len(rows), cfg.num_val, cfg.seed)
    held_out = set(val_ids)
    return Split(
        train=[make(i, rows[i]) for i in range(len(rows)) if i not in held_out], val=[make(i, rows[i]) for i in val_ids]
    )


def _draw(num_rows: int, num: int, seed: int) -> list[int]:
    """Up to `num` row indices drawn by `seed`, in file order."""
    order = list(range(num_rows))
    random.Random(seed).shuffle(order)
    return sorted(order[:num])


def row_payload(cfg: TaskConfig, row: dict, answer: dict[str, str], where: str) -> dict[str, str]:
    """A prompt's payload: every column of its row when task.reward_funcs score it (they are called with
    them all), else what the task's own reward reads (`answer`)."""
    from tidal.tasks.rewards import encode_row

    return encode_row(row, where) if cfg.reward_funcs else answer


# ---- the rows task (task.name=rows): task.data_path's rows, scored by task.reward_funcs -------------


def load_prompts(cfg: TaskConfig) -> Split:
    """Rows of task.data_path (every column), each prompt column as it is (text, or chat messages), as a
    dataset's prompt column is the prompt; held out as the math task holds out."""
    if not cfg.reward_funcs:
        raise ConfigError(
            "config key 'task.reward_funcs' is empty: task.name = 'rows' is scored by the reward "
            "functions it names (my_pkg.rewards:accuracy)"
        )
    read = lambda source, key, split: load_rows(
        source, key, cfg.prompt_field, "", split=split, config=cfg.data_config, every_column=True
    )
    rows = read(cfg.data_path, "task.data_path", cfg.data_split)
    val_rows = read(cfg.val_path, "task.val_path", cfg.val_split) if cfg.val_path else []

    def make(prompt_id: int, row: dict) -> Prompt:
        prompt, payload = row[cfg.prompt_field], row_payload(cfg, row, {}, f"{cfg.data_path}: row {prompt_id}")
        if isinstance(prompt, list):
            return Prompt(prompt_id=prompt_id, text="", payload=payload, messages=tuple(prompt))
        return Prompt(prompt_id=prompt_id, text=prompt, payload=payload)

    return split_rows(cfg, rows, val_rows, make)


def build_reward(cfg: TaskConfig):
    """The rows task has no reward of its own: task.reward_funcs score it (get_environment uses them)."""
    raise ConfigError(
        "config key 'task.reward_funcs' is empty: task.name = 'rows' is scored by the reward "
        "functions it names (my_pkg.rewards:accuracy)"
    )
