"""Damage to any file of a real checkpoint makes a resume fall back to the one before, with one
warning naming it; when none verifies, a resume refuses to start (naming each) unless told
`--resume fresh`; pruning keeps the checkpoint a learner continues from; a torn ledger line is
repaired; `tidal export` never empties a folder it was not told to."""

import json
import logging
import shutil

import pytest
import torch

from conftest import ALPHABET, CASES, ROOT, TINY, learner_config, step_batch
from tidal.config import CheckpointConfig, load_config, resolve, write_config
from tidal.files import sha256_file
from tidal.learner.build import find_checkpoint
from tidal.learner.every_rank.checkpoint import MANIFEST, Checkpointer, NoValidCheckpoint, latest_valid, verify_part
from tidal.learner.every_rank.trainer import Trainer
from tidal.learner.rank0.ledger import Ledger, read_ledger
from tidal.learner.rank0.resume import check_resume_state
from tidal.tiny import build_tiny_model, save_model

RANK0 = "MANIFEST-rank0.json"
MODEL = "model/shard-00001-model-00001-of-00001.safetensors"
OPTIMIZER = "optimizer/shard-00001-model-00001-of-00001.safetensors"
FILES = [MANIFEST, RANK0, "trainer.json", "tidal_state.json", "rng-rank0.safetensors", MODEL, OPTIMIZER]
# what a warning may name for damage to a file: the file, or for a manifest, a file whose entry it garbled
NAMED = {
    MANIFEST: (MANIFEST, "trainer.json", "tidal_state.json"),
    RANK0: (RANK0, "rng-rank0.safetensors", MODEL, OPTIMIZER),
}


def build_trainer(accelerator) -> Trainer:
    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    return Trainer(learner_config(*CASES["ppo_token_mean_2updates"]), model, accelerator, temperature=1.0)


def resumable_state(version: int) -> dict:
    """tidal's state as a learner saves it (the fields a resume reads)."""
    coordinator = {
        "epoch": 0,
        "cursor": 4 * version,
        "num_released": 4 * version,
        "version": version,
        "ledger_offset": 0,
        "outstanding": {},
        "consumed": [],
        "dead": [],
        "counts": {},
        "curriculum": {},
    }
    learner = {
        "totals": {"samples": 8},
        "by_actor": {},
        "device_seconds": 0.0,
        "wall_s": 1.0,
        "evals": {"0": 0.5},
        "evals_pending": [],
        "eval_multi_version": 0,
    }
    return {"mlflow_run_id": "r", "coordinator": coordinator, "learner": learner, "unlogged": []}


@pytest.fixture(scope="module")
def trainer(accelerator) -> Trainer:
    """One trainer for the module: a load restores all of it in place."""
    return build_trainer(accelerator)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, accelerator, trainer):
    """A run folder with whole checkpoints at versions 1 and 2."""
    run = tmp_path_factory.mktemp("pristine") / "run"
    checkpointer = Checkpointer(CheckpointConfig(every=1, keep=3), run / "checkpoints", accelerator, trainer)
    groups, masks = step_batch(6)
    for version in (1, 2):
        trainer.step(groups, masks, version=version + 1)
        checkpointer.save(version, resumable_state(version))
    return run


@pytest.fixture
def run(pristine, tmp_path):
    shutil.copytree(pristine, tmp_path / "run")
    return tmp_path / "run"


def resume(run, accelerator, trainer, mode: str = "auto", keep: int = 2):
    """What a learner's start does: rank 0 finds, every rank agrees, then loads. (checkpoint, checkpointer)."""
    checkpointer = Checkpointer(CheckpointConfig(every=1, keep=keep), run / "checkpoints", accelerator, trainer)
    chosen = checkpointer.agree(find_checkpoint(run, mode), mode == "fresh", check_resume_state)
    if chosen is not None:
        assert checkpointer.load(chosen)["version"] == int(chosen.name.removeprefix("step-"))
    return chosen, checkpointer


def reseal(checkpoint, manifest: str, name: str) -> None:
    """List `name` in `manifest` at its present size and hash: damage a manifest alone cannot see."""
    listed = json.loads((checkpoint / manifest).read_text())
    listed[name] = [(checkpoint / name).stat().st_size, sha256_file(checkpoint / name)]
    (checkpoint / manifest).write_text(json.dumps(listed))


def rewrite_json(checkpoint, name: str, change) -> None:
    value = json.loads((checkpoint / name).read_text())
    (checkpoint / name).write_text(json.dumps(change(value)))
    reseal(checkpoint, MANIFEST, name)


def safetensors_bytes(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save(tensors)


# ---- damage to the bytes of any file: the manifests' sizes and hashes see it -----------------------------------

BYTES = {
    "missing": lambda p: p.unlink(),
    "empty": lambda p: p.write_bytes(b""),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "zeroed": lambda p: p.write_bytes(b"\x00" * p.stat().st_size),
    "one byte flipped": lambda p: p.write_bytes(
        (lambda b: b[: len(b) // 2] + bytes([b[len(b) // 2] ^ 1]) + b[len(b) // 2 + 1 :])(p.read_bytes())
    ),
    "garbage": lambda p: p.write_bytes(b"{not json" * 7),
    "JSON nested past the parser's depth": lambda p: p.write_bytes(b"[" * 100_000 + b"]" * 100_000),
}


@pytest.mark.parametrize("how", BYTES)
@pytest.mark.parametrize("name", FILES)
def test_damaged_bytes_of_any_file_fall_back_with_one_warning(run, accelerator, trainer, caplog, name, how):
    BYTES[how](run / "checkpoints" / "step-000002" / name)
    with caplog.at_level(logging.WARNING):
        chosen, _ = resume(run, accelerator, trainer)
    assert chosen == run / "checkpoints" / "step-000001"
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "step-000002" in r.getMessage()
    ]
    assert len(warnings) == 1 and "damaged" in warnings[0], warnings
    assert any(named in warnings[0] for named in NAMED.get(name, (name,))), warnings[0]


# ---- damage a manifest's sizes and hashes cannot see: a manifest of the wrong shape, or files -------------------
# ---- rewritten with their manifest (what a crash in the middle of an older tidal's save, or a hand, leaves) ------


def _entry_without_digest(listed):
    name = next(iter(listed))
    return {**listed, name: listed[name][:1]}


MANIFESTS = {
    "an empty list": lambda listed: [],
    "an empty table": lambda listed: {},
    "an entry without a digest": _entry_without_digest,
    "a size that is text": lambda listed: {k: [str(v[0]), v[1]] for k, v in listed.items()},
    "a path out of the folder": lambda listed: {**listed, "../../outside": [0, "0" * 64]},
    "a string": lambda listed: "MANIFEST",
}


@pytest.mark.parametrize("how", MANIFESTS)
@pytest.mark.parametrize("manifest", [MANIFEST, RANK0])
def test_a_manifest_of_the_wrong_shape_is_damage(run, accelerator, trainer, caplog, manifest, how):
    path = run / "checkpoints" / "step-000002" / manifest
    path.write_text(json.dumps(MANIFESTS[how](json.loads(path.read_text()))))
    with caplog.at_level(logging.WARNING):
        chosen, _ = resume(run, accelerator, trainer)
    assert chosen == run / "checkpoints" / "step-000001"
    warnings = [r.getMessage() for r in caplog.records if "step-000002" in r.getMessage()]
    assert len(warnings) == 1 and manifest in warnings[0], warnings


def _python_random_short(meta):
    return {**meta, "python_random": [meta["python_random"][0], meta["python_random"][1][:10], None]}


def _numpy_random_text(meta):
    return {**meta, "numpy_random": ["MT19937", "keys", 0, 0, 0.0]}


def _another_model(meta):
    return {**meta, "shapes": {k: [d + 1 for d in v] for k, v in meta["shapes"].items()}}


def _zeroed_model_empty_manifest(checkpoint):
    """The rank's manifest emptied and the model zeroed: nothing left to compare against."""
    (checkpoint / MODEL).write_bytes(b"\x00" * (checkpoint / MODEL).stat().st_size)
    (checkpoint / RANK0).write_text("{}")


def _resealed_bytes(name, data):
    def damage(checkpoint):
        (checkpoint / name).write_bytes(data(checkpoint / name))
        reseal(checkpoint, RANK0, name)

    return damage


def _model_tensors(change):
    """The model shard rewritten as safetensors with `change` made to its tensors, and resealed."""

    def damage(checkpoint):
        from safetensors.torch import load_file

        tensors = load_file(str(checkpoint / MODEL))
        change(tensors)
        (checkpoint / MODEL).write_bytes(safetensors_bytes(tensors))
        reseal(checkpoint, RANK0, MODEL)

    return damage


def _planted(name):
    def damage(checkpoint):
        shutil.copy(checkpoint / MODEL, checkpoint / name)

    return damage


RESEALED = {  # how: (damage, what the warning names)
    "trainer.json: a list": (lambda c: rewrite_json(c, "trainer.json", lambda meta: []), "not a table"),
    "trainer.json: an empty table": (lambda c: rewrite_json(c, "trainer.json", lambda meta: {}), "'optimizer'"),
    "trainer.json: no shapes": (lambda c: rewrite_json(c, "trainer.json", lambda m: {**m, "shapes": None}), "'shapes'"),
    "trainer.json: a shape of text": (
        lambda c: rewrite_json(c, "trainer.json", lambda m: {**m, "shapes": {"w": ["32"]}}),
        "shapes['w']",
    ),
    "trainer.json: another model's shapes": (
        lambda c: rewrite_json(c, "trainer.json", _another_model),
        "this model's is",
    ),
    "trainer.json: a short Python random state": (
        lambda c: rewrite_json(c, "trainer.json", _python_random_short),
        "random state",
    ),
    "trainer.json: a NumPy random state of text": (
        lambda c: rewrite_json(c, "trainer.json", _numpy_random_text),
        "random state",
    ),
    "trainer.json: no scheduler step": (
        lambda c: rewrite_json(c, "trainer.json", lambda m: {**m, "scheduler": {}}),
        "scheduler",
    ),
    "trainer.json: betas of text": (
        lambda c: rewrite_json(
            c,
            "trainer.json",
            lambda m: {
                **m,
                "optimizer": {**m["optimizer"], next(k for k in m["optimizer"] if k.endswith(".betas")): "0.9"},
            },
        ),
        ".betas",
    ),
    "tidal_state.json: a list": (lambda c: rewrite_json(c, "tidal_state.json", lambda s: []), "version"),
    "tidal_state.json: another version": (
        lambda c: rewrite_json(c, "tidal_state.json", lambda s: {**s, "version": 7}),
        "version 2",
    ),
    "tidal_state.json: a version of text": (
        lambda c: rewrite_json(c, "tidal_state.json", lambda s: {**s, "version": "2"}),
        "version 2",
    ),
    "tidal_state.json: no ledger offset": (
        lambda c: rewrite_json(
            c,
            "tidal_state.json",
            lambda s: {**s, "coordinator": {k: v for k, v in s["coordinator"].items() if k != "ledger_offset"}},
        ),
        "coordinator.ledger_offset",
    ),
    "tidal_state.json: learner state a list": (
        lambda c: rewrite_json(c, "tidal_state.json", lambda s: {**s, "learner": []}),
        "learner",
    ),
    "tidal_state.json: a run id that is a number": (
        lambda c: rewrite_json(c, "tidal_state.json", lambda s: {**s, "mlflow_run_id": 5}),
        "mlflow_run_id",
    ),
    "model: zeroed, its manifest emptied": (_zeroed_model_empty_manifest, f"{RANK0}: lists no files"),
    "model: zeroed and resealed": (
        _resealed_bytes(MODEL, lambda p: b"\x00" * p.stat().st_size),
        f"{MODEL}: not a safetensors file",
    ),
    "model: a tensor of another shape": (
        _model_tensors(lambda t: t.update({"model.norm.weight": torch.zeros(31)})),
        "31 of the 32 elements of 'model.norm.weight'",
    ),
    "model: a tensor left out": (
        _model_tensors(lambda t: t.pop("model.norm.weight")),
        "0 of the 32 elements of 'model.norm.weight'",
    ),
    "model: a tensor of no name the policy has": (
        _model_tensors(lambda t: t.update({"planted": torch.zeros(2)})),
        "'planted' of shape [2] is no part",
    ),
    "optimizer: cut short and resealed": (
        _resealed_bytes(OPTIMIZER, lambda p: p.read_bytes()[:-64]),
        f"{OPTIMIZER}: tensor",
    ),
    "rng: another tensor, resealed": (
        _resealed_bytes("rng-rank0.safetensors", lambda p: safetensors_bytes({"x": torch.zeros(3)})),
        "no CPU random state",
    ),
    "rng: a short CPU state, resealed": (
        _resealed_bytes(
            "rng-rank0.safetensors", lambda p: safetensors_bytes({"torch_cpu": torch.zeros(7, dtype=torch.uint8)})
        ),
        "no CPU random state",
    ),
    "model: a shard no manifest lists": (
        _planted("model/shard-00001-model-planted.safetensors"),
        "model-planted.safetensors: listed in no",
    ),
    "optimizer: a file of no rank": (_planted("optimizer/extra.safetensors"), "extra.safetensors: listed in no"),
    "rank manifest: missing": (lambda c: (c / RANK0).unlink(), f"{RANK0}: FileNotFoundError"),
}


@pytest.mark.parametrize("how", RESEALED)
def test_contents_a_resume_cannot_read_are_damage_not_a_crash(run, accelerator, trainer, caplog, how):
    damage, named = RESEALED[how]
    damage(run / "checkpoints" / "step-000002")
    with caplog.at_level(logging.WARNING):
        chosen, _ = resume(run, accelerator, trainer)
    assert chosen == run / "checkpoints" / "step-000001"
    warnings = [r.getMessage() for r in caplog.records if "step-000002" in r.getMessage()]
    assert len(warnings) == 1 and "damaged" in warnings[0] and named in warnings[0], warnings


def test_resume_fresh_is_a_choice_of_the_command_line():
    from tidal.ops.cli import parse

    assert parse(["learner", "run.yaml", "--resume", "fresh"]).resume == "fresh"
    assert parse(["run", "run.yaml", "--resume"]).resume == "required"


def test_the_whole_checkpoint_verifies_as_saved(run, accelerator, trainer, caplog):
    with caplog.at_level(logging.WARNING):
        chosen, _ = resume(run, accelerator, trainer)
    assert chosen == run / "checkpoints" / "step-000002" and not caplog.records
    verify_part(chosen, 0)


# ---- when none verifies -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["cheap", "hashed"])  # found at listing (a missing file) or when hashed
def test_when_every_checkpoint_is_damaged_auto_refuses_naming_each(run, accelerator, trainer, how):
    for step in ("step-000001", "step-000002"):
        checkpoint = run / "checkpoints" / step
        if how == "cheap":
            (checkpoint / "trainer.json").unlink()
        else:
            rewrite_json(checkpoint, "tidal_state.json", lambda s: {**s, "coordinator": None})
    for mode in ("auto", "required"):
        with pytest.raises(NoValidCheckpoint) as refused:
            resume(run, accelerator, trainer, mode)
        assert "step-000001" in str(refused.value) and "step-000002" in str(refused.value)
        assert ("trainer.json" if how == "cheap" else "coordinator") in str(refused.value)
        assert "--resume fresh" in str(refused.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001", "step-000002"]


@pytest.mark.parametrize("how", ["cheap", "hashed"])
def test_resume_fresh_starts_over_damaged_checkpoints_setting_them_aside(run, accelerator, trainer, how):
    for step in ("step-000001", "step-000002"):
        if how == "cheap":
            (run / "checkpoints" / step / RANK0).write_text("[]")
        else:
            rewrite_json(run / "checkpoints" / step, "trainer.json", lambda meta: {**meta, "scheduler": []})
    chosen, checkpointer = resume(run, accelerator, trainer, "fresh")
    assert chosen is None
    aside = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(aside) == 2 and all(name.startswith("damaged-") for name in aside)
    checkpointer.save(1, resumable_state(1))
    assert latest_valid(run / "checkpoints") == run / "checkpoints" / "step-000001"


def test_no_checkpoint_at_all_still_starts_fresh_under_auto(tmp_path, accelerator, trainer):
    assert resume(tmp_path / "new", accelerator, trainer)[0] is None
    (tmp_path / "new" / "checkpoints").mkdir(parents=True)
    assert resume(tmp_path / "new", accelerator, trainer)[0] is None


# ---- pruning --------------------------------------------------------------------------------------------------


def test_pruning_after_a_fallback_keeps_what_the_learner_continues_from(run, accelerator, trainer):
    """keep=1: the damaged newest name must not make the learner prune its own new checkpoint."""
    checkpoints = run / "checkpoints"
    (checkpoints / "step-000002").rename(checkpoints / "step-000004")  # its name and version no longer agree
    chosen, checkpointer = resume(run, accelerator, trainer, keep=1)
    assert chosen == checkpoints / "step-000001"
    checkpointer.save(2, resumable_state(2))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000002", "step-000004"]
    checkpointer.save(3, resumable_state(3))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000003", "step-000004"]
    assert resume(run, accelerator, trainer)[0] == checkpoints / "step-000003"


# ---- the ledger -----------------------------------------------------------------------------------------------


def test_a_torn_last_ledger_line_is_dropped_on_resume_and_everything_before_kept(tmp_path, caplog):
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    for i in range(3):
        ledger.record("released", ids=[f"g-{i}"])
    offset = ledger.offset()
    ledger.close()
    with open(path, "ab") as f:
        f.write(b'{"event": "trained", "step": 1, "ids": ["g-')  # the crash came mid-write
    with caplog.at_level(logging.WARNING):
        assert [e["ids"] for e in read_ledger(path)] == [["g-0"], ["g-1"], ["g-2"]]
        Ledger(path, truncate_to=offset + 10_000).close()  # a checkpoint offset past the torn line
    assert path.stat().st_size == offset and path.read_bytes().endswith(b"\n")
    assert any("torn last line" in r.getMessage() for r in caplog.records)
    assert any("the checkpoint covers" in r.getMessage() for r in caplog.records)
    resumed = Ledger(path, truncate_to=offset)
    resumed.record("trained", step=1, ids=["g-0"])
    resumed.close()
    assert [e["event"] for e in read_ledger(path)] == ["released"] * 3 + ["trained"]


def test_a_torn_ledger_line_in_the_middle_is_named(tmp_path, caplog):
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(b'{"event": "released", "ids": []}\n{"event": "tra\n{"event": "released", "ids": []}\n')
    with pytest.raises(ValueError, match="line 2 is not a JSON record"):
        read_ledger(path)
    with caplog.at_level(logging.WARNING):
        Ledger(path, truncate_to=path.stat().st_size).close()  # a resume names it, and keeps every line
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "1 lines are not JSON records (lines 2): the ledger is damaged there"
    ]
    assert path.read_bytes().count(b"\n") == 3


# ---- tidal export ---------------------------------------------------------------------------------------------


@pytest.fixture
def exportable(run, tmp_path):
    model, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    save_model(model, tokenizer, tmp_path / "model")
    cfg = resolve(load_config(ROOT / "configs/tiny.yaml", [f"model.path={tmp_path / 'model'}", f"run_dir={run}"]))
    write_config(cfg, run)
    return run


def test_export_refuses_a_folder_that_is_not_empty_unless_forced(exportable, tmp_path, capsys):
    from tidal.ops.cli import main

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (tmp_path / "mine.tmp").mkdir()  # a folder of the user's beside it, too
    assert main(["export", str(exportable), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not empty (1 entries: notes.txt)" in err and "--force" in err
    assert (out / "notes.txt").read_text() == "keep me" and (tmp_path / "mine.tmp").is_dir()
    assert main(["export", str(exportable), "--out", str(out), "--force"]) == 2  # not a model folder: kept
    assert "is not a model folder (no config.json" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "keep me"
    assert main(["export", str(exportable), "--out", str(out / "model")]) == 0
    (out / "model" / "notes.txt").write_text("an earlier export's folder")
    assert main(["export", str(exportable), "--out", str(out / "model"), "--force"]) == 0  # an export replaced
    out = out / "model"
    assert (out / "model.safetensors").is_file() and not (out / "notes.txt").exists()
    assert (tmp_path / "mine.tmp").is_dir()
    assert main(["export", str(exportable), "--out", str(exportable), "--force"]) == 2  # never the run itself
    assert (exportable / "checkpoints" / "step-000002").is_dir()
