"""The memory plan (tidal/ops/memory.py) on real models' shapes, from the config.json files in
bench/models: exact parameter counts, each term's bytes, and refusals that name the budget, the
largest term and the keys that change it. Meta-device models only: no weights, no GPU."""

from types import SimpleNamespace

import pytest

from conftest import ROOT
from tidal.config import ConfigError, load_config
from tidal.ops import memory
from tidal.ops.cli import main
from tidal.ops.memory import (
    Cluster,
    GiB,
    MiB,
    ModelShape,
    actor_host_terms,
    check_gpus,
    find_model_config,
    layer_activation_bytes,
    learner_host_terms,
    plan,
    shard_count,
)
from tidal.ops.placement import PlacementError

MODELS = ROOT / "bench" / "models"
PUBLISHED_B = {
    "Qwen2.5-1.5B": 1.54,
    "Qwen2.5-7B": 7.62,
    "Qwen2.5-14B": 14.8,
    "Qwen2.5-32B": 32.8,
    "Qwen3-30B-A3B": 30.5,
}
EIGHT_80 = Cluster(80 * GiB, 8, 2048 * GiB)
# a 32B learner over two nodes of 8 GPUs, fully sharded, its actors two GPUs each (tensor parallel)
TWO_NODES = [
    "learner.num_ranks=16",
    "learner.nodes=2",
    "learner.master_addr=tidal-learner-0",
    "learner.fsdp.replicate_over_nodes=false",
    "learner.fsdp.activation_checkpointing=true",
    "learner.micro_batch_tokens=16384",
    "actor.vllm.tensor_parallel_size=2",
    "actor.vllm.max_model_len=16384",
    "weights.transport=nccl",
]


@pytest.fixture(scope="module")
def shapes() -> dict[str, ModelShape]:
    return {name: ModelShape.from_config(MODELS / name) for name in PUBLISHED_B}


def terms(budget) -> dict[str, int]:
    return {t.name: t.nbytes for t in budget.terms}


def test_shapes_count_the_published_parameters(shapes):
    for name, billions in PUBLISHED_B.items():
        assert shapes[name].num_params == pytest.approx(billions * 1e9, rel=0.01), name
    assert [shapes[n].num_params for n in PUBLISHED_B] == [
        1_543_714_304,
        7_615_616_512,
        14_770_033_664,
        32_763_876_352,
        30_532_122_624,
    ]
    moe = shapes["Qwen3-30B-A3B"]
    assert moe.active_params == 3_353_032_704 == pytest.approx(3.3e9, rel=0.02)  # published: 3.3B active
    assert (moe.num_experts, moe.experts_per_token, moe.qk_norm, moe.num_layers) == (128, 8, True, 48)


def test_a_config_transformers_cannot_build_is_one_line_naming_its_model_type():
    with pytest.raises(ConfigError, match=r"^the model config: model_type 'nonesuch' is not a causal LM"):
        ModelShape.from_config({"model_type": "nonesuch", "hidden_size": 8})


def test_dense_shapes_count_layers_embeddings_and_a_tied_head(shapes):
    seven = shapes["Qwen2.5-7B"]
    assert (seven.embed_params, seven.head_params) == (152064 * 3584, 152064 * 3584)
    assert seven.largest_tensor_params == 152064 * 3584 and seven.active_params == seven.num_params
    attention = 3584 * 3584 * 2 + 2 * 3584 * 512 + 3584 + 2 * 512  # q, o; k, v; their biases
    assert seven.layer_params == attention + 3 * 3584 * 18944 + 2 * 3584
    assert (seven.mlp_width, seven.num_kv_heads, seven.head_dim) == (18944, 4, 128)
    small = shapes["Qwen2.5-1.5B"]
    assert small.tied and small.head_params == 0
    assert small.payload_params == small.num_params + 151936 * 1536  # the tied head travels under both names


def test_an_moe_counts_the_experts_a_token_is_routed_to(shapes):
    moe = shapes["Qwen3-30B-A3B"]
    experts_per_layer = 128 * (3 * 2048 * 768)
    assert moe.num_params - moe.active_params == 48 * experts_per_layer * 120 // 128
    # 8 experts of width 768; the router's 128 x 2048 weight adds 128 / 3 columns
    assert moe.mlp_width == 8 * 768 + round(128 / 3)


def test_the_logprob_kernels_working_set_is_the_kernels_own_statement():
    from tidal.kernels import working_set_bytes
    from tidal.kernels.chunked import DEFAULT_TOKEN_CHUNK, DEFAULT_VOCAB_CHUNK

    t, d, v = 8192, 3584, 152_064
    # Triton in bf16: the fp32 [V, D] accumulator only while the head is trained (not under LoRA)
    assert working_set_bytes("triton", t, d, v, 2) == t * d * 2 + v * d * 4
    assert working_set_bytes("triton", t, d, v, 2, weight_grad=False) == t * d * 6
    assert working_set_bytes("triton", t, d, v, 4) == t * d * 8  # fp32 weights accumulate in place
    # the chunked backend: its own tiles, never [T, V]; the naive one materializes [T, V] several times
    tiles = DEFAULT_TOKEN_CHUNK * DEFAULT_VOCAB_CHUNK
    assert 2 * tiles * 4 < working_set_bytes("torch", t, d, v, 4) < t * v * 4
    assert working_set_bytes("naive", t, d, v, 4) >= 5 * t * v * 4
    with pytest.raises(ValueError, match="auto"):
        working_set_bytes("auto", t, d, v, 2)


def test_activations_per_token_and_layer_and_with_checkpointing(shapes):
    seven = shapes["Qwen2.5-7B"]
    compute = 3 * 3584 + (3 * 28 + 3 * 4) * 128 + 4 * 18944  # hidden copies, attention, MLP
    assert layer_activation_bytes(seven, 2) == compute * 2 + 4 * 3584 * 4 == 254_976
    base = ["learner.num_ranks=4", "learner.fsdp.enabled=true", "learner.micro_batch_tokens=8192"]
    full = terms(plan(load_config("scalerl", base), seven, EIGHT_80).budget("learner GPU"))
    kept = terms(
        plan(load_config("scalerl", [*base, "learner.fsdp.activation_checkpointing=true"]), seven, EIGHT_80).budget(
            "learner GPU"
        )
    )
    assert full["activations (28 layers, no checkpointing)"] == 28 * 8192 * 254_976
    assert kept["layer inputs kept (28 layers, checkpointing)"] == 28 * 8192 * 3584 * 2
    assert kept["one layer's activations, recomputed"] == 8192 * 254_976
    # bf16 on a GPU runs the Triton kernels: beside the bf16 dhidden, the trained head's weight gradient is
    # accumulated in fp32 over the whole [V, D] (2.2 GB for this vocabulary)
    assert kept["logprob kernel (triton backend's working set)"] == 8192 * 3584 * 2 + 152_064 * 3584 * 4


def test_a_sharded_32b_learner_fits_on_8_x_80_gib_and_an_unsharded_one_is_refused(shapes):
    big = shapes["Qwen2.5-32B"]
    sharded = plan(load_config("scalerl", [*TWO_NODES, "learner.fsdp.enabled=true"]), big, EIGHT_80)
    sharded.check()
    learner = terms(sharded.budget("learner GPU"))
    assert learner["parameters (float32, 1/16 a rank)"] == 32_763_876_352 * 4 // 16
    assert learner["AdamW state (2 x float32, 1/16 a rank)"] == 2 * 32_763_876_352 * 4 // 16
    assert learner["nccl send buffers (2 sends x 2 chunks)"] == 2 * 2 * (64 * MiB + 152064 * 5120 * 2)
    assert 60 * GiB < sharded.budget("learner GPU").total_bytes < 80 * GiB
    assert terms(sharded.budget("actor GPU, vLLM's share"))["KV cache of one 16384-token sequence"] == 2 * GiB
    unsharded = plan(load_config("scalerl", [*TWO_NODES, "learner.micro_batch_tokens=4096"]), big, EIGHT_80)
    with pytest.raises(ConfigError) as err:
        unsharded.check()
    text = str(err.value)
    assert "does not fit the learner GPU" in text and "its largest term, AdamW state (2 x float32) at 244.1 GiB" in text
    assert "learner.num_ranks = 16, learner.fsdp.enabled = False, learner.fsdp.cpu_offload = False" in text


def test_an_engine_at_0_95_of_the_gpu_has_no_room_left_for_nccl_buffers_of_32b(shapes):
    big = shapes["Qwen2.5-32B"]
    cfg = load_config("scalerl", [*TWO_NODES, "learner.fsdp.enabled=true", "actor.vllm.gpu_memory_utilization=0.95"])
    outside = plan(cfg, big, EIGHT_80).budget("actor GPU, outside vLLM's share")
    assert terms(outside) == {
        "CUDA context and NCCL": 2 * GiB,
        "nccl receive buffers (2 streams)": 2 * (64 * MiB + 152064 * 5120 * 2),
        "nccl tensor tags' scratch (2 streams)": 2 * 64 * MiB,
    }
    assert outside.capacity_bytes == 80 * GiB - int(0.95 * 80 * GiB)
    with pytest.raises(
        ConfigError,
        match=r"does not fit the actor GPU, outside vLLM's share: 5\.2 GiB of 4\.0 GiB; "
        r"its largest term, nccl receive buffers .* actor\.vllm\."
        r"gpu_memory_utilization = 0\.95, weights\.bucket_mib = 64",
    ):
        plan(cfg, big, EIGHT_80).check()
    plan(load_config("scalerl", [*TWO_NODES, "learner.fsdp.enabled=true"]), big, EIGHT_80).check()  # 0.9: 8 GiB


def test_host_payload_terms_scale_with_weights_keep(shapes):
    payload = 7_615_616_512 * 2  # bfloat16, the 7B's head untied
    for keep, kept in ((1, 2), (2, 2), (3, 3), (5, 5)):
        host = terms_of(learner_host_terms(load_config("scalerl", [f"weights.keep={keep}"]), shapes["Qwen2.5-7B"]))
        assert host[f"weight payloads kept ({kept} x bfloat16)"] == kept * payload
        assert host[f"weight files in /dev/shm ({kept})"] == kept * payload  # the file channel's default folder
        assert host["file channel's serialized copy"] == payload
    on_disk = terms_of(learner_host_terms(load_config("scalerl", ["weights.dir=/weights"]), shapes["Qwen2.5-7B"]))
    assert "weight files in /dev/shm (3)" not in on_disk
    tcp = load_config("scalerl", ["weights.transport=tcp"])
    assert set(terms_of(learner_host_terms(tcp, shapes["Qwen2.5-7B"]))) == {
        "weight payloads kept (3 x bfloat16)",
        "weight payloads retired while still sent (1)",
        "checkpoint being written (AdamW state, staged and serialized)",
        "learner processes (1)",
    }
    nccl = terms_of(
        learner_host_terms(
            load_config("scalerl", ["weights.transport=nccl", "weights.max_sends=3"]), shapes["Qwen2.5-7B"]
        )
    )
    assert nccl["weight payloads retired while still sent (3)"] == 3 * payload  # each transfer holds its version
    staged = [t for t in actor_host_terms(tcp, shapes["Qwen2.5-7B"]) if t.shm]
    assert [(t.name, t.nbytes) for t in staged] == [("weights staged in /dev/shm (tcp)", payload)]


def terms_of(found) -> dict[str, int]:
    return {t.name: t.nbytes for t in found}


def test_shards_span_a_node_under_hsdp_and_offload_moves_them_to_the_host(shapes):
    two = ["learner.num_ranks=16", "learner.nodes=2", "learner.master_addr=a", "learner.fsdp.enabled=true"]
    assert shard_count(load_config("scalerl", two)) == 8  # replicated across the 2 nodes
    assert shard_count(load_config("scalerl", [*two, "learner.fsdp.replicate_over_nodes=false"])) == 16
    assert shard_count(load_config("scalerl", two[:3])) == 1
    offload = load_config(
        "scalerl", ["learner.num_ranks=4", "learner.fsdp.enabled=true", "learner.fsdp.cpu_offload=true"]
    )
    result = plan(offload, shapes["Qwen2.5-14B"], EIGHT_80)
    assert not [t for t in result.budget("learner GPU").terms if "AdamW" in t.name]
    host = terms(result.budget("learner host, node 0"))
    assert host["offloaded parameters, gradients, AdamW (4 ranks)"] == 4 * (16 * 14_770_033_664 // 4)
    # every rank stages its part of AdamW's state (2 x fp32) and its serialized bytes
    assert host["checkpoint being written (AdamW state, staged and serialized)"] == 4 * 2 * (8 * 14_770_033_664 // 4)


def test_a_lora_learner_holds_a_frozen_base_and_the_adapters_fp32_state(shapes):
    seven, head = shapes["Qwen2.5-7B"], 152064 * 3584
    assert seven.layer_linears == [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    full = load_config("scalerl", ["learner.micro_batch_tokens=8192"])
    lora = load_config("scalerl", ["learner.micro_batch_tokens=8192", "learner.lora.rank=16"])
    # r x (in + out) of q, k, v, o, gate, up, down in 28 layers: what peft reports for Qwen2.5-7B at r = 16
    assert memory.adapter_params(lora, seven) == 16 * 28 * (7168 + 4096 + 4096 + 7168 + 3 * 22528) == 40_370_176
    two = load_config(
        "scalerl", ["learner.lora.rank=16", "learner.lora.layers=[0,1]", "learner.lora.target_modules=[q_proj,v_proj]"]
    )
    assert memory.adapter_params(two, seven) == 16 * 2 * (7168 + 4096)
    learner = terms(plan(lora, seven, EIGHT_80).budget("learner GPU"))
    # the base in bf16 (its untied LM head in fp32, model.head = fp32) with no gradients and no AdamW state
    assert learner["frozen base (bfloat16, no gradients or AdamW state)"] == (7_615_616_512 - head) * 2 + head * 4
    adapter = "40,370,176 adapter parameters, float32"
    assert [learner[f"LoRA {what} ({adapter})"] for what in ("parameters", "gradients")] == [40_370_176 * 4] * 2
    assert learner[f"LoRA AdamW state (2 x {adapter})"] == 2 * 40_370_176 * 4
    assert learner["autocast weight copies (bfloat16)"] == 40_370_176 * 2  # of the adapter: the base is bf16 already
    assert not [name for name in learner if name.startswith(("parameters", "gradients", "AdamW"))]
    # one 80 GiB GPU: the whole 7B's fp32 state is refused, its adapter fits
    with pytest.raises(ConfigError, match="its largest term, AdamW state"):
        plan(full, seven, EIGHT_80).check()
    plan(lora, seven, EIGHT_80).check()
    host = terms(plan(lora, seven, EIGHT_80).budget("learner host, node 0"))
    assert host["weight payloads kept (3 x bfloat16)"] == 3 * 40_370_176 * 2  # a push carries the adapter alone
    assert host["checkpoint being written (AdamW state, staged and serialized)"] == 2 * 2 * 40_370_176 * 4
    # the actor: vLLM's one slot at its size 16, on every linear layer whatever the targets, in bf16
    slot = terms(plan(two, seven, EIGHT_80).budget("actor GPU, vLLM's share"))
    assert slot["LoRA slot (max_lora_rank 16, every linear layer)"] == 40_370_176 * 2
    twelve = load_config("scalerl", ["learner.lora.rank=12"])
    assert twelve.learner.lora.served_rank == 16
    with pytest.raises(ConfigError, match="learner.lora.rank.*vLLM serves adapters of rank 512 at most"):
        load_config("scalerl", ["learner.lora.rank=600"])
    sharded = load_config("scalerl", ["learner.lora.rank=16", "learner.num_ranks=4", "learner.fsdp.enabled=true"])
    gathered = terms(plan(sharded, seven, EIGHT_80).budget("learner GPU"))
    assert gathered["gathered decoder layers (2)"] == 2 * seven.layer_params * 2  # no gradients of a frozen base
    assert (
        gathered["frozen base (bfloat16, no gradients or AdamW state, 1/4 a rank)"]
        == ((7_615_616_512 - head) * 2 + head * 4) // 4
    )


def test_colocated_engines_take_their_share_of_the_learner_gpu(shapes):
    cfg = load_config(
        "scalerl",
        [
            "actor.colocate=true",
            "actor.replicas=2",
            "actor.vllm.gpu_memory_utilization=0.3",
            "learner.num_ranks=2",
            "learner.fsdp.enabled=true",
            "weights.transport=tcp",
        ],
    )
    result = plan(cfg, shapes["Qwen2.5-1.5B"], EIGHT_80)
    learner = terms(result.budget("learner GPU"))
    assert learner["vLLM's share of 1 colocated engine(s)"] == int(0.3 * 80 * GiB)
    assert [b.device for b in result.budgets] == ["learner GPU", "actor GPU, vLLM's share", "learner host, node 0"]
    # on one machine node 0 holds the actors' host memory too: two engines' processes, tcp staging each
    host = terms(result.budget("learner host, node 0"))
    assert host["actors' host memory (2)"] == 2 * (2 * 4 * GiB + shapes["Qwen2.5-1.5B"].payload_params * 2)


def test_config_check_prints_the_plan_and_refuses_what_does_not_fit(capsys):
    fits = [
        "config",
        "check",
        "tiny",
        "--gpu-gib",
        "141",
        "--host-gib",
        "2048",
        "--model-config",
        str(MODELS / "Qwen2.5-1.5B" / "config.json"),
    ]
    assert main(fits) == 0
    out = capsys.readouterr().out
    assert "memory plan: Qwen2.5-1.5B (1.54 B parameters) on 141.0 GiB GPUs, 8 a node" in out
    assert "  learner GPU " in out and "config ok" in out
    refused = ["config", "check", "tiny", "--gpu-gib", "80", "--model-config", str(MODELS / "Qwen2.5-7B")]
    assert main(refused) == 2
    err = capsys.readouterr().err
    # the tiny preset computes in fp32: a micro-batch's activations outweigh even the unsharded AdamW state
    assert "memory plan: Qwen2.5-7B does not fit the learner GPU: 233.6 GiB of 80.0 GiB" in err
    assert "activations (28 layers, no checkpointing)" in err and "learner.micro_batch_tokens = 8192" in err
    assert main(["config", "check", "tiny", "model.path=someorg/not-cached", "--gpu-gib", "80"]) == 2
    assert "memory plan: skipped, model.path = 'someorg/not-cached' has no config.json" in capsys.readouterr().out


def test_a_hub_models_config_is_found_in_the_cache_and_never_downloaded(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--Qwen--Qwen2.5-7B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "snapshots" / "0123abcd" / "config.json").write_text((MODELS / "Qwen2.5-7B" / "config.json").read_text())
    cfg = load_config("scalerl", ["model.path=Qwen/Qwen2.5-7B"])
    assert find_model_config(cfg.model, cfg.task) == repo / "snapshots" / "0123abcd" / "config.json"
    missing = load_config("scalerl", ["model.path=Qwen/Qwen2.5-14B"])
    assert find_model_config(missing.model, missing.task) is None
    folder = load_config("scalerl", [f"model.path={MODELS / 'Qwen2.5-32B'}"])
    assert find_model_config(folder.model, folder.task) == MODELS / "Qwen2.5-32B" / "config.json"


def test_run_refuses_a_layout_its_gpus_cannot_hold(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 2048 * GiB)
    unsharded = load_config("scalerl", [f"model.path={MODELS / 'Qwen2.5-7B'}"])
    with pytest.raises(PlacementError, match="does not fit the learner GPU"):
        check_gpus(unsharded, ["0", "1"])
    assert check_gpus(unsharded, []) is None  # no GPU: nothing to plan
    sharded = load_config(
        "scalerl",
        [
            f"model.path={MODELS / 'Qwen2.5-7B'}",
            "learner.num_ranks=4",
            "learner.fsdp.enabled=true",
            "learner.fsdp.activation_checkpointing=true",
            "actor.vllm.max_model_len=16384",
        ],
    )
    assert check_gpus(sharded, ["0", "1", "2", "3", "4"]).budget("learner GPU").fits
