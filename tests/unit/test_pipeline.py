"""The whole pipeline in one process, in seconds: the real coordinator, learner and actor loop over
the in-process broker (or ZeroMQ on loopback) and the file weight channel, with a scripted engine
in place of vLLM."""

import asyncio
import json
import threading
from collections import Counter
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import ALPHABET, ROOT, TINY, TINY_CHAT_TEMPLATE, ScriptedEngine
from tidal.actor.episode import Episodes
from tidal.actor.loop import Actor
from tidal.broker.inproc import InprocBroker
from tidal.broker.schema import WireCodec
from tidal.broker.weights import build_receiver
from tidal.broker.zmq_transport import ZmqActorTransport, ZmqLearnerTransport
from tidal.config import load_config, resolve
from tidal.learner.main import build, serve
from tidal.learner.rank0.flow import values as flow_values
from tidal.learner.tools.export import export_checkpoint
from tidal.tiny import build_tiny_model, save_model

MAX_STEPS, MAX_LAG = 4, 1


@pytest.fixture
def tiny_model(tmp_path):
    model, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    save_model(model, tokenizer, tmp_path / "model")
    return tmp_path / "model", tokenizer


@pytest.fixture
def unrendered_figures(monkeypatch):
    """The run's figures are made from its data at each checkpoint as ever, then closed instead of rendered to
    PNG (about half a second a checkpoint, the most of any one part of these short runs): for the tests about
    something else. The transport test renders them."""
    import matplotlib.pyplot as plt

    from tidal.learner.rank0 import diagnostics

    def unrendered(fig, path):
        plt.close(fig)
        path.write_bytes(b"")  # the folder still goes to MLflow as the run's figures
        return path

    monkeypatch.setattr(diagnostics, "_save", unrendered)


def transports(kind: str, cfg):
    """(learner side, a function making the actor side on the actor's loop) of one transport."""
    codec = WireCodec(cfg.broker.max_message_bytes)
    if kind == "inproc":
        broker = InprocBroker(codec)
        return broker.learner(), lambda: broker.actor(cfg.actor.id)
    learner_side = ZmqLearnerTransport(cfg.broker, codec)
    ports = learner_side.ports
    zmq_cfg = replace(
        cfg.broker.zmq, control_port=ports["control"], rollout_port=ports["rollout"], weights_port=ports["weights"]
    )
    actor_cfg = replace(cfg.broker, zmq=zmq_cfg)
    return learner_side, lambda: ZmqActorTransport(actor_cfg, WireCodec(cfg.broker.max_message_bytes), cfg.actor.id)


def start_actor(actor_side, cfg, engine: ScriptedEngine) -> tuple[threading.Thread, dict]:
    """The actor loop on its own event loop in a thread, as in its own process."""
    result = {}

    def main():
        episodes = Episodes.of(cfg.task, cfg.env, engine.tokenizer)
        actor = Actor(cfg.actor, engine, actor_side(), build_receiver(cfg.weights), episodes)
        result["reason"] = asyncio.run(actor.run())
        result["stats"] = actor.stats

    thread = threading.Thread(target=main, name="actor", daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize("kind", ["inproc", "zmq"])
def test_coordinator_actor_and_learner_train_through_a_transport(tmp_path, tiny_model, kind):
    model_path, tokenizer = tiny_model
    cfg = resolve(
        load_config(
            "configs/tiny.yaml",
            [
                f"run_dir={tmp_path / 'run'}",
                f"model.path={model_path}",
                f"learner.max_steps={MAX_STEPS}",
                "learner.groups_per_step=4",
                "sampling.n=4",
                f"staleness.max_lag={MAX_LAG}",
                "eval.every=2",
                "eval.n=2",
                "task.num_val=8",
                "actor.max_inflight=16",
                "actor.heartbeat_s=0.2",
            ],
        ),
        actor=True,
    )
    learner_side, actor_side = transports(kind, cfg)
    engine = ScriptedEngine(tokenizer, p_correct=0.5)
    learner = build(cfg, transport=learner_side)
    thread, actor = start_actor(actor_side, cfg, engine)

    assert serve(learner, tmp_path / "run") == 0
    thread.join(timeout=30)
    assert actor["reason"] == "learner finished"

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == MAX_STEPS
    assert set(summary["val_pass_rate_by_version"]) == {"0", "2", "4"}
    # every published version reached the engine through the weight channel, the last one exactly
    assert engine.swaps[-1] == MAX_STEPS and engine.swaps == sorted(engine.swaps)
    final = learner.trainer.policy.state_dict()
    assert set(engine.loaded) == set(final)
    assert all(torch.equal(engine.loaded[name], final[name].cpu()) for name in final)
    # the ledger: every trained group was released once and trained once
    events = [json.loads(line) for line in (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()]
    released = [i for e in events if e["event"] == "released" for i in e["ids"]]
    trained = [i for e in events if e["event"] == "trained" for i in e["ids"]]
    assert len(released) == len(set(released)) and set(trained) <= set(released)
    assert max(Counter(trained).values()) == 1 and len(trained) == MAX_STEPS * 4
    steps = [
        m for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "learner/loss" in m
    ]
    assert [m["step"] for m in steps] == list(range(1, MAX_STEPS + 1))
    assert all(m["offpolicy/lag_max"] <= MAX_LAG for m in steps)
    assert actor["stats"]["groups"] >= len(trained)
    # where time and tokens went, as the step logged them and as Prometheus would be served them
    assert all(0 <= m["flow/learner_wait_share"] <= 1 for m in steps)
    assert all(0 <= m["flow/sample_age_s_mean"] <= m["flow/sample_age_s_max"] for m in steps)
    served = flow_values(learner.flow, learner.accounting.totals, learner.version)
    assert served["tidal_learner_version"] == MAX_STEPS
    assert served["tidal_learner_trained_tokens_total"] == sum(m["learner/num_tokens"] for m in steps) > 0
    assert served["tidal_learner_generated_tokens_total"] >= served["tidal_learner_trained_tokens_total"]
    assert served["tidal_learner_rollout_wait_seconds_total"] > 0 and served["tidal_learner_train_seconds_total"] > 0
    # the final policy as a Hugging Face folder, and any checkpoint the same way
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert all(torch.equal(exported.state_dict()[name], final[name].cpu()) for name in final)
    again = export_checkpoint(tmp_path / "run", MAX_STEPS, tmp_path / "again")
    assert (again / "tokenizer.json").is_file() and (again / "model.safetensors").is_file()
    assert all(
        torch.equal(v, final[k].cpu()) for k, v in AutoModelForCausalLM.from_pretrained(again).state_dict().items()
    )


def test_a_lora_run_trains_the_adapter_and_every_version_reaches_the_actor_as_the_adapter_alone(tmp_path, tiny_model):
    """learner.lora end to end in process: each push is the adapter alone (PEFT's names), which the
    worker keeps for the engine's LoRA instead of loading into its model; the last one equals the
    learner's adapter; the run ends with the merged model and the adapter beside it."""
    from tidal.learner.every_rank import lora

    model_path, tokenizer = tiny_model
    cfg = resolve(
        load_config(
            "configs/tiny-lora.yaml",
            [
                f"run_dir={tmp_path / 'run'}",
                f"model.path={model_path}",
                f"learner.max_steps={MAX_STEPS}",
                "learner.groups_per_step=4",
                "sampling.n=4",
                f"staleness.max_lag={MAX_LAG}",
                "eval.every=2",
                "eval.n=2",
                "task.num_val=8",
                "actor.max_inflight=16",
                "actor.heartbeat_s=0.2",
                "learner.lora.rank=4",
            ],
        ),
        actor=True,
    )
    learner_side, actor_side = transports("inproc", cfg)
    engine = ScriptedEngine(tokenizer, p_correct=0.5, adapter=True)
    learner = build(cfg, transport=learner_side)
    thread, actor = start_actor(actor_side, cfg, engine)

    assert serve(learner, tmp_path / "run") == 0
    thread.join(timeout=30)
    assert actor["reason"] == "learner finished" and engine.swaps[-1] == MAX_STEPS and engine.loaded == {}
    spec, tensors, version = engine.worker.stash.current
    assert (spec.rank, version) == (4, MAX_STEPS)
    mine = {lora.peft_name(name): p for name, p in lora.adapter_parameters(learner.trainer.policy)}
    assert tensors.keys() == mine.keys() and all(torch.equal(tensors[k], v.detach()) for k, v in mine.items())
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


USER_TASK = '''
"""A user's own task, outside tidal: chat prompts from a JSON Lines file, a reward that logs what it saw."""
from pathlib import Path

from tidal.tasks import Prompt, Split
from tidal.tasks.data import load_rows


def load_prompts(cfg):
    rows = load_rows(cfg.data_path, "task.data_path", cfg.prompt_field, cfg.answer_field)
    prompts = [Prompt(i, "", {"answer": r[cfg.answer_field]}, messages=tuple(r[cfg.prompt_field]))
               for i, r in enumerate(rows)]
    return Split(train=prompts[cfg.num_val:], val=prompts[:cfg.num_val])


def build_reward(cfg):
    log = Path(cfg.kwargs["log"])

    def reward(text, payload):
        with log.open("a") as f:
            f.write(f"{text} {payload['answer']}\\n")
        return 1.0 if text == payload["answer"] else 0.0
    return reward
'''


def test_a_users_task_from_outside_the_package_with_chat_prompts(tmp_path, monkeypatch, unrendered_figures):
    """task.name is an import path; its prompts are chat messages rendered by the tokenizer's chat
    template; its reward is built from task.kwargs. The actor only ever sees the learner's tokens."""
    (tmp_path / "user_tasks").mkdir()
    (tmp_path / "user_tasks" / "sums.py").write_text(USER_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [
        {"messages": [{"role": "user", "content": f"{a:02d}+{b:02d}"}], "answer": f"{a + b:03d}"}
        for a in range(10, 20)
        for b in range(30, 34)
    ]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    save_model(model, tokenizer, tmp_path / "model")
    cfg = resolve(
        load_config(
            "configs/tiny.yaml",
            [
                f"run_dir={tmp_path / 'run'}",
                f"model.path={tmp_path / 'model'}",
                "learner.max_steps=2",
                "learner.groups_per_step=4",
                "sampling.n=4",
                "eval.every=0",
                "eval.n=2",
                "actor.heartbeat_s=0.2",
                "task.name=user_tasks.sums",
                f"task.data_path={tmp_path / 'sums.jsonl'}",
                "task.prompt_field=messages",
                "task.num_val=4",
                f"task.kwargs.log={tmp_path / 'rewards.log'}",
            ],
        ),
        actor=True,
    )
    learner_side, actor_side = transports("inproc", cfg)
    learner = build(cfg, transport=learner_side)
    thread, actor = start_actor(actor_side, cfg, ScriptedEngine(tokenizer, p_correct=0.5))
    assert serve(learner, tmp_path / "run") == 0
    thread.join(timeout=30)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["val_pass_rate_final"] is not None
    seen = [line.split() for line in (tmp_path / "rewards.log").read_text().splitlines()]
    assert len(seen) >= 2 * 4 * 4 and all(len(answer) == 3 for _, answer in seen)  # the user's answers, scored


def readme_task(name: str = "countdown") -> str:
    """A custom task the README shows, exactly as printed there."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"```python\n# my_tasks/{name}.py")
    return text[start + len("```python\n") : text.index("```", start + 10)]


def test_the_readme_reward_trains_end_to_end(tmp_path, tiny_model, monkeypatch, unrendered_figures):
    model_path, tokenizer = tiny_model
    (tmp_path / "my_tasks").mkdir()
    (tmp_path / "my_tasks" / "countdown.py").write_text(readme_task())
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"problem": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"} for a in range(20, 30) for b in range(5)]
    (tmp_path / "cd.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = resolve(
        load_config(
            "configs/tiny.yaml",
            [
                f"run_dir={tmp_path / 'run'}",
                f"model.path={model_path}",
                "learner.max_steps=2",
                "learner.groups_per_step=4",
                "sampling.n=4",
                "eval.every=0",
                "eval.n=2",
                "actor.heartbeat_s=0.2",
                "task.name=my_tasks.countdown",
                f"task.data_path={tmp_path / 'cd.jsonl'}",
                "task.num_val=4",
                "task.kwargs.partial_credit=0.25",
            ],
        ),
        actor=True,
    )
    learner_side, actor_side = transports("inproc", cfg)
    learner = build(cfg, transport=learner_side)
    thread, actor = start_actor(actor_side, cfg, ScriptedEngine(tokenizer, p_correct=0.5))
    assert serve(learner, tmp_path / "run") == 0
    thread.join(timeout=30)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = {m["rollout/reward"] for m in steps if "rollout/reward" in m}
    assert len(rewards) == 2 and all(0.25 < r < 1.0 for r in rewards)  # passes score 1, misses the partial credit


def test_the_readme_environment_trains_end_to_end(tmp_path, tiny_model, monkeypatch, unrendered_figures):
    """Two turns for a wrong first answer: the second turn's prompt carries the first answer and the
    environment's "=", which the learner receives as injected tokens."""
    model_path, tokenizer = tiny_model
    (tmp_path / "my_tasks").mkdir()
    (tmp_path / "my_tasks" / "retry.py").write_text(readme_task("retry"))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = resolve(
        load_config(
            "configs/tiny.yaml",
            [
                f"run_dir={tmp_path / 'run'}",
                f"model.path={model_path}",
                "learner.max_steps=2",
                "learner.groups_per_step=4",
                "sampling.n=4",
                "sampling.max_tokens=12",
                "eval.every=0",
                "eval.n=2",
                "actor.heartbeat_s=0.2",
                "task.name=my_tasks.retry",
                "task.num_val=4",
            ],
        ),
        actor=True,
    )
    learner_side, actor_side = transports("zmq", cfg)  # episodes cross the wire
    learner = build(cfg, transport=learner_side)
    thread, actor = start_actor(actor_side, cfg, ScriptedEngine(tokenizer, p_correct=0.5))
    assert serve(learner, tmp_path / "run") == 0
    thread.join(timeout=30)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "episode/turns_mean" in m]
    assert len(trained) == 2
    assert all(1.0 < m["episode/turns_mean"] < 2.0 and m["rollout/injected_token_frac"] > 0 for m in trained)


def damaged_trainer_meta(checkpoint) -> None:
    """trainer.json rewritten to a list, its manifest entry with it: only its contents tell."""
    from tidal.files import sha256_file

    (checkpoint / "trainer.json").write_text("[]")
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    manifest["trainer.json"] = [2, sha256_file(checkpoint / "trainer.json")]
    (checkpoint / "MANIFEST.json").write_text(json.dumps(manifest))


def test_a_learner_resumes_past_a_damaged_checkpoint_and_refuses_when_none_verifies(
    tmp_path, tiny_model, monkeypatch, capsys, unrendered_figures
):
    from tidal.learner import main as learner_main

    model_path, tokenizer = tiny_model
    run_dir = tmp_path / "run"
    cfg = resolve(
        load_config(
            "configs/tiny.yaml",
            [
                f"run_dir={run_dir}",
                f"model.path={model_path}",
                "learner.max_steps=2",
                "learner.groups_per_step=4",
                "sampling.n=4",
                "eval.every=0",
                "eval.n=2",
                "task.num_val=4",
                "actor.heartbeat_s=0.2",
                "checkpoint.every=1",
                "checkpoint.keep=3",
            ],
        ),
        actor=True,
    )
    learner_side, actor_side = transports("inproc", cfg)
    learner = build(cfg, transport=learner_side)
    thread, _ = start_actor(actor_side, cfg, ScriptedEngine(tokenizer, p_correct=0.5))
    assert serve(learner, run_dir) == 0
    thread.join(timeout=30)
    checkpoints = run_dir / "checkpoints"

    damaged_trainer_meta(checkpoints / "step-000002")
    resumed = build(cfg, learner_main.find_checkpoint(run_dir, "auto"), transport=transports("inproc", cfg)[0])
    assert resumed.version == 1  # from step 1, the damaged step 2 named in one warning
    for close in (resumed.transport.close, resumed.book.ledger.close, resumed.parts.publisher.close):
        close()

    (checkpoints / "step-000001" / "MANIFEST.json").write_text("[]")
    kept = {p: p.read_bytes() for p in [run_dir / "ledger.jsonl", *checkpoints.rglob("*")] if p.is_file()}
    monkeypatch.setattr(learner_main.signal, "signal", lambda *args: None)
    monkeypatch.setattr(learner_main, "serve", lambda *args: pytest.fail("a learner started over damaged checkpoints"))
    assert learner_main.main(cfg, resume="auto") == 2
    err = capsys.readouterr().err
    assert "step-000001/MANIFEST.json" in err and "step-000002/trainer.json" in err and "--resume fresh" in err
    assert {p: p.read_bytes() for p in kept} == kept  # the ledger and the checkpoints as they were


def test_the_learner_logs_a_progress_line_every_n_steps(tmp_path, tiny_model, caplog, unrendered_figures):
    """`kubectl logs -f` on the learner shows training: one line every tracking.log_every_steps steps."""
    import logging

    import mlflow

    mlflow.end_run()  # one an earlier test's resumed learner left open (it never finished) would refuse this run
    caplog.set_level(logging.INFO, logger="tidal.learner.progress")
    model_path, tokenizer = tiny_model
    cfg = resolve(
        load_config(
            "configs/tiny.yaml",
            [
                f"run_dir={tmp_path / 'run'}",
                f"model.path={model_path}",
                "learner.max_steps=4",
                "learner.groups_per_step=4",
                "sampling.n=4",
                "eval.every=0",
                "eval.n=2",
                "task.num_val=4",
                "actor.heartbeat_s=0.2",
                "tracking.log_every_steps=2",
            ],
        ),
        actor=True,
    )
    learner_side, actor_side = transports("inproc", cfg)
    learner = build(cfg, transport=learner_side)
    thread, _ = start_actor(actor_side, cfg, ScriptedEngine(tokenizer, p_correct=0.5))
    assert serve(learner, tmp_path / "run") == 0
    thread.join(timeout=30)
    lines = [r.getMessage() for r in caplog.records if r.name == "tidal.learner.progress"]
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in steps] == ["step 2/4", "step 4/4"]
    fields = [part.split()[0] for part in steps[-1].split(" | ")]
    assert fields[:6] == ["step", "reward", "pass", "loss", "lag", "gen"] and len(fields) == 7
    assert "n/a" not in steps[-1] and steps[-1].endswith(" s/step")  # rates measured over the steps so far
    assert all(line.startswith("waiting for actors: ") for line in lines if line not in steps)
