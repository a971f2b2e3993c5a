"""Mixed precision done right: fp32 master weights and AdamW state, bf16 compute, an fp32 LM head.

One step of a bf16-compute preset at lr 5e-7 must move every weight that has a gradient; with the
weights themselves in bf16 most such updates fall below bf16's resolution and vanish."""

import pytest
import torch

from conftest import ALPHABET, ROOT, TINY, step_batch
from tidal.config import load_config, resolve
from tidal.learner.build import setup_trainer
from tidal.tiny import build_tiny_model, save_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("precision") / "model"
    save_model(*build_tiny_model(TINY, ALPHABET, seed=0), path)
    return path


def one_step(tiny_path, tmp_path, preset: str, *overrides: str) -> tuple[dict, dict, dict]:
    """(parameters before, after, gradients) of one step of `preset`'s learner on the tiny model."""
    cfg = resolve(
        load_config(
            ROOT / "configs" / preset,
            [
                f"model.path={tiny_path}",
                f"run_dir={tmp_path}",
                "learner.optim.lr=5e-7",
                "learner.optim.warmup_steps=0",
                "learner.groups_per_step=6",
                "learner.kernel_backend=torch",
                "learner.micro_batch_tokens=64",
                *overrides,
            ],
        )
    )
    _, trainer, _, _ = setup_trainer(cfg)
    before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    grads = {}
    for name, p in trainer.policy.named_parameters():  # keep each gradient before the optimizer clears it
        p.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.detach().clone()))
    groups, masks = step_batch(6)
    trainer.step(groups, masks, version=2)
    after = dict(trainer.policy.named_parameters())
    return before, {k: v.detach() for k, v in after.items()}, grads


def moved_fraction(before, after, grads) -> float:
    """Of the weights with a non-zero gradient, the fraction the step changed."""
    moved = has_grad = 0
    for name, grad in grads.items():
        live = grad != 0
        has_grad += int(live.sum())
        moved += int(((after[name] != before[name]) & live).sum())
    return moved / has_grad


def test_a_bf16_preset_keeps_fp32_master_weights_and_moves_every_weight(tiny_path, tmp_path, fresh_accelerator):
    cfg = load_config(ROOT / "configs" / "math.yaml")
    assert (cfg.learner.param_dtype, cfg.learner.mixed_precision) == ("float32", "bf16")
    before, after, grads = one_step(tiny_path, tmp_path, "math.yaml")
    assert all(p.dtype == torch.float32 for p in after.values())
    assert all(not torch.equal(before[name], after[name]) for name in grads)  # every parameter tensor moved
    assert moved_fraction(before, after, grads) > 0.999


def test_bf16_master_weights_lose_most_small_updates(tiny_path, tmp_path, fresh_accelerator):
    """Why: the same step with the weights themselves in bf16 (what the presets used to do)."""
    before, after, grads = one_step(tiny_path, tmp_path, "math.yaml", "learner.param_dtype=bfloat16")
    assert moved_fraction(before, after, grads) < 0.2


def test_the_body_computes_in_bf16_and_the_lm_head_in_fp32(tiny_path, tmp_path, fresh_accelerator):
    cfg = resolve(
        load_config(
            ROOT / "configs" / "math.yaml",
            [f"model.path={tiny_path}", f"run_dir={tmp_path}", "learner.kernel_backend=torch"],
        )
    )
    accelerator, trainer, _, _ = setup_trainer(cfg)
    module = accelerator.unwrap_model(trainer.model)
    seen = []
    module.policy.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    ids = torch.tensor([[2, 3, 4, 5, 6]])
    with accelerator.autocast():
        logp, _ = module(ids, torch.ones_like(ids), torch.arange(4), ids[0, 1:])
        hidden = module.policy.model(input_ids=ids).last_hidden_state[0, :4]  # [4, D]
    assert seen[0] == torch.bfloat16 and logp.dtype == torch.float32
    reference = torch.log_softmax(hidden.float() @ module.policy.lm_head.weight.float().T, -1)  # [4, V] in fp32
    torch.testing.assert_close(logp, reference.gather(1, ids[0, 1:, None])[:, 0], atol=1e-5, rtol=0)
