"""Models by name: model.path is a folder or a Hub id resolved through huggingface_hub's cache,
offline too (HF_HUB_OFFLINE=1), at a revision (branch, tag or commit)."""

import hashlib
import os
import shutil

import pytest

from conftest import ALPHABET, ROOT, TINY
from tidal.config import ModelConfig, TaskConfig
from tidal.models import resolve_model_path
from tidal.ops.cli import main
from tidal.tiny import build_tiny_model, save_model

REPO = "tidal-test/tiny-qwen2"


def hub_cache(root, folder, repo_id: str, refs: dict[str, str]) -> dict[str, str]:
    """The layout huggingface_hub writes: blobs by content hash, snapshots of symlinks, refs naming
    commits. Every ref here points at a snapshot of `folder`; returns ref -> snapshot path."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    snapshots = {}
    for ref, commit in refs.items():
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        for file in folder.iterdir():
            blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
            shutil.copyfile(file, blob)
            link = snapshot / file.name
            if not link.exists():
                link.symlink_to(os.path.relpath(blob, snapshot))
        (repo / "refs" / ref).write_text(commit)
        snapshots[ref] = str(snapshot)
    return snapshots


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """huggingface_hub pointed at an empty cache in tmp_path, offline."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_resolves_offline_at_a_branch_tag_or_commit(tmp_path, offline_hub):
    folder = tmp_path / "built"
    save_model(*build_tiny_model(TINY, ALPHABET, seed=0), folder)
    main, tagged = "a" * 40, "b" * 40
    snapshots = hub_cache(offline_hub, folder, REPO, {"main": main, "v1": tagged})
    task = TaskConfig()
    assert resolve_model_path(ModelConfig(path=REPO), task) == snapshots["main"]
    assert resolve_model_path(ModelConfig(path=REPO, revision="v1"), task) == snapshots["v1"]
    assert resolve_model_path(ModelConfig(path=REPO, revision=tagged), task) == snapshots["v1"]


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["model.path=tidal-test/not-there"], "model.path = 'tidal-test/not-there': HF_HUB_OFFLINE=1 and not in"),
        (["model.revision=v1"], "config key 'model.revision'"),
        (["model.path=/no/such/folder"], "'/no/such/folder' is not a Hugging Face model folder"),
    ],
)
def test_model_mistakes_are_one_line_and_exit_2(offline_hub, capsys, overrides, says):
    assert main(["prepare", str(ROOT / "configs/tiny.yaml"), *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]
