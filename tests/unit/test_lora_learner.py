"""LoRA on the learner (learner.lora): only the adapter trains, in fp32, over a frozen base; a push
carries the adapter alone under PEFT's own names; a checkpoint holds the adapter and its AdamW state
and resumes bit for bit; the exports load in peft and transformers with the learner's logits."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from conftest import ALPHABET, CASES, ROOT, STEP_VERSION, TINY, learner_config, step_batch
from tidal.broker.schema import AdapterSpec
from tidal.config import CheckpointConfig, ConfigError, LoraConfig, WeightsConfig, load_config, write_config
from tidal.learner.every_rank.checkpoint import Checkpointer, safetensors_header
from tidal.learner.every_rank.trainer import Trainer
from tidal.tiny import build_tiny_model, save_model

# q, k, v, o (32 -> 32) and gate, up (32 -> 64), down (64 -> 32): 4 x 64 + 3 x 96 = 544 (in + out) a layer
ALL_TARGETS = LoraConfig(rank=4, alpha=8.0)
TINY_ADAPTER_PARAMS = 4 * 544 * 2  # r x (in + out) x 2 layers


@pytest.fixture
def accelerator(fresh_accelerator):
    """A plain CPU Accelerator of each test's own: one test here computes in bf16 (Accelerate keeps one state)."""
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def lora_trainer(accelerator, lora: LoraConfig = ALL_TARGETS, case: str = "ppo_token_mean_2updates", **keys):
    cfg = dataclasses.replace(learner_config(*CASES[case]), lora=lora, **keys)
    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    return Trainer(cfg, model, accelerator, temperature=1.0)


def tensors(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.policy.state_dict().items()}


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[2, 5, 9, 12, 3, 7, 13, 4]])


def test_only_the_adapter_trains_and_the_base_stays_as_it_was(accelerator):
    t = lora_trainer(accelerator)
    trained = [n for n, p in t.policy.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A.default." in n or ".lora_B.default." in n for n in trained)
    assert sum(p.numel() for p in t.policy.parameters() if p.requires_grad) == TINY_ADAPTER_PARAMS == 4352
    assert len(t._optimizer.state) == len(trained)  # AdamW holds the adapter's moments alone
    before = tensors(t)
    assert all(not v.any() for k, v in before.items() if ".lora_B." in k)  # B = 0: the policy starts as the base
    t.step(*step_batch(6), version=STEP_VERSION)
    after = tensors(t)
    moved = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert moved == sorted(k for k in before if ".lora_" in k)
    # the module tree the trainer runs is the model's: policy.model, and the fused head on policy.lm_head.weight
    assert t.policy.lm_head.weight is t.policy.model.embed_tokens.weight


def test_layers_restrict_the_adapter_and_the_starting_adapter_comes_from_the_seed(accelerator):
    lora = LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj", "down_proj"), layers=(1,))
    cfg = dataclasses.replace(learner_config(*CASES["cispo_prompt_mean"]), lora=lora)
    starts = []
    for seed in (123, 7):  # the global generator plays no part in the adapter's start, and is left as it was
        model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        starts.append(tensors(Trainer(cfg, model, accelerator, temperature=1.0)))
        assert torch.equal(torch.get_rng_state(), state)
    assert sorted(k for k in starts[0] if ".lora_" in k) == [
        f"model.layers.1.{m}.lora_{f}.default.weight" for m in ("mlp.down_proj", "self_attn.q_proj") for f in "AB"
    ]
    assert all(torch.equal(starts[0][k], v) for k, v in starts[1].items())
    a = starts[0]["model.layers.1.self_attn.q_proj.lora_A.default.weight"]  # [r, in], torch.nn.Linear's bound
    assert a.shape == (2, 32) and 0.5 / 32**0.5 < float(a.abs().max()) <= 1 / 32**0.5


def test_targets_the_model_lacks_and_the_head_are_refused_by_name(accelerator):
    with pytest.raises(
        ConfigError,
        match=r"'learner\.lora\.target_modules' = \('q_proj', 'qkv_proj', 'c_attn'\): the "
        r"model's decoder layers have no linear layer qkv_proj, c_attn; they have: "
        r"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
    ):
        lora_trainer(accelerator, LoraConfig(rank=4, target_modules=("q_proj", "qkv_proj", "c_attn")))
    with pytest.raises(ConfigError, match=r"'learner\.lora\.layers' = \(1, 2\): the model has 2 decoder layers"):
        lora_trainer(accelerator, LoraConfig(rank=4, layers=(1, 2)))
    with pytest.raises(
        ConfigError,
        match=r"'learner\.lora\.target_modules' = .*lm_head, model\.embed_tokens: the LM "
        r"head and the embedding take no adapter",
    ):
        load_config(
            ROOT / "configs/tiny.yaml",
            ["learner.lora.rank=8", "learner.lora.target_modules=[q_proj,lm_head,model.embed_tokens]"],
        )


def test_config_check_refuses_targets_the_model_lacks_naming_the_ones_it_has(tmp_path, capsys):
    from tidal.ops.cli import main

    model, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    save_model(model, tokenizer, tmp_path / "model")
    common = ["config", "check", str(ROOT / "configs/tiny-lora.yaml"), f"model.path={tmp_path / 'model'}"]
    assert main([*common, "learner.lora.target_modules=[q_proj,W_pack]"]) == 2
    assert (
        "no linear layer W_pack; they have: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
        in capsys.readouterr().err
    )
    assert main(common) == 0


def peft_model_with(trainer: Trainer, lora: LoraConfig):
    """A real peft PeftModel of the tiny base, carrying the trainer's adapter values."""
    from peft import get_peft_model

    from tidal.learner.every_rank.lora import peft_config

    base, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    model = get_peft_model(base, peft_config(lora))
    ours = dict(trainer.policy.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(ours[name.removeprefix("base_model.model.")])
    return model.eval()


def test_a_push_carries_the_adapter_alone_under_peft_names_in_the_served_dtype(accelerator, tmp_path):
    from peft import get_peft_model_state_dict

    from tidal.broker.weights import build_publisher
    from tidal.learner.every_rank.ranks import WeightPush

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    t = lora_trainer(accelerator, lora)
    t.step(*step_batch(6), version=STEP_VERSION)
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        [
            "model.dtype=bfloat16",
            "learner.lora.rank=4",
            "learner.lora.alpha=8",
            "learner.lora.target_modules=[q_proj,v_proj,down_proj]",
        ],
    )
    push = WeightPush.of(cfg)
    assert push == WeightPush("bfloat16", AdapterSpec(4, 8.0, ("q_proj", "v_proj", "down_proj")))
    publisher = build_publisher(WeightsConfig(dir=str(tmp_path / "weights")), "inc", "run", str(tmp_path), "bfloat16")
    update = push(t, publisher, version=3)
    assert update.adapter == push.adapter and update.version == 3
    expected = get_peft_model_state_dict(peft_model_with(t, lora))  # what save_pretrained writes
    with safe_open(update.location, "pt") as f:
        sent = {name: f.get_tensor(name) for name in f.keys()}
    assert sorted(sent) == sorted(expected) and len(sent) == 2 * 3 * 2  # A and B of 3 modules in 2 layers
    assert sent["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 32)  # [r, in]
    assert sent["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (32, 4)  # [out, r]
    assert {s.dtype for s in update.manifest} == {"BF16"}
    for name, value in expected.items():
        assert sent[name].dtype == torch.bfloat16 and torch.equal(sent[name], value.to(torch.bfloat16)), name
    publisher.close()


def test_the_learners_logits_are_a_peft_models_with_its_adapter(accelerator):
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    t = lora_trainer(accelerator, lora)
    t.step(*step_batch(6), version=STEP_VERSION)
    peft_model = peft_model_with(t, lora)
    ours, theirs = logits(t.policy.eval(), IDS), logits(peft_model, IDS)
    base, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    assert float((ours - logits(base.eval(), IDS)).abs().max()) > 1e-3  # the adapter moved the policy
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def checkpoint_parts(path) -> dict[str, int]:
    """Elements per tensor in a checkpoint's model/ and optimizer/ files."""
    found = {}
    for file in sorted(p for part in ("model", "optimizer") for p in (path / part).glob("*.safetensors")):
        for name, tensor in safetensors_header(file).items():
            found[f"{file.parent.name}/{name}"] = int(np.prod(tensor["shape"]))
    return found


def test_a_lora_checkpoint_holds_the_adapter_and_its_adamw_state_and_resumes_bit_for_bit(accelerator, tmp_path):
    lora = dataclasses.replace(ALL_TARGETS, dropout=0.1)  # the dropout draws come back with the random states
    straight = lora_trainer(accelerator, lora)
    batches = [step_batch(6, seed=i) for i in range(4)]
    for i in range(4):  # two steps, a checkpoint, two more
        straight.step(*batches[i], version=STEP_VERSION)
        if i == 1:
            saved = Checkpointer(CheckpointConfig(), tmp_path / "checkpoints", accelerator, straight).save(2, {})
    resumed = lora_trainer(accelerator, lora)  # a fresh trainer (and random state) continues from the checkpoint
    Checkpointer(CheckpointConfig(), tmp_path / "checkpoints", accelerator, resumed).load(saved)
    for i in (2, 3):
        resumed.step(*batches[i], version=STEP_VERSION)
    assert all(torch.equal(tensors(straight)[k], v) for k, v in tensors(resumed).items())
    parts = checkpoint_parts(saved)
    model = {k: n for k, n in parts.items() if k.startswith("model/")}
    assert sorted(model) == sorted(f"model/{n}" for n, p in straight.policy.named_parameters() if p.requires_grad)
    assert sum(model.values()) == TINY_ADAPTER_PARAMS
    moments = {k: n for k, n in parts.items() if k.startswith("optimizer/") and k.endswith(("exp_avg", "exp_avg_sq"))}
    assert sum(moments.values()) == 2 * TINY_ADAPTER_PARAMS and all(".lora_" in k for k in parts)
    # resumed by a run without the adapter: refused by name, not loaded in part
    full = Trainer(
        learner_config(*CASES["ppo_token_mean_2updates"]),
        build_tiny_model(TINY, ALPHABET, seed=0)[0],
        accelerator,
        temperature=1.0,
    )
    with pytest.raises(ValueError, match="saved by a run with a LoRA adapter, this learner has learner.lora.rank = 0"):
        Checkpointer(CheckpointConfig(), tmp_path / "checkpoints", accelerator, full)._check_fits(saved)


def test_the_base_is_held_in_the_compute_dtype_and_the_adapter_and_head_in_fp32(fresh_accelerator):
    from accelerate import Accelerator

    from tidal.learner.every_rank.trainer import policy_dtype

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    cfg = dataclasses.replace(learner_config(*CASES["cispo_prompt_mean"]), mixed_precision="bf16", lora=ALL_TARGETS)
    assert policy_dtype(cfg) == "bfloat16"
    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    t = Trainer(cfg, model.to(torch.bfloat16), accelerator, temperature=1.0)  # as build.py loads it
    dtypes = {n: p.dtype for n, p in t.policy.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert dtypes["model.embed_tokens.weight"] == torch.float32  # the fp32 head, tied to the embedding
    assert dtypes["model.layers.0.self_attn.q_proj.base_layer.weight"] == torch.bfloat16
    metrics = t.step(*step_batch(6), version=STEP_VERSION)
    assert np.isfinite(metrics["learner/loss"]) and metrics["learner/grad_norm"] > 0


class Artifacts:
    def __init__(self):
        self.logged = []

    def log_artifacts(self, folder, name):
        self.logged.append((name, sorted(p.name for p in folder.iterdir())))


def test_the_final_export_is_the_merged_model_and_the_adapter_beside_it(accelerator, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tidal.learner.tools.export import FinalExport

    base, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    save_model(base, tokenizer, tmp_path / "base")
    t = lora_trainer(accelerator)
    t.step(*step_batch(6), version=STEP_VERSION)
    tracker = Artifacts()
    model_dir = FinalExport(str(tmp_path / "base"), tmp_path / "run" / "model", "float32", tracker, ALL_TARGETS)(
        t.policy, t.export_state("float32")
    )
    assert [name for name, _ in tracker.logged] == ["model", "adapter"]
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= set(tracker.logged[1][1])
    ours = logits(t.policy.eval(), IDS)
    merged = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.testing.assert_close(logits(merged, IDS), ours, atol=1e-5, rtol=0)
    adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "run" / "adapter"
    ).eval()
    torch.testing.assert_close(logits(adapter, IDS), ours, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run's folder (config.yaml, a checkpoint at step 1, the base model it names), and its trainer."""
    from accelerate import Accelerator

    root = tmp_path_factory.mktemp("lora-run")
    base, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    save_model(base, tokenizer, root / "base")
    cfg = load_config(ROOT / "configs/tiny-lora.yaml", [f"model.path={root / 'base'}", f"run_dir={root / 'run'}"])
    write_config(cfg, root / "run")
    accelerator = Accelerator(cpu=True)
    t = lora_trainer(accelerator, cfg.learner.lora)
    t.step(*step_batch(6), version=STEP_VERSION)
    Checkpointer(CheckpointConfig(), root / "run" / "checkpoints", accelerator, t).save(1, {})
    return root, cfg, t


def test_tidal_export_writes_a_lora_runs_adapter_that_peft_loads_over_the_base(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tidal.learner.tools.export import export_checkpoint

    root, cfg, t = lora_run
    folder = export_checkpoint(root / "run", None, None)
    assert folder == root / "run" / "adapter-step-000001"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["r"], config["lora_alpha"]) == (
        str(root / "base"),
        cfg.learner.lora.rank,
        cfg.learner.lora.alpha,
    )
    assert sorted(config["target_modules"]) == sorted(cfg.learner.lora.target_modules)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]), folder
    ).eval()
    torch.testing.assert_close(logits(model, IDS), logits(t.policy.eval(), IDS), atol=1e-6, rtol=0)


def test_an_exported_adapter_holds_the_bases_tokenizer_and_export_says_how_to_load_it(lora_run, capsys):
    """AutoTokenizer.from_pretrained(adapter) failed (no tokenizer in the folder); TRL's save_model writes
    it beside the adapter, and so does tidal export."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    from tidal.learner.tools.export import export_checkpoint

    root, cfg, t = lora_run
    folder = export_checkpoint(root / "run", None, root / "adapter-with-tokenizer")
    ours, base = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(root / "base")
    assert ours.get_vocab() == base.get_vocab() and ours("37+48=")["input_ids"] == base("37+48=")["input_ids"]
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"load it: peft's AutoPeftModelForCausalLM.from_pretrained('{folder}') (the base from its adapter_config.json)"
        f" and AutoTokenizer.from_pretrained('{folder}'), or vllm serve {root / 'base'} --enable-lora --max-lora-rank "
        f"{cfg.learner.lora.rank} --lora-modules adapter={folder}"
    )
    model = AutoPeftModelForCausalLM.from_pretrained(folder).eval()  # what the line says loads, does
    ours = logits(t.policy.eval(), IDS)
    # peft grows the embeddings to a longer tokenizer's length, and the tiny model's, reloaded, has one token
    # more than its 14 embeddings (transformers adds <|endoftext|>); the rows it had are untouched
    torch.testing.assert_close(logits(model, IDS)[..., : ours.shape[-1]], ours, atol=1e-6, rtol=0)


def test_tidal_export_merge_writes_a_model_with_the_peft_models_logits(lora_run, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tidal.ops.cli import main

    root, *_ = lora_run
    assert main(["export", str(root / "run"), "--merge", "--out", str(root / "merged")]) == 0
    assert capsys.readouterr().out.strip() == str(root / "merged")
    merged = AutoModelForCausalLM.from_pretrained(root / "merged").eval()
    assert not any("lora" in name for name in merged.state_dict())
    adapter = main(["export", str(root / "run"), "--out", str(root / "adapter")])
    assert adapter == 0
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "base"), root / "adapter")
    torch.testing.assert_close(logits(merged, IDS), logits(peft_model.eval(), IDS), atol=1e-5, rtol=0)
    # --merge of a run that trained every weight: refused by name
    full = root / "full-run"
    write_config(load_config(ROOT / "configs/tiny.yaml", [f"model.path={root / 'base'}"]), full)
    assert main(["export", str(full), "--merge"]) == 2
    assert "trained no LoRA adapter (learner.lora.rank = 0)" in capsys.readouterr().err


def test_the_lora_preset_learns_at_its_own_learning_rate():
    cfg = load_config(ROOT / "configs/tiny-lora.yaml")
    base = load_config(ROOT / "configs/tiny.yaml")
    assert cfg.learner.lora.enabled and cfg.model.tiny == base.model.tiny and cfg.task == base.task  # one model
    assert cfg.learner.optim.lr >= 4 * base.learner.optim.lr  # LoRA learns at a larger learning rate
