"""Two CPU ranks (torchrun, gloo) make the same update as one: DDP syncs the gradients and the
loss is normalised by counts over both ranks."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import CASES, learner_config, run_step
from tidal.ops.reachable import free_port

SCRIPT = Path(__file__).with_name("multirank_step.py")


# two torchrun processes plus a one-rank reference: 12-21 s on 2 busy cores
def test_two_ranks_make_the_same_update_as_one(tmp_path):
    from accelerate import Accelerator

    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(SCRIPT),
        str(tmp_path),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    accelerator = Accelerator(cpu=True)
    for name, case in CASES.items():
        expected, expected_metrics = run_step(learner_config(*case), accelerator)
        params = torch.load(tmp_path / f"{name}.pt")
        metrics = json.loads((tmp_path / f"{name}.json").read_text())
        assert metrics["world_size"] == 2
        for key, value in expected.items():
            torch.testing.assert_close(params[key], value, atol=1e-5, rtol=0, msg=f"{name}: {key}")
        # metrics are reduced over both ranks: the same as one rank's
        for key in (
            "learner/loss",
            "learner/entropy",
            "learner/num_tokens",
            "learner/advantage_std",
            "offpolicy/rho_mean",
            "offpolicy/rho_max",
            "offpolicy/clipped_frac",
            "offpolicy/lag_mean",
            "offpolicy/mismatch_kl",
            "learner/grad_norm",
        ):
            assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-5, abs=1e-6), f"{name}: {key}"
    for rank in (0, 1):
        assert "learner.groups_per_step" in (tmp_path / f"too_few_groups_rank{rank}.txt").read_text()


# a sharded learner on two "machines" (two `tidal learner` commands, run folders apart) with one vLLM
# actor whose engine receives every version by gloo through a group of its own with rank 0 (the GPU
# overlay's nccl path, on CPU): about a minute and a half on 2 cores
def test_a_sharded_learner_on_two_nodes_trains_with_only_its_shards_on_the_second_nodes_disk(tmp_path, tiny_model_path):
    root = Path(__file__).parents[2]
    run_dir, node1_dir = tmp_path / "node0-run", tmp_path / "node1-run"
    common = [
        "learner.num_ranks=2",
        "learner.nodes=2",
        "learner.master_addr=127.0.0.1",
        f"learner.master_port={free_port()}",
        "learner.fsdp.enabled=true",
        "learner.max_steps=8",
        "eval.every=0",
        "checkpoint.every=4",
        "weights.transport=gloo",
    ]  # as on Kubernetes: no shared folder
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tidal",
            "learner",
            str(root / "configs/tiny.yaml"),
            f"run_dir={node1_dir}",
            "learner.node_rank=1",
            *common,
        ],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tidal", "run", str(root / "configs/tiny.yaml"), f"run_dir={run_dir}", *common],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=600,
        )
        node1_log = node1.communicate(timeout=120)[0]
    finally:
        node1.kill()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert node1.returncode == 0 and "rank 1 of 2 follows rank 0" in node1_log, node1_log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8
    # both ranks saved every checkpoint together, the last after the final eval, each writing its own shards
    # to its own disk: the second node's run folder holds its rank's part of each and nothing else
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000004", "step-000008"]
    assert (run_dir / "model" / "config.json").is_file()
    part = [
        "MANIFEST-rank1.json",
        "model/shard-00002-model-00001-of-00001.safetensors",
        "optimizer/shard-00002-model-00001-of-00001.safetensors",
        "rng-rank1.safetensors",
    ]
    assert sorted(str(p.relative_to(node1_dir)) for p in node1_dir.rglob("*") if p.is_file()) == [
        f"checkpoints/step-{step:06d}/{name}" for step in (4, 8) for name in part
    ]
    # every version reached the actor's worker by broadcast from rank 0 (both ranks gathering each tensor in
    # turn, never the whole model), the first before it took work: the actor's logprobs match the learner's on
    # tokens of the current version
    actor_log = (run_dir / "logs" / "actor-0.log").read_text()
    assert "weights v8 loaded" in actor_log and "caught up to weights v" in actor_log
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fresh = [m["offpolicy/fresh_logprob_max_abs_diff"] for m in steps if "offpolicy/fresh_logprob_max_abs_diff" in m]
    assert fresh and max(fresh) < 1e-3, fresh


# three steps and a resume on two torchrun ranks, sharded and not, two cases: about a minute on 2 cores
def test_a_sharded_learner_makes_the_updates_of_one_rank_and_ranks_resume_exactly_from_their_own_disks(tmp_path):
    from accelerate import Accelerator
    from fsdp_steps import CASES, STEPS, checkpointer, train, trainer_for

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(SCRIPT.with_name("fsdp_steps.py")),
        str(tmp_path),
    ]
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    accelerator = Accelerator(cpu=True)
    for case in CASES:
        expected = train(trainer_for(case, accelerator, sharded=False), 0, STEPS)
        for tag in ("", "-ddp"):
            straight = torch.load(tmp_path / f"{case}{tag}.pt")
            resumed = torch.load(tmp_path / f"{case}{tag}-resumed.pt")
            assert straight.keys() == expected.keys()
            for key, value in expected.items():
                torch.testing.assert_close(straight[key], value, atol=1e-5, rtol=0, msg=f"{case}{tag}: {key}")
                assert torch.equal(resumed[key], straight[key]), f"{case}{tag}: {key} differs after a resume"
        # each rank wrote its own shards to its own disk, and nothing else: no rank gathered the model
        checkpoint = tmp_path / f"{case}-checkpoint" / "step-000001"
        rank1 = tmp_path / f"rank1-disk-{case}" / "step-000001"
        assert sorted(str(p.relative_to(rank1)) for p in rank1.rglob("*.safetensors")) == [
            "model/shard-00002-model-00001-of-00001.safetensors",
            "optimizer/shard-00002-model-00001-of-00001.safetensors",
            "rng-rank1.safetensors",
        ]
        assert not list(tmp_path.glob(f"rank1-disk-{case}-ddp/step-000001/*/shard-*"))  # DDP: rank 0 writes it all
        # the parts put together in one folder, one rank without FSDP continues from it
        shutil.copytree(rank1, checkpoint, dirs_exist_ok=True)
        unsharded = trainer_for(case, accelerator, sharded=False)
        checkpointer(unsharded, accelerator, checkpoint.parent).load(checkpoint)
        for key, value in train(unsharded, 1, STEPS).items():
            torch.testing.assert_close(value, expected[key], atol=1e-5, rtol=0, msg=f"{case}: {key} (unsharded resume)")


# two "machines" of two ranks (4 torchrun processes), replicated over them and sharded within (HSDP),
# each rank with a disk of its own: about 40 s on 2 cores
def test_a_learner_replicated_over_machines_resumes_exactly_with_the_second_machines_disks_holding_no_shards(tmp_path):
    from fsdp_steps import STEPS

    port, env = free_port(), os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                str(SCRIPT.with_name("fsdp_steps.py")),
                str(tmp_path),
                "--hsdp",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        logs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert all(node.returncode == 0 for node in nodes), "\n".join(log[-3000:] for log in logs)
    assert json.loads((tmp_path / "hsdp.json").read_text()) == {"mesh": [2, 2]}
    straight, resumed = torch.load(tmp_path / "hsdp.pt"), torch.load(tmp_path / "hsdp-resumed.pt")
    assert STEPS > 1 and all(torch.equal(resumed[k], v) for k, v in straight.items())
    # the first machine's ranks wrote the shards; the second machine's disks hold only their random states
    for rank in (2, 3):
        disk = tmp_path / f"rank{rank}-disk-hsdp" / "step-000001"
        assert sorted(str(p.relative_to(disk)) for p in disk.rglob("*") if p.is_file()) == [
            f"MANIFEST-rank{rank}.json",
            f"rng-rank{rank}.safetensors",
        ]


# a sharded learner's ranks never hold the whole model in host memory: about 20 s on 2 cores
def test_each_sharded_rank_builds_steps_and_checkpoints_within_a_few_times_its_shard(tmp_path):
    from memory_ranks import write_model

    model_bytes = write_model(tmp_path / "model")  # 50M parameters: 200 MB in fp32
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(SCRIPT.with_name("memory_ranks.py")),
        str(tmp_path / "model"),
        str(tmp_path),
    ]
    env = os.environ | {
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        m = json.loads((tmp_path / f"memory-rank{rank}.json").read_text())
        mb = {k: round(v / 1e6) for k, v in m.items() if k.endswith("_bytes")}
        print(
            f"\nrank {rank}: shard {mb['shard_bytes']} MB of a {model_bytes / 1e6:.0f} MB model; peak growth loading "
            f"it whole {mb['whole_load_peak_bytes']} MB, building {mb['build_peak_bytes']}, AdamW's state "
            f"{mb['state_peak_bytes']}, stepping "
            f"{mb['step_peak_bytes']}, checkpointing {mb['checkpoint_peak_bytes']}"
        )
        assert m["shard_bytes"] == model_bytes // 2
        assert m["whole_load_peak_bytes"] >= model_bytes  # what each rank held when it loaded the model whole
        assert m["build_peak_bytes"] < 0.6 * model_bytes  # its shard, never the model
        # zero gradients and AdamW's two moments, of its shard, and the temporaries of AdamW's first step
        assert m["state_peak_bytes"] < 4 * m["shard_bytes"]
        # an unsharded rank adds 3x the model (gradients and AdamW's two moments); a sharded one its share of
        # them, and the units it gathers
        assert m["step_peak_bytes"] < 3 * model_bytes
        # its own files, never the model gathered (the model and AdamW's state whole: 6x a shard of two ranks).
        # safetensors writes a file from memory, and its largest is AdamW's (2x the shard): 113-301 MB were
        # measured on 2 cores, as the state's temporaries happened to be freed before or after the write
        assert m["checkpoint_peak_bytes"] < 4 * m["shard_bytes"]


# a LoRA policy built on the meta device and loaded sharded from a model folder, as `tidal learner` builds
# one: about 10 s on 2 cores
def test_a_sharded_lora_policy_loads_its_base_by_the_models_names_and_starts_its_adapter_as_one_rank_would(tmp_path):
    from conftest import ALPHABET, TINY
    from tidal.tiny import build_tiny_model, save_model

    model, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    save_model(model, tokenizer, tmp_path / "model")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(SCRIPT.with_name("sharded_load.py")),
        str(tmp_path / "model"),
        str(tmp_path / "loaded.json"),
        "--lora",
    ]
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    loaded = json.loads((tmp_path / "loaded.json").read_text())
    # every base tensor as transformers loads it (an adapted layer's too, read as its base_layer), and the
    # adapter (A from the learner's seed, B zero) under PEFT's names, whole
    assert loaded["wrong"] == [] and loaded["adapter_tensors"] == 6  # A and B of q_proj, v_proj, down_proj
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in loaded["names"]
    assert "model.layers.1.mlp.down_proj.weight" in loaded["names"]
    assert not [name for name in loaded["names"] if "base_layer" in name or ".default." in name]
