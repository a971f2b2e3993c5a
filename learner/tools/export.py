"""The trained policy as a Hugging Face model folder (config, tokenizer, safetensors with the
model's own parameter names) that `from_pretrained` and vLLM load as they are; a LoRA run's adapter
also as PEFT saves one (adapter_model.safetensors, adapter_config.json naming the base model), with the
base's tokenizer beside it, as TRL's save_model writes one.

Every run exports its final policy to `<run_dir>/model`, a LoRA run the adapter merged in there (a
folder everything that reads a model loads alone) and the adapter to `<run_dir>/adapter`; `tidal export
RUN_DIR [--step N]` exports any checkpoint (verified against its manifest first): a LoRA run's adapter,
or with `--merge` the merged model. Into a folder that is new or empty unless told `--force`. A folder
is replaced only once the new export is complete beside it.
"""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from pathlib import Path

import torch

from tidal.config import LoraConfig
from tidal.learner.every_rank import lora

# the policy's parameters in a checkpoint, every rank's shards (tidal.learner.every_rank.checkpoint)
CHECKPOINT_WEIGHTS = "model"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # a LoRA adapter's folder, as PEFT saves one
ADAPTER_CONFIG = "adapter_config.json"


def export_model(policy, tokenizer_from: str, out: Path, dtype: str, state: dict | None = None) -> Path:
    """Write `policy` (in `dtype`, what it will be served in; its weights from `state` when given,
    e.g. gathered from a sharded learner) and the tokenizer of `tokenizer_from` to `out`, replacing
    any earlier export there only once the new one is complete."""
    from transformers import AutoTokenizer

    def write(tmp: Path) -> None:
        tensors = {k: v.detach().to(getattr(torch, dtype)).cpu() for k, v in (state or policy.state_dict()).items()}
        policy.save_pretrained(tmp, state_dict=tensors, safe_serialization=True)
        config = json.loads((tmp / "config.json").read_text())
        config.update({k: dtype for k in ("dtype", "torch_dtype") if k in config} or {"dtype": dtype})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(tmp)

    return write_folder(out, write)


def export_adapter(tensors: dict[str, torch.Tensor], cfg: LoraConfig, base_model: str, out: Path, dtype: str) -> Path:
    """A LoRA adapter as PEFT saves one, into `out` (replacing an earlier export only once complete):
    `tensors` (PEFT's names) in `dtype` in adapter_model.safetensors, adapter_config.json naming
    `base_model`, and the base's tokenizer beside them, as TRL's save_model writes it;
    `peft.AutoPeftModelForCausalLM.from_pretrained(out)`, `AutoTokenizer.from_pretrained(out)` and
    vLLM's LoRA load it."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    def write(tmp: Path) -> None:
        save_file(
            {k: v.detach().to("cpu", getattr(torch, dtype)).contiguous() for k, v in tensors.items()},
            str(tmp / ADAPTER_WEIGHTS),
            metadata={"format": "pt"},
        )
        lora.peft_config(cfg, base_model).save_pretrained(str(tmp))
        AutoTokenizer.from_pretrained(base_model).save_pretrained(tmp)

    return write_folder(out, write)


def write_folder(out: Path, write) -> Path:
    """`write(tmp)` fills a new folder beside `out`, which then takes `out`'s place (an earlier folder
    there goes only once the new one is complete)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:12]}"  # its own (never a folder of the user's), umask's mode
    tmp.mkdir()
    try:
        write(tmp)
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
        raise ValueError(
            f"{out} is not empty ({len(entries)} entries: {shown}): pass --force to replace its "
            "contents, or --out a new folder"
        )
    if entries and not {"config.json", ADAPTER_CONFIG} & set(entries):  # --force replaces an earlier export only
        raise ValueError(
            f"{out} is not a model folder (no config.json, nor an adapter's {ADAPTER_CONFIG}; "
            f"{len(entries)} entries: {shown}): --force replaces only an earlier export; --out a new "
            "folder"
        )


class FinalExport:
    """What a run does with its final policy: a model folder in the run directory (under learner.lora the
    adapter merged in, and the adapter alone in a folder beside it), and in MLflow when tracking.log_model
    asks."""

    def __init__(self, model_path: str, out: Path, dtype: str, tracker=None, adapter: LoraConfig | None = None):
        self.model_path, self.out, self.dtype, self.tracker = model_path, out, dtype, tracker
        self.adapter = adapter if adapter is not None and adapter.enabled else None

    @property
    def adapter_out(self) -> Path:
        return self.out.with_name("adapter")

    def __call__(self, policy, state: dict | None = None) -> Path:
        """`state`: the trainer's export_state (under learner.lora the adapter's tensors beside the merged model's)."""
        adapter = {k: v for k, v in (state or {}).items() if k.startswith(lora.PEFT_PREFIX)}
        model = {k: v for k, v in state.items() if k not in adapter} if state is not None else None
        path = export_model(policy, self.model_path, self.out, self.dtype, model)
        if self.tracker is not None:
            self.tracker.log_artifacts(path, "model")
        if self.adapter is not None:
            folder = export_adapter(adapter, self.adapter, self.model_path, self.adapter_out, self.dtype)
            if self.tracker is not None:
                self.tracker.log_artifacts(folder, "adapter")
        return path


def load_checkpoint_policy(checkpoint: Path, model_path: str, adapter: LoraConfig | None = None):
    """The policy of a checkpoint, in fp32: the architecture from model_path, the weights from the
    checkpoint (every rank's part, verified first: they must all be in this folder); under learner.lora
    (`adapter`) the base from model_path and the adapter from the checkpoint."""
    import torch.distributed.checkpoint as dcp

    from tidal.learner.every_rank.checkpoint import MANIFEST, verify
    from tidal.learner.every_rank.state_files import trained_state
    from tidal.learner.every_rank.trainer import load_policy

    if not (checkpoint / CHECKPOINT_WEIGHTS).is_dir():
        raise FileNotFoundError(f"{checkpoint} has no {CHECKPOINT_WEIGHTS}/: not a tidal checkpoint")
    for manifest in [MANIFEST, *sorted(p.name for p in checkpoint.glob("MANIFEST-rank*.json"))]:
        verify(checkpoint, manifest)
    policy = load_policy(model_path, "float32")
    if adapter is not None and adapter.enabled:
        lora.attach(policy, adapter, "float32")
    state = trained_state(policy)  # views of the parameters: loaded in place
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(checkpoint / CHECKPOINT_WEIGHTS)))
    policy.tie_weights()
    return policy


def export_checkpoint(
    run_dir: Path, step: int | None, out: Path | None, force: bool = False, merge: bool = False
) -> Path:
    """`tidal export`: a run's checkpoint at `step` (default: the newest) as a model folder at `out`
    (default RUN_DIR/model-step-<N>), which must be new or empty unless `force`. A LoRA run's is its
    adapter in PEFT's format (default RUN_DIR/adapter-step-<N>), or with `merge` the model with the
    adapter merged in. Says on stderr, in one line, how to load what it wrote."""
    from tidal.config import load_config
    from tidal.learner.every_rank.checkpoint import latest_valid

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    adapter = cfg.learner.lora if cfg.learner.lora.enabled else None
    if merge and adapter is None:
        raise ValueError(
            f"--merge: {run_dir} trained no LoRA adapter (learner.lora.rank = 0): its export is the "
            "whole model already; leave --merge out"
        )
    if step is None:
        checkpoint = latest_valid(run_dir / "checkpoints")
        if checkpoint is None:
            raise FileNotFoundError(f"{run_dir / 'checkpoints'} holds no finished checkpoint")
    else:
        checkpoint = run_dir / "checkpoints" / f"step-{step:06d}"
        if not checkpoint.is_dir():
            found = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
            raise FileNotFoundError(f"--step {step}: no {checkpoint} (checkpoints: {', '.join(found) or 'none'})")
    kind = "adapter" if adapter is not None and not merge else "model"
    out = Path(out) if out else run_dir / f"{kind}-{checkpoint.name}"
    check_export_folder(out, run_dir, force)  # before the minutes a large model takes to load
    policy = load_checkpoint_policy(checkpoint, cfg.model.path, adapter)
    if adapter is None:
        folder = export_model(policy, cfg.model.path, out, cfg.model.dtype)
    elif merge:
        merged = dict(lora.merged(policy.state_dict().items(), adapter.scaling))
        folder = export_model(policy, cfg.model.path, out, cfg.model.dtype, merged)
    else:
        tensors = {lora.peft_name(k): v for k, v in policy.state_dict().items() if lora.is_adapter(k)}
        folder = export_adapter(tensors, adapter, cfg.model.path, out, cfg.model.dtype)
    # on stderr: stdout keeps the folder alone, for $(tidal export ...)
    print(load_line(folder, adapter if kind == "adapter" else None, cfg.model.path), file=sys.stderr)
    return folder


def load_line(folder: Path, adapter: LoraConfig | None = None, base_model: str = "") -> str:
    """How to load an export (an adapter of `base_model` when `adapter` is given), in one line for the console."""
    if adapter is None:
        return (
            f"load it: AutoModelForCausalLM.from_pretrained('{folder}') and AutoTokenizer.from_pretrained("
            f"'{folder}'), or vllm serve {folder}"
        )
    return (
        f"load it: peft's AutoPeftModelForCausalLM.from_pretrained('{folder}') (the base from its "
        f"adapter_config.json) and AutoTokenizer.from_pretrained('{folder}'), or vllm serve {base_model} "
        f"--enable-lora --max-lora-rank {adapter.rank} --lora-modules adapter={folder}"
    )
