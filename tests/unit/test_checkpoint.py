"""Checkpoints survive crashes and unpickle nothing: a save lands whole or not at all, resume falls
back past a damaged checkpoint with one warning, and a resumed step equals an uninterrupted one."""

import logging
import pickle
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import ALPHABET, CASES, TINY, learner_config, step_batch
from tidal.config import CheckpointConfig
from tidal.learner.every_rank.checkpoint import MANIFEST, STATE_FILE, Checkpointer, latest_valid, read_state
from tidal.learner.every_rank.trainer import Trainer
from tidal.tiny import build_tiny_model


def trainer(accelerator) -> Trainer:
    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    return Trainer(learner_config(*CASES["ppo_token_mean_2updates"]), model, accelerator, temperature=1.0)


def params(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.policy.state_dict().items()}


@pytest.fixture
def saved(tmp_path, accelerator):
    """Checkpoints at versions 1 and 2 of a trainer that took two steps."""
    t = trainer(accelerator)
    ckpt = Checkpointer(CheckpointConfig(every=1, keep=2), tmp_path / "checkpoints", accelerator, t)
    groups, masks = step_batch(6)
    for version in (1, 2):
        t.step(groups, masks, version=version + 1)
        ckpt.save(version, {"mlflow_run_id": "r", "coordinator": {"n": version}})
    return tmp_path / "checkpoints", t, groups, masks


def test_a_resumed_trainer_continues_bit_for_bit(saved, accelerator):
    directory, original, groups, masks = saved
    resumed = trainer(accelerator)
    state = Checkpointer(CheckpointConfig(), directory, accelerator, resumed).load(directory / "step-000002")
    assert state["version"] == 2 and state["coordinator"] == {"n": 2}
    after_load = (torch.rand(3), random.random(), np.random.rand())  # random states came back too
    original.step(groups, masks, version=4)
    ckpt = Checkpointer(CheckpointConfig(), directory, accelerator, original)
    ckpt.load(directory / "step-000002")  # rewinds the original to the same point: the same draws again
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == (after_load[0].tolist(), *after_load[1:])
    original.step(groups, masks, version=4)
    resumed.step(groups, masks, version=4)
    assert all(torch.equal(params(original)[k], v) for k, v in params(resumed).items())


def damage(path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncate" else b"\x00" * len(data))


@pytest.mark.parametrize("how", ["truncate", "zero"])
def test_every_damaged_file_falls_back_to_the_previous_checkpoint(saved, tmp_path, caplog, how):
    directory, *_ = saved
    newest = directory / "step-000002"
    for file in sorted(p for p in newest.rglob("*") if p.is_file()):
        backup = file.read_bytes()
        damage(file, how)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert latest_valid(directory) == directory / "step-000001", file.name
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "step-000002 is damaged" in warnings[0] and file.name in warnings[0]
        file.write_bytes(backup)
    assert latest_valid(directory) == newest


def test_an_empty_state_file_is_damage_not_a_crash(saved):
    directory, *_ = saved
    (directory / "step-000002" / STATE_FILE).write_bytes(b"")
    assert latest_valid(directory) == directory / "step-000001"


def test_a_save_interrupted_by_a_crash_leaves_the_previous_one_whole(saved, accelerator, monkeypatch):
    directory, t, *_ = saved
    ckpt = Checkpointer(CheckpointConfig(keep=2), directory, accelerator, t)
    monkeypatch.setattr(ckpt, "_seal", lambda tmp, final: (_ for _ in ()).throw(OSError("power cut")))
    with pytest.raises(OSError):
        ckpt.save(3, {})
    assert (directory / "step-000003.tmp").is_dir() and not (directory / "step-000003").exists()
    assert latest_valid(directory) == directory / "step-000002"
    monkeypatch.undo()
    resumed = Checkpointer(CheckpointConfig(keep=2), directory, accelerator, t)
    assert resumed.agree(directory / "step-000002") == directory / "step-000002"
    resumed.save(3, {})  # what a resumed learner keeps: the one it continues from, and the new one
    assert sorted(p.name for p in directory.iterdir()) == ["step-000002", "step-000003"]
    assert read_state(directory / "step-000003")["version"] == 3


def test_loading_unpickles_nothing(saved, accelerator, monkeypatch):
    directory, *_ = saved
    (directory / "step-000002" / "planted.pkl").write_bytes(pickle.dumps(SimpleNamespace()))  # not in the manifest

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load must not unpickle")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    Checkpointer(CheckpointConfig(), directory, accelerator, trainer(accelerator)).load(directory / "step-000002")
    assert "planted.pkl" not in (directory / "step-000002" / MANIFEST).read_text()


def test_adamw_state_is_taken_at_start_and_the_first_step_is_what_it_was(accelerator):
    """The optimizer's memory is allocated while the learner starts (engines sharing its GPU start
    after it), as zero moments at step 0: the first step is the one a lazily made state gives."""
    allocated, lazy = trainer(accelerator), trainer(accelerator)
    states = allocated._optimizer.state
    assert len(states) == sum(1 for p in allocated.policy.parameters() if p.requires_grad)
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in states.values())
    lazy._optimizer.state.clear()
    groups, masks = step_batch(6)
    for t in (allocated, lazy):
        t.step(groups, masks, version=3)
    assert all(torch.equal(params(allocated)[k], v) for k, v in params(lazy).items())
