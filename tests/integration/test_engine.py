"""The real vLLM engine, shared by the tests here: started once, on a checkpoint of the tiny model
exported by `tidal export`. What it serves must be the model the learner trained, token by token,
and what the learner publishes over the tcp weight channel must reach it exactly, in flight.

    cached tiny model ─► one training step ─► checkpoint ─► tidal export ─► vLLM engine (one, shared)
    learner's policy (perturbed) ─► TcpPublisher ─► TcpReceiver ─► vLLM weight-transfer API ─► engine

    learner's policy (perturbed) ─► CollectivePublisher ─► gloo group: broadcast into the engine's worker ─► engine

The weight-channel tests come last and put the exported weights back (as version 0) when they are done.
"""

import asyncio

import msgspec
import numpy as np
import pytest

from conftest import ROOT, DyingWeightServer, engine_on_a_thread, learner_logprobs, on_engine, perturbed, step_batch
from tidal.actor.episode import Episodes
from tidal.actor.length_control import generate
from tidal.actor.sample import to_sample
from tidal.broker.schema import InterruptParams, PromptGroup, RolloutGroup, SamplingParams, int32s
from tidal.config import EnvConfig, load_config, resolve
from tidal.tasks import Env, Turn


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_path):
    """(the exported folder, the checkpoint's policy as the learner holds it)."""
    from accelerate import Accelerator

    from tidal.config import write_config
    from tidal.learner.every_rank.checkpoint import Checkpointer
    from tidal.learner.every_rank.trainer import Trainer, load_policy
    from tidal.learner.tools.export import export_checkpoint, load_checkpoint_policy

    run_dir = tmp_path_factory.mktemp("export") / "run"
    cfg = resolve(
        load_config(
            ROOT / "configs/tiny.yaml", [f"model.path={tiny_model_path}", f"run_dir={run_dir}", "learner.optim.lr=0.01"]
        )
    )
    write_config(cfg, run_dir)
    accelerator = Accelerator(cpu=True)
    trainer = Trainer(cfg.learner, load_policy(cfg.model.path, "float32"), accelerator, temperature=1.0)
    groups, masks = step_batch(4)
    trainer.step(groups, masks, version=2)  # the checkpoint differs from the model it started from
    Checkpointer(cfg.checkpoint, run_dir / "checkpoints", accelerator, trainer).save(1, {})
    folder = export_checkpoint(run_dir, 1, run_dir / "exported")
    return folder, load_checkpoint_policy(run_dir / "checkpoints" / "step-000001", cfg.model.path)


@pytest.fixture(scope="module")
def engine(exported):
    """One engine on its own event loop thread; tests hand it coroutines through `on_engine`. The demo's
    plain CPU linear layers: updates are copied in place (the packed layout's layer-wise reload runs in
    test_moe and in test_run's synchronous run). Blocks of 32 tokens, not the CPU backend's 128: the
    tiny model's 64-token context holds a whole one, so prefixes are cached."""
    yield from engine_on_a_thread(str(exported[0]), "actor.vllm.engine_kwargs.block_size=32")


def tokenize(folder, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))(text, add_special_tokens=False)["input_ids"]


def test_an_exported_checkpoint_serves_in_vllm_with_the_learners_logprobs(exported, engine):
    folder, policy = exported
    prompt = tokenize(folder, "37+48=")
    sampling = SamplingParams(1.0, 1.0, 6, ())  # no stop token: every sample runs 6 tokens
    completions = on_engine(engine, engine.sample(prompt, 16, sampling, request_id="export-check"))
    worst = max(float(np.abs(c.logprobs - learner_logprobs(policy, prompt, c.tokens)).max()) for c in completions)
    print(f"\nexported model in vLLM vs the learner: max |logprob difference| {worst:.2e} over 96 tokens")
    assert worst <= 1e-4


def _on_policy_step(folder, policy, engine, served: SamplingParams, learner_sampler) -> dict:
    """One learner step on two groups the engine sampled with `served`, at the learner's own version (lag 0,
    the same weights): the step's metrics, its learner scoring with `learner_sampler`."""
    import copy

    from accelerate import Accelerator

    from tidal.learner.every_rank.trainer import Trainer

    rollouts = []
    for i, text in enumerate(("37+48=", "5+61=")):
        prompt = tokenize(folder, text)
        completions = on_engine(engine, engine.sample(prompt, 16, served, request_id=f"nucleus-{served.top_p}-{i}"))
        samples = [to_sample(c, float(j % 2), served) for j, c in enumerate(completions)]
        rollouts.append(
            RolloutGroup.pack(samples, group_id=f"g{i}", prompt_id=i, actor_id="a", prompt_tokens=int32s(prompt))
        )
    cfg = load_config(ROOT / "configs/tiny.yaml", ["learner.groups_per_step=2", "learner.kernel_backend=torch"])
    trainer = Trainer(cfg.learner, copy.deepcopy(policy), Accelerator(cpu=True), temperature=learner_sampler)
    masks = [[np.ones(s.num_tokens, dtype=bool) for s in g.samples] for g in rollouts]
    return trainer.step(rollouts, masks, version=0)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.7), (3, 1.0), (4, 0.8)])
def test_under_top_k_and_top_p_an_on_policy_step_reads_ratio_one(exported, engine, top_k, top_p):
    """The engine reports each token's probability under the truncated, renormalised sampler; the learner
    scores the same sampler from its own logits, so at lag 0 the ratio is 1 (as at top_p = 1), where the
    whole-vocabulary learner reads the kept mass instead."""
    from tidal.learner.every_rank.trainer import Sampler

    folder, policy = exported
    served = SamplingParams(0.9, top_p, 6, (), top_k=top_k)
    exact = _on_policy_step(folder, policy, engine, served, Sampler(0.9, top_k, top_p))
    whole = _on_policy_step(folder, policy, engine, served, Sampler(0.9))
    print(
        f"\ntop_k {top_k} top_p {top_p}: rho_mean {exact['offpolicy/rho_mean']:.6f}, fresh max |diff| "
        f"{exact['offpolicy/fresh_logprob_max_abs_diff']:.2e} (whole vocabulary: rho_mean "
        f"{whole['offpolicy/rho_mean']:.3f}, {whole['offpolicy/fresh_logprob_max_abs_diff']:.3f})"
    )
    assert exact["offpolicy/fresh_tokens"] == exact["learner/num_tokens"] > 100
    assert exact["offpolicy/fresh_logprob_max_abs_diff"] <= 1e-4
    assert exact["offpolicy/rho_mean"] == pytest.approx(1.0, abs=1e-4)
    assert exact["offpolicy/outside_support_frac"] == 0.0
    assert abs(exact["offpolicy/fresh_ratio"] - 1.0) <= 1e-5
    assert whole["offpolicy/fresh_logprob_max_abs_diff"] > 1e-2 and whole["offpolicy/rho_mean"] < 0.99


def test_interruptions_on_the_real_engine_line_up_with_the_model(exported, engine):
    """Interrupted samples are spliced so that the learner's forward pass over prompt + completion
    reproduces every generated token's behavior logprob."""
    folder, policy = exported
    prompt = tokenize(folder, "12+34=")
    eos = policy.config.eos_token_id
    interrupt = InterruptParams(tuple(tokenize(folder, "==")), "==", 1, 2, 3)
    sampling = SamplingParams(1.0, 1.0, 7, (eos,), interrupt)
    group = PromptGroup(
        run_id="r",
        group_id="r-int",
        prompt_id=0,
        prompt_tokens=int32s(prompt),
        task="arithmetic",
        payload={"answer": "46"},
        n=8,
        sampling=sampling,
        min_version=0,
    )
    completions = on_engine(engine, generate(engine, group))

    assert sum(bool(c.injected_spans) for c in completions) >= 1  # budgets of 1-2 tokens cut "46<eos>" short
    rollout = RolloutGroup.pack(
        [to_sample(c, 0.0, sampling) for c in completions],
        group_id="r-int",
        prompt_id=0,
        actor_id="a",
        prompt_tokens=int32s(prompt),
    )
    rollout.check()
    for s, tokens, logprobs in rollout.unpack():
        mine = learner_logprobs(policy, prompt, tokens)
        generated = ~s.injected_mask()
        np.testing.assert_allclose(logprobs[generated], mine[generated], atol=1e-4)
        assert np.all(logprobs[~generated] == 0.0)
        assert s.version_spans == [(0, 0, s.num_tokens)]


class AskAgain(Env):
    """Every answer is met with "==": the model answers again, up to three turns."""

    max_turns = 3

    def step(self, state, reply):
        return Turn([{"role": "user", "content": "=="}])


def test_episodes_on_the_real_engine_line_up_with_the_model(exported, engine):
    """Later turns go to vLLM as token ids (the prompt and every token so far): the learner's forward
    pass over prompt + episode reproduces every behaviour logprob the engine recorded, in every turn,
    and the environment's tokens sit where the injected spans say."""
    folder, policy = exported
    prompt = tokenize(folder, "12+34=")
    again = tokenize(folder, "==")
    sampling = SamplingParams(1.0, 1.0, 24, (policy.config.eos_token_id,))
    group = PromptGroup(
        run_id="r",
        group_id="r-episodes",
        prompt_id=0,
        prompt_tokens=int32s(prompt),
        task="arithmetic",
        payload={"answer": "046"},
        n=4,
        sampling=sampling,
        min_version=0,
    )
    episodes = Episodes(AskAgain(), EnvConfig(), engine.tokenizer, chat_template=False)
    results = on_engine(engine, episodes.run(engine, group))

    assert max(r.episode.turns for r in results) == 3
    for r in results:
        c = r.completion
        assert len(c.injected_spans) == r.episode.turns - 1
        generated = np.ones(len(c.tokens), bool)
        for start, end in c.injected_spans:
            assert c.tokens[start:end].tolist() == again
            generated[start:end] = False
        mine = learner_logprobs(policy, prompt, c.tokens)
        np.testing.assert_allclose(c.logprobs[generated], mine[generated], atol=1e-4)
        assert c.version_spans == [(0, 0, len(c.tokens))]


# ---- the network weight channels, through vLLM's weight-transfer API ---------------------------


def channel(transport="tcp", **keys):
    from tidal.broker.weights import build_publisher, build_receiver
    from tidal.config import WeightsConfig

    cfg = WeightsConfig(transport=transport, bucket_mib=1, **{"tcp_timeout_s": 10.0, **keys})
    return build_publisher(cfg, "inc", "run", "/unused"), build_receiver(cfg)


async def update_in_flight(engine, prompt: list[int], receiver, update, after_tokens: int):
    """One long request; once it holds `after_tokens` tokens the update is applied while it runs.
    Returns (the request's last output, seconds the engine was paused)."""
    from vllm import SamplingParams as VllmSamplingParams

    params = VllmSamplingParams(max_tokens=64 - len(prompt), ignore_eos=True, logprobs=0)
    swap, last = None, None
    request_id = f"in-flight-v{update.version}"
    async for out in engine._llm.generate({"prompt_token_ids": prompt}, params, request_id=request_id):
        last = out.outputs[0]
        if swap is None and len(last.token_ids) >= after_tokens:
            swap = asyncio.ensure_future(receiver.apply(update, engine))
    return last, await swap


def assert_serves(engine, folder, policy, version: int, request_id: str) -> float:
    """The engine's logprobs are `policy`'s, labelled `version`; returns the worst difference."""
    prompt = tokenize(folder, "37+48=")
    completions = on_engine(engine, engine.sample(prompt, 16, SamplingParams(1.0, 1.0, 6, ()), request_id=request_id))
    assert all(c.version_spans == [(version, 0, len(c.tokens))] for c in completions)
    worst = max(float(np.abs(c.logprobs - learner_logprobs(policy, prompt, c.tokens)).max()) for c in completions)
    assert worst <= 1e-4
    return worst


def test_a_version_published_over_tcp_reaches_the_engine_exactly_while_a_request_runs(exported, engine):
    import time

    folder, policy = exported
    assert on_engine(engine, engine.weight_layout()) == "copy"  # the preset's actor.vllm.cpu_linear=plain took effect
    new_policy = perturbed(policy, seed=7)
    publisher, receiver = channel()
    try:
        start = time.perf_counter()
        update = publisher.publish(new_policy.state_dict(), version=7)
        push_s = time.perf_counter() - start
        assert "lm_head.weight" in {s.name for s in update.manifest} and len(update.buckets) > 1
        out, paused_s = on_engine(engine, update_in_flight(engine, tokenize(folder, "12+34="), receiver, update, 8))
    finally:
        publisher.close()
    spans = [(int(s.version), s.start, s.end) for s in out.weight_versions]
    print(
        f"\ntcp v7 ({tcp_payload_mib(update):.1f} MiB, {len(update.buckets)} buckets): learner push {push_s:.4f} s, "
        f"engine paused {paused_s:.4f} s; in-flight request spans {spans}"
    )
    assert len(spans) == 2 and spans[0][:2] == (0, 0) and spans[1][0] == 7 and 8 <= spans[1][1] < spans[1][2] == 58
    assert engine.version == 7
    assert_serves(engine, folder, new_policy, 7, "tcp-after")


@pytest.mark.parametrize("prefetch", [True, False])
def test_versions_sent_as_deltas_serve_the_learners_logprobs(exported, engine, prefetch):
    """weights.delta: after a whole version, the next travels as what changed (a word in 97 of each
    tensor, as under a small learning rate); the engine serves the new policy exactly."""
    import copy

    import torch

    folder, policy = exported
    nudged = copy.deepcopy(policy)
    with torch.no_grad():
        for param in nudged.parameters():
            param.view(-1)[::97] += 0.01
    publisher, receiver = channel(tcp_prefetch=prefetch, delta=True)
    try:
        on_engine(engine, receiver.apply(publisher.publish(policy.state_dict(), version=20), engine))
        whole = publisher.server.sent["whole"]
        on_engine(engine, receiver.apply(publisher.publish(nudged.state_dict(), version=21), engine))
        sent = dict(publisher.server.sent)
        assert sent["whole"] == whole and 0 < sent["delta"] < 0.1 * whole
        assert engine.version == 21
        assert_serves(engine, folder, nudged, 21, f"tcp-delta-{prefetch}")
        on_engine(engine, receiver.apply(publisher.publish(policy.state_dict(), version=22), engine))
    finally:
        publisher.close()
        on_engine(engine, engine.set_version(0))  # the exported weights again, under their own label


def test_under_keep_running_requests_go_on_and_no_new_request_reuses_an_older_versions_prefix(exported, engine):
    """actor.on_update: keep. A request running across the update samples on (its spans say which
    version sampled what), the prefix a request cached before the update is never hit by one after it
    (the salt), while it would be without the salt (the hazard the salt closes), and requests of one
    version do share their prefixes."""
    folder, policy = exported
    prompt = tokenize(folder, "12+34=46" * 5)
    assert 32 < len(prompt) < 64  # a whole 32-token block of the engine's cache, and room to sample
    publisher, receiver = channel()
    engine.keep_cache = True
    try:

        async def cached(salted: bool, tag: str) -> int:
            from vllm import SamplingParams as VllmSamplingParams

            request = engine.prompt(prompt) if salted else {"prompt_token_ids": prompt}
            params = VllmSamplingParams(max_tokens=1)
            outs = [out async for out in engine._llm.generate(request, params, request_id=tag)]
            return outs[-1].num_cached_tokens

        before = [on_engine(engine, cached(True, f"keep-a{i}")) for i in range(2)]
        on_engine(engine, cached(False, "keep-unsalted-a"))
        out, _ = on_engine(
            engine,
            update_in_flight(
                engine, tokenize(folder, "12+34="), receiver, publisher.publish(policy.state_dict(), 30), 8
            ),
        )
        after = [on_engine(engine, cached(True, f"keep-b{i}")) for i in range(2)]
        unsalted = on_engine(engine, cached(False, "keep-unsalted-b"))
    finally:
        engine.keep_cache = False
        publisher.close()
        on_engine(engine, engine.set_version(0))
    spans = [(int(s.version), s.start) for s in out.weight_versions]
    assert len(spans) == 2 and spans[1][0] == 30 and spans[1][1] >= 8
    assert before[0] == 0 and before[1] >= 32  # one version's requests share the cached prefix
    assert after[0] == 0 and after[1] >= 32  # none reuses the older version's; the new one's are shared
    assert unsalted >= 32  # without a salt the older version's cached keys would be reused


def tcp_payload_mib(update) -> float:
    return sum(b.nbytes for b in update.buckets) / 2**20


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_learner_that_dies_mid_transfer_leaves_the_engine_serving_its_weights(exported, engine, prefetch):
    """Prefetch: the actor's own fetch fails before the engine pauses. No prefetch: the workers'
    fetch fails inside the pause; the reload has not begun, so the engine resumes on its weights."""
    folder, policy = exported
    publisher, receiver = channel(tcp_prefetch=prefetch)
    try:
        on_engine(engine, receiver.apply(publisher.publish(policy.state_dict(), version=8), engine))
        doomed = publisher.publish(perturbed(policy, seed=9).state_dict(), version=9)
        dying = DyingWeightServer(publisher.server.versions[9].view, doomed.buckets, cut_at=1, sent=1000)
        with pytest.raises(
            Exception,
            match=rf"weights v9 from the learner at {dying.location}: connection closed "
            r"after 1000 of 1048576 bytes \(after 1 of \d+ buckets\)",
        ) as failed:
            on_engine(engine, receiver.apply(msgspec.structs.replace(doomed, location=dying.location), engine))
        print(f"\nprefetch={prefetch}: {type(failed.value).__name__}: {failed.value}")
        assert engine.version == 8
        assert_serves(engine, folder, policy, 8, f"tcp-survived-{prefetch}")
    finally:
        publisher.close()
        on_engine(engine, engine.set_version(0))  # the exported weights again, under their own label


def test_a_version_broadcast_over_gloo_reaches_the_engine_exactly_while_a_request_runs(exported, engine):
    """The collective channel's worker side in a real vLLM worker: the engine joins a gloo group with
    this (learner) process through init_weight_transfer_engine, then receives v10 by broadcast inside
    the pause, loading each bucket as it lands, while a request waits in flight; a version the learner
    does not serve is refused by name and the engine keeps v10."""
    folder, policy = exported
    new_policy = perturbed(policy, seed=11)
    publisher, receiver = channel("gloo")
    try:
        update = publisher.publish(new_policy.state_dict(), version=10)
        out, paused_s = on_engine(engine, update_in_flight(engine, tokenize(folder, "12+34="), receiver, update, 8))
        spans = [(int(s.version), s.start, s.end) for s in out.weight_versions]
        print(
            f"\ngloo v10 ({tcp_payload_mib(update):.1f} MiB, {len(update.buckets)} buckets, group formed on its "
            f"first update): engine paused {paused_s:.4f} s; in-flight request spans {spans}"
        )
        assert len(spans) == 2 and spans[1][0] == 10 and 8 <= spans[1][1] < spans[1][2] == 58
        assert_serves(engine, folder, new_policy, 10, "gloo-after")
        with pytest.raises(Exception, match=r"weights v11 .* by gloo: refused by the learner: version 11 is not"):
            on_engine(engine, receiver.apply(msgspec.structs.replace(update, version=11), engine))
        assert engine.version == 10
        assert_serves(engine, folder, new_policy, 10, "gloo-refused")
        update = publisher.publish(policy.state_dict(), version=12)  # the same group, the exported weights again
        paused_s = on_engine(engine, receiver.apply(update, engine))
        print(f"gloo v12 with the group formed: engine paused {paused_s:.4f} s")
        assert_serves(engine, folder, policy, 12, "gloo-back")
    finally:
        publisher.close()
        on_engine(engine, engine.set_version(0))


def test_a_learner_gone_mid_broadcast_leaves_the_engine_paused_until_a_restarted_learner_makes_it_whole(
    exported, engine, monkeypatch
):
    """gloo: the learner sends one bucket of v13 into the engine and dies. The model is torn (some
    tensors new, some old), so the engine stays paused with its request in flight; a restarted learner's
    v14 makes it whole, and the request goes on under v14 from where it stopped."""
    from tidal.broker.weights import build_publisher, gloo
    from tidal.config import WeightsConfig

    folder, policy = exported
    publisher, receiver = channel("gloo", tcp_timeout_s=2.0)

    def dies_after_one_bucket(self, group, served, progress):
        gloo.broadcast(group.group, served.payload[: served.buckets[0].nbytes])
        group.abort()

    monkeypatch.setattr(gloo.GlooPlane, "send", dies_after_one_bucket)
    prompt = tokenize(folder, "12+34=")

    async def torn_then_whole():
        from vllm import SamplingParams as VllmSamplingParams

        params = VllmSamplingParams(max_tokens=64 - len(prompt), ignore_eos=True, logprobs=0)
        failed, last = None, None
        async for out in engine._llm.generate({"prompt_token_ids": prompt}, params, request_id="torn"):
            last = out.outputs[0]
            if failed is None and len(last.token_ids) >= 8:
                try:
                    await receiver.apply(publisher.publish(perturbed(policy, seed=13).state_dict(), 13), engine)
                except ConnectionError as err:
                    failed = err
                await asyncio.sleep(1.0)
                assert engine.torn and await engine._llm.is_paused()  # nothing sampled from the torn model
                publisher.close()
                monkeypatch.undo()
                restarted = build_publisher(
                    WeightsConfig(transport="gloo", bucket_mib=1, tcp_timeout_s=10.0), "inc-2", "run", "/unused"
                )
                try:
                    await receiver.apply(restarted.publish(new_policy.state_dict(), 14), engine)
                finally:
                    restarted.close()
        return failed, last

    new_policy = perturbed(policy, seed=14)
    try:
        failed, out = on_engine(engine, torn_then_whole())
        spans = [(int(s.version), s.start, s.end) for s in out.weight_versions]
        print(f"\ngloo torn at v13 ({failed}); request spans {spans}")
        assert failed is not None and not engine.torn and engine.version == 14
        assert len(spans) == 2 and spans[0][0] == 0 and spans[1][0] == 14 and 8 <= spans[1][1] < spans[1][2] == 58
        assert_serves(engine, folder, new_policy, 14, "gloo-whole-again")
    finally:
        publisher.close()
        on_engine(engine, engine.set_version(0))
