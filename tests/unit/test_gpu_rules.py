"""The GPU path's rules, checked on the CPU where they are decisions, not kernels: how a sharded learner
is cut into FSDP2 units and in what precision each gathers, the mesh across machines, flash-attn only
for half-precision compute, the learner ranks' group timeout and backends, the actor's LM head in
fp32, and which engines reload their weights layer-wise."""

import types

import pytest
import torch

from conftest import ALPHABET, ROOT, TINY
from tidal.config import ConfigError, FsdpConfig, load_config


def cfg(*overrides):
    return load_config(ROOT / "configs/tiny.yaml", list(overrides))


class Recorded:
    """fully_shard and init_device_mesh as FSDP2 would be asked: each call's module and arguments."""

    def __init__(self, monkeypatch, world: int, per_node: int):
        import torch.distributed.device_mesh as device_mesh
        import torch.distributed.fsdp as fsdp

        self.units, self.mesh = [], None
        monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: self.units.append((module, kw)) or module)
        monkeypatch.setattr(device_mesh, "init_device_mesh", lambda *a, **kw: setattr(self, "mesh", (a, kw)))
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda *_: world)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))


def sharded(monkeypatch, world: int, per_node: int, mixed_precision: str, head: str, tie: bool) -> Recorded:
    from tidal.learner.every_rank import sharding
    from tidal.learner.every_rank.trainer import PolicyLogprobs, decoder_layers
    from tidal.tiny import build_tiny_model

    model, _ = build_tiny_model(TINY, ALPHABET, seed=0)
    if not tie:  # the tiny model ties its head: an untied one, as 7B+ models have
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    record = Recorded(monkeypatch, world, per_node)
    module = PolicyLogprobs(model, 1.0, "torch", head)
    sharding.shard(
        module,
        decoder_layers(model),
        module.separate_head(),
        FsdpConfig(enabled=True),
        torch.device("cpu"),
        mixed_precision,
        sharding.head_dtype(head),
    )
    return record


def gathers(unit_kwargs) -> torch.dtype | None:
    policy = unit_kwargs.get("mp_policy")
    return policy.param_dtype if policy is not None else None


def test_bf16_units_gather_in_bf16_reduce_in_fp32_and_an_untied_fp32_head_is_a_unit_of_its_own(monkeypatch):
    record = sharded(monkeypatch, world=4, per_node=4, mixed_precision="bf16", head="fp32", tie=False)
    layers, head, root = record.units[:-2], record.units[-2], record.units[-1]
    assert [gathers(kw) for _, kw in layers] == [torch.bfloat16] * TINY.num_layers
    assert all(kw["mp_policy"].reduce_dtype == torch.float32 for _, kw in record.units)
    # the last layer's backward follows its forward at once: it stays gathered
    assert [kw["reshard_after_forward"] for _, kw in layers] == [True] * (TINY.num_layers - 1) + [False]
    assert type(head[0]).__name__ == "LogprobHead" and gathers(head[1]) == torch.float32
    assert gathers(root[1]) == torch.bfloat16  # the embedding and final norm, in the body's precision
    assert record.mesh[0] == ("cpu", (4,))


def test_a_tied_head_shares_the_roots_unit_which_then_gathers_in_fp32(monkeypatch):
    record = sharded(monkeypatch, world=2, per_node=2, mixed_precision="bf16", head="fp32", tie=True)
    assert len(record.units) == TINY.num_layers + 1 and gathers(record.units[-1][1]) == torch.float32


def test_the_served_head_and_no_mixed_precision_gather_as_the_body_does(monkeypatch):
    served = sharded(monkeypatch, world=2, per_node=2, mixed_precision="bf16", head="served", tie=False)
    assert gathers(served.units[-2][1]) == torch.bfloat16
    plain = sharded(monkeypatch, world=2, per_node=2, mixed_precision="no", head="fp32", tie=False)
    assert [gathers(kw) for _, kw in plain.units[:-2] + plain.units[-1:]] == [None] * (TINY.num_layers + 1)


def test_several_machines_shard_within_each_and_replicate_across(monkeypatch):
    record = sharded(monkeypatch, world=16, per_node=8, mixed_precision="bf16", head="fp32", tie=False)
    assert record.mesh == (("cpu", (2, 8)), {"mesh_dim_names": ("replicate", "shard")})


def test_flash_attn_only_for_half_precision(monkeypatch):
    import importlib.util

    from tidal.learner.every_rank.trainer import attention_implementation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else None)
    assert attention_implementation("auto", "float32") == "sdpa"
    assert attention_implementation("auto", "bfloat16") == "flash_attention_2"
    with pytest.raises(ConfigError, match="learner.attention.*flash-attn computes in bf16 or fp16 only"):
        cfg("learner.attention=flash_attention_2")
    cfg("learner.attention=flash_attention_2", "learner.mixed_precision=bf16")  # half precision: fine


def test_the_ranks_wait_as_long_as_rank_0_may_and_offloading_gets_a_cpu_backend(monkeypatch):
    import accelerate

    from tidal.learner.build import build_accelerator

    made = []
    monkeypatch.setattr(accelerate, "Accelerator", lambda **kw: made.append(kw))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for offload in (False, True):
        c = cfg("learner.num_ranks=2", "learner.fsdp.enabled=true", f"learner.fsdp.cpu_offload={offload}")
        build_accelerator(c.learner)
    group = [kw["kwargs_handlers"][0].to_kwargs() for kw in made]
    assert [g["timeout"].total_seconds() for g in group] == [7200.0, 7200.0]
    assert [g.get("backend") for g in group] == [None, "cuda:nccl,cpu:gloo"]
    with pytest.raises(ConfigError, match="learner.dist_timeout_s.*learner.rollout_timeout_s"):
        cfg("learner.dist_timeout_s=60")


def test_colocated_actors_cannot_take_weights_by_nccl():
    with pytest.raises(ConfigError, match="actor.colocate.*NCCL refuses two ranks of one communicator on one GPU"):
        cfg("actor.colocate=true", "weights.transport=nccl")


def test_an_actor_serving_half_precision_computes_its_head_in_fp32():
    from tidal.actor.engine import engine_args

    actor = cfg("actor.vllm.engine_kwargs.hf_overrides={rope_theta: 5}").actor
    assert engine_args(actor, "/m", "bfloat16")["hf_overrides"] == {"head_dtype": "float32", "rope_theta": 5}
    assert "hf_overrides" not in engine_args(cfg().actor, "/m", "float32")


def test_an_engine_of_several_data_parallel_replicas_is_refused():
    """Its replicas' workers would each need a rank in the weight group; actor.replicas scales instead."""
    with pytest.raises(ConfigError, match=r"engine_kwargs.data_parallel_size' = 2: .* scale with actor.replicas"):
        cfg("actor.vllm.engine_kwargs.data_parallel_size=2")


def layer(method: str, **tensors) -> torch.nn.Module:
    module = torch.nn.Module()
    module.quant_method = type(method, (), {})()
    for name, value in tensors.items():
        setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
    return module


@pytest.mark.parametrize(
    ("modules", "layout"),
    [
        ([layer("UnquantizedLinearMethod", weight=torch.ones(2, 2))], "copy"),
        ([layer("Fp8PtpcOnlineLinearMethod", weight=torch.ones(2, 2))], "reload"),  # re-quantizes what it loads
        ([layer("UnquantizedFusedMoEMethod", w13_weight=torch.ones(2, 4, 2))], "reload"),  # the CPU backend packs it
        ([layer("UnquantizedLinearMethod", weight=torch.ones(0))], "reload"),  # a kernel took the weight away
    ],
)
def test_an_update_is_copied_in_place_only_where_loading_is_a_copy(modules, layout):
    from tidal.broker.weights.base import weight_layout

    model = torch.nn.Sequential(*modules)
    assert weight_layout(model) == layout


def test_a_cpu_moe_kernel_is_let_go_before_a_reload(monkeypatch):
    """vLLM's CPU backend packs a MoE layer's experts only when it builds the layer's kernel."""
    from vllm.model_executor.model_loader import reload

    from tidal.broker.weights.base import begin_reload

    moe = layer("UnquantizedFusedMoEMethod", w13_weight=torch.ones(2, 4, 2))
    moe.quant_method.moe_kernel = object()
    begun = []
    monkeypatch.setattr(reload, "initialize_layerwise_reload", begun.append)
    begin_reload(types.SimpleNamespace(modules=lambda: iter([moe])))
    assert moe.quant_method.moe_kernel is None and len(begun) == 1
