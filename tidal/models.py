"""Where the policy's weights come from: the one function that turns `model` config into a folder."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tidal.config import ModelConfig, TaskConfig

# builds the warm-started tiny model into a folder (tidal.learner.warmstart.build_tiny): (model, task, path) -> None
Builder = Callable[[ModelConfig, TaskConfig, Path], None]


def resolve_model_path(model: ModelConfig, task: TaskConfig, build: Builder | None = None) -> str:
    """model.path when set; else the tiny model cached for this config, built first by `build`
    when it is missing and a builder is given (actors never build: they get a clear error)."""
    from tidal.tiny import cached_model_path

    path = Path(model.path) if model.path else cached_model_path(model, task)
    if not (path / "config.json").is_file() and not model.path and build is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        build(model, task, path)
    if not (path / "config.json").is_file():
        hint = "" if model.path else " (build it with `tidal prepare CONFIG`, or set model.path)"
        raise FileNotFoundError(f"model.path = {str(path)!r} is not a Hugging Face model directory{hint}")
    return str(path)
