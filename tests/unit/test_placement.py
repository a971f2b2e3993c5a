"""`tidal run` places each process: its GPUs through CUDA_VISIBLE_DEVICES, or CPU cores; a plan the
machine cannot hold is refused in one line. Engine settings reach vLLM's arguments."""

import re

import pytest

from conftest import ROOT
from tidal.actor.engine import engine_args
from tidal.config import ConfigError, load_config
from tidal.ops.cli import main
from tidal.ops.placement import PlacementError, Slot, place


def cfg(*overrides):
    return load_config(ROOT / "configs/tiny.yaml", list(overrides))


def test_gpus_go_to_the_learner_first_then_each_actor():
    c = cfg("actor.replicas=2", "actor.vllm.tensor_parallel_size=2")
    plan = place(c.learner, c.actor, ["0", "1", "2", "3", "4", "5"], cores=[0, 1])
    assert plan.learner == Slot(gpus=("0",))
    assert [a.gpus for a in plan.actors] == [("1", "2"), ("3", "4")]
    assert plan.actors[1].env() == {"CUDA_VISIBLE_DEVICES": "3,4"}


def test_learner_ranks_get_a_gpu_each_and_uuids_pass_through():
    c = cfg("learner.num_ranks=2", "actor.replicas=1")
    plan = place(c.learner, c.actor, ["GPU-a", "GPU-b", "GPU-c"], cores=[0])
    assert (plan.learner.gpus, plan.actors[0].gpus) == (("GPU-a", "GPU-b"), ("GPU-c",))


def test_a_cpu_machine_pins_cores_and_leaves_cuda_alone():
    c = cfg("actor.replicas=3")
    plan = place(c.learner, c.actor, [], cores=[0, 1, 2])
    assert plan.learner == Slot(cores="0") and [a.cores for a in plan.actors] == ["1", "2", "1"]
    assert all(a.env() == {} for a in plan.actors)


@pytest.mark.parametrize(
    "overrides, gpus, says",
    [
        (["actor.replicas=2"], ["0", "1"], "needs 3 GPUs (learner 1 + 2 actor(s) x 1) but 2 are visible"),
        (["actor.vllm.tensor_parallel_size=4"], ["0", "1", "2", "3"], "needs 5 GPUs"),
        (["actor.gpus_per_replica=1"], [], "actor.gpus_per_replica = 1 but this machine has no visible GPU"),
    ],
)
def test_an_impossible_plan_is_refused(overrides, gpus, says):
    c = cfg(*overrides)
    with pytest.raises(PlacementError, match=re.escape(says)):
        place(c.learner, c.actor, gpus, cores=[0, 1])


def test_tidal_run_refuses_it_in_one_line_before_starting_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert main(["run", str(ROOT / "configs/tiny.yaml"), f"run_dir={tmp_path / 'run'}", "actor.replicas=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs 3 GPUs" in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["learner.gpus=3"], "learner.gpus"),
        (["actor.gpus_per_replica=1", "actor.vllm.tensor_parallel_size=2"], "actor.gpus_per_replica"),
        (["actor.vllm.gpu_memory_utilization=1.5"], "actor.vllm.gpu_memory_utilization"),
        (["actor.vllm.engine_kwargs.enable_prefix_caching=true"], "actor.vllm.engine_kwargs"),
    ],
)
def test_bad_device_keys_are_named(overrides, key):
    with pytest.raises(ConfigError, match=key):
        cfg(*overrides)


def test_engine_settings_reach_vllm_and_tidal_keeps_its_own():
    c = cfg(
        "actor.vllm.gpu_memory_utilization=0.5",
        "actor.vllm.tensor_parallel_size=2",
        "actor.vllm.max_model_len=4096",
        "actor.vllm.engine_kwargs.enable_chunked_prefill=true",
        "actor.index=2",
    )
    args = engine_args(c.actor, "/m", "bfloat16")
    keys = ("gpu_memory_utilization", "tensor_parallel_size", "max_model_len", "enable_chunked_prefill")
    assert [args[k] for k in keys] == [0.5, 2, 4096, True]
    assert (args["seed"], args["enable_prefix_caching"], args["logprobs_mode"]) == (2, True, "processed_logprobs")
    assert "max_model_len" not in engine_args(cfg().actor, "/m", "float32")  # 0: the model's own


def test_colocated_actors_share_the_learners_gpu():
    c = cfg("actor.replicas=2", "actor.colocate=true")
    plan = place(c.learner, c.actor, ["0"], cores=[0, 1])
    assert plan.learner.gpus == ("0",) and [a.gpus for a in plan.actors] == [("0",), ("0",)]


def test_colocated_actors_start_once_the_learner_is_ready_and_a_learner_gone_first_is_named(tmp_path, monkeypatch):
    """Engines measure the GPU's free memory as they start: actors sharing the learner's GPUs start
    once it has written endpoints.json (after its model and optimizer state are in memory)."""
    import subprocess
    import threading

    from tidal.config import resolve
    from tidal.ops import launcher

    c = resolve(cfg("actor.replicas=2", "actor.colocate=true", "weights.transport=tcp", f"run_dir={tmp_path}"))
    started = []

    def spawn(name, role, args, run_dir, slot, restarts=0):
        started.append((name, (run_dir / "endpoints.json").exists()))
        proc = subprocess.Popen(["sleep", "30"] if role == "learner" else ["true"])
        return launcher.Child(name, role, proc, run_dir / "logs" / f"{name}.log", args, slot)

    monkeypatch.setattr(launcher, "_spawn", spawn)
    threading.Timer(0.5, lambda: (tmp_path / "endpoints.json").write_text("{}")).start()
    children = []
    try:
        launcher.start_children(c, place(c.learner, c.actor, ["0"], cores=[0, 1]), children)
    finally:
        launcher.stop_children(children, grace_s=1)
    assert started == [("learner", False), ("actor-0", True), ("actor-1", True)]
    (tmp_path / "logs" / "learner.log").write_text("CUDA out of memory\n")
    learner = launcher.Child("learner", "learner", subprocess.Popen(["false"]), tmp_path / "logs" / "learner.log")
    learner.proc.wait()
    with pytest.raises(launcher.LaunchError, match="(?s)the learner exited with code 1 before it was ready.*CUDA out"):
        launcher.wait_for_learner(learner, tmp_path / "nowhere")


def test_a_pinned_cpu_engine_runs_its_model_in_the_engine_core_process_bound_to_its_cores():
    from tidal.actor.engine import cpu_engine_env

    assert cpu_engine_env(cfg("actor.cpu_cores=1").actor) == {
        "OMP_NUM_THREADS": "1",
        "OMP_PLACES": "{1}",
        "OMP_PROC_BIND": "close",
    }
    env = cpu_engine_env(cfg("actor.cpu_cores=0-1,3").actor)
    assert (env["OMP_NUM_THREADS"], env["OMP_PLACES"]) == ("3", "{0},{1},{3}")
    # left to vLLM: no cores given, or parallelism / an executor the user chose
    for overrides in (
        [],
        ["actor.cpu_cores=1", "actor.vllm.tensor_parallel_size=2"],
        ["actor.cpu_cores=1", "actor.vllm.engine_kwargs.distributed_executor_backend=mp"],
    ):
        assert cpu_engine_env(cfg(*overrides).actor) == {}


@pytest.mark.parametrize("cores", ["1-", "a", "0, 1", "1;2"])
def test_a_bad_core_list_is_named(cores):
    with pytest.raises(ConfigError, match="actor.cpu_cores"):
        cfg(f"actor.cpu_cores={cores}")
