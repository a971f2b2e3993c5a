"""Where the policy's weights come from: the one function that turns `model` config into a folder.

`model.path` is a local Hugging Face model folder, or a Hub id (`org/name`, at `model.revision`)
resolved through huggingface_hub into its cache (HF_HOME / HF_HUB_CACHE), which works offline
with HF_HUB_OFFLINE=1 once the cache holds it. Empty, it is the warm-started tiny model, kept in
`model.cache_dir` under a hash of everything that shapes it. `tidal run` resolves it once and
hands every process the folder.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from tidal.config import ModelConfig, TaskConfig

# builds the warm-started tiny model into a folder (tidal.learner.tools.warmstart.build_tiny):
# (model, task, path) -> None
Builder = Callable[[ModelConfig, TaskConfig, Path], None]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the Hub spells repository ids


def resolve_model_path(model: ModelConfig, task: TaskConfig, build: Builder | None = None) -> str:
    """A local folder holding the model: model.path itself, its Hub snapshot, or the tiny model
    cached for this config, built first by `build` when missing and a builder is given (actors
    never build: they get a clear error)."""
    if model.path and not Path(model.path).expanduser().exists() and HUB_ID.match(model.path):
        return hub_snapshot(model.path, model.revision)
    from tidal.tiny import cached_model_path

    path = Path(model.path).expanduser() if model.path else cached_model_path(model, task)
    if not (path / "config.json").is_file() and not model.path and build is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        build(model, task, path)
    if not (path / "config.json").is_file():
        hint = "" if model.path else " (build it with `tidal prepare CONFIG`, or set model.path)"
        raise FileNotFoundError(
            f"model.path = {str(path)!r} is not a Hugging Face model folder "
            f"(no config.json) nor a Hub id (org/name){hint}"
        )
    return str(path)


def hub_snapshot(repo_id: str, revision: str) -> str:
    """The local snapshot of a Hub model, downloaded unless HF_HUB_OFFLINE=1 (then the cache must hold it)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    where = f"model.path = {repo_id!r}" + (f" at model.revision = {revision!r}" if revision else "")
    try:
        path = snapshot_download(repo_id, revision=revision or None)
    except LocalEntryNotFoundError as err:
        mode = "HF_HUB_OFFLINE=1 and " if constants.HF_HUB_OFFLINE else ""
        raise FileNotFoundError(
            f"{where}: {mode}not in the Hugging Face cache {constants.HF_HUB_CACHE} and it "
            f"could not be downloaded ({type(err).__name__}); fetch it first with "
            f"`hf download {repo_id}`"
        ) from None
    except (RepositoryNotFoundError, HfHubHTTPError) as err:
        raise FileNotFoundError(f"{where}: {str(err).splitlines()[0]}") from None
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{where}: the snapshot {path} has no config.json (not a transformers model)")
    return path
