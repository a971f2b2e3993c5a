"""The trained policy as a Hugging Face model folder (config, tokenizer, safetensors with the
model's own parameter names) that `from_pretrained` and vLLM load as they are.

Every run exports its final policy to `<run_dir>/model`; `tidal export RUN_DIR [--step N]` exports
any checkpoint (verified against its manifest first), into a folder that is new or empty unless told
`--force`. A folder is replaced only once the new export is complete beside it.
"""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch

CHECKPOINT_WEIGHTS = "model"  # the policy's parameters in a checkpoint, every rank's shards (tidal.learner.checkpoint)


def export_model(policy, tokenizer_from: str, out: Path, dtype: str, state: dict | None = None) -> Path:
    """Write `policy` (in `dtype`, what it will be served in; its weights from `state` when given,
    e.g. gathered from a sharded learner) and the tokenizer of `tokenizer_from` to `out`, replacing
    any earlier export there only once the new one is complete."""
    from transformers import AutoTokenizer

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:12]}"  # its own (never a folder of the user's), umask's mode
    tmp.mkdir()
    try:
        state = {k: v.detach().to(getattr(torch, dtype)).cpu() for k, v in (state or policy.state_dict()).items()}
        policy.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        config = json.loads((tmp / "config.json").read_text())
        config.update({k: dtype for k in ("dtype", "torch_dtype") if k in config} or {"dtype": dtype})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(tmp)
        umask_modes(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists() or out.is_symlink():  # the earlier export goes only once the new one is complete
        old = tmp.with_name(tmp.name + ".old")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
    return out


def umask_modes(folder: Path) -> None:
    """Every file in `folder` as the umask would make it: safetensors writes the weights 0600 (its
    own temporary file, renamed), which keeps the user's group from reading a model it may read
    every other file of. `folder` was made by mkdir, so its mode is 0777 less the umask's bits."""
    mode = folder.stat().st_mode & 0o666
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def check_export_folder(out: Path, run_dir: Path, force: bool) -> None:
    """`tidal export` writes into a new or empty folder (with `force`: replaces a folder's contents),
    never into the run it exports; ValueError naming what is in the way."""
    target, run = out.resolve(), run_dir.resolve()
    checkpoints = run / "checkpoints"
    if target == run or target in run.parents or target == checkpoints or checkpoints in target.parents:
        raise ValueError(f"{out} holds the run's checkpoints ({checkpoints}): choose another --out")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder: choose another --out")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    if entries and not force:
        raise ValueError(f"{out} is not empty ({len(entries)} entries: {shown}): pass --force to replace its "
                         "contents, or --out a new folder")
    if entries and "config.json" not in entries:  # --force replaces an earlier export, not any folder
        raise ValueError(f"{out} is not a model folder (no config.json; {len(entries)} entries: {shown}): --force "
                         "replaces only an earlier export; --out a new folder")


class FinalExport:
    """What a run does with its final policy: a model folder in the run directory, and in MLflow
    when tracking.log_model asks."""

    def __init__(self, model_path: str, out: Path, dtype: str, tracker=None):
        self.model_path, self.out, self.dtype, self.tracker = model_path, out, dtype, tracker

    def __call__(self, policy, state: dict | None = None) -> Path:
        path = export_model(policy, self.model_path, self.out, self.dtype, state)
        if self.tracker is not None:
            self.tracker.log_artifacts(path, "model")
        return path


def load_checkpoint_policy(checkpoint: Path, model_path: str):
    """The policy of a checkpoint, in fp32: the architecture from model_path, the weights from the
    checkpoint (every rank's part, verified first: they must all be in this folder)."""
    import torch.distributed.checkpoint as dcp

    from tidal.broker.weights.payload import without_aliases
    from tidal.learner.checkpoint import MANIFEST, verify
    from tidal.learner.trainer import load_policy

    if not (checkpoint / CHECKPOINT_WEIGHTS).is_dir():
        raise FileNotFoundError(f"{checkpoint} has no {CHECKPOINT_WEIGHTS}/: not a tidal checkpoint")
    for manifest in [MANIFEST, *sorted(p.name for p in checkpoint.glob("MANIFEST-rank*.json"))]:
        verify(checkpoint, manifest)
    policy = load_policy(model_path, "float32")
    state = without_aliases(policy.state_dict())  # views of the parameters: loaded in place
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(checkpoint / CHECKPOINT_WEIGHTS)))
    policy.tie_weights()
    return policy


def export_checkpoint(run_dir: Path, step: int | None, out: Path | None, force: bool = False) -> Path:
    """`tidal export`: a run's checkpoint at `step` (default: the newest) as a model folder at `out`
    (default RUN_DIR/model-step-<N>), which must be new or empty unless `force`."""
    from tidal.config import load_config
    from tidal.learner.checkpoint import latest_valid

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    if step is None:
        checkpoint = latest_valid(run_dir / "checkpoints")
        if checkpoint is None:
            raise FileNotFoundError(f"{run_dir / 'checkpoints'} holds no finished checkpoint")
    else:
        checkpoint = run_dir / "checkpoints" / f"step-{step:06d}"
        if not checkpoint.is_dir():
            found = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
            raise FileNotFoundError(f"--step {step}: no {checkpoint} (checkpoints: {', '.join(found) or 'none'})")
    out = Path(out) if out else run_dir / f"model-{checkpoint.name}"
    check_export_folder(out, run_dir, force)  # before the minutes a large model takes to load
    policy = load_checkpoint_policy(checkpoint, cfg.model.path)
    return export_model(policy, cfg.model.path, out, cfg.model.dtype)
