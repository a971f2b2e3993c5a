"""Any reward scale: a pass is a task reward >= task.pass_threshold everywhere a pass is counted
(rollout/pass_rate, eval/pass_rate, the curriculum), the mean reward is its own metric, and a
default threshold meeting rewards other than 0 and 1 is named in one warning."""

import logging
from types import SimpleNamespace

import pytest

from conftest import sample
from tidal.broker.inproc import InprocBroker
from tidal.broker.schema import RolloutGroup, SamplingParams, WireCodec, int32s
from tidal.config import CurriculumConfig, StalenessConfig, TaskConfig
from tidal.learner.rank0.accounting import Accounting
from tidal.learner.rank0.admission import Admission, StepBatch
from tidal.learner.rank0.coordinator import Coordinator, DispatchPlan
from tidal.learner.rank0.evaluation import Evaluator
from tidal.learner.rank0.groups import GroupBook, Release
from tidal.learner.rank0.ledger import Ledger
from tidal.tasks import Prompt, get_reward

VERSION = 3
SOLVED = {0, 1}  # the prompts the policy answers right; the other six it never does


# the case: task.kwargs.partial_credit=0.1, a wrong answer still earns 0.1
partial_credit_reward = get_reward(TaskConfig(name="arithmetic", kwargs={"partial_credit": 0.1}))


def build(tmp_path, pass_threshold=1.0, num_prompts=8, pass_on=""):
    plan = DispatchPlan(
        run_id="r",
        task="arithmetic",
        n=4,
        sampling=SamplingParams(),
        eval_n=1,
        eval_sampling=SamplingParams(),
        groups_per_step=4,
        max_lag=1,
        seed=0,
    )
    prompts = [Prompt(prompt_id=i, text=f"{i:02d}+01=", payload={"answer": f"{i + 1:03d}"}) for i in range(num_prompts)]
    book = GroupBook(Ledger(tmp_path / "ledger.jsonl"))
    coordinator = Coordinator(
        plan,
        prompts,
        [],
        lambda prompt: [1],
        InprocBroker(WireCodec(1 << 20)).learner(),
        book,
        CurriculumConfig(min_samples=4),
        pass_threshold,
    )
    admission = Admission(StalenessConfig(max_lag=1), True, book, coordinator.on_rewards, pass_threshold, pass_on)
    return coordinator, admission, prompts


def scored_group(prompt: Prompt, rewards: list[float], gid: str, components: list[dict] | None = None) -> RolloutGroup:
    samples = [sample([(VERSION, 2)], r) for r in rewards]
    for s, parts in zip(samples, components or []):
        s.sample.reward_components = parts
    return RolloutGroup.pack(
        samples, group_id=gid, prompt_id=prompt.prompt_id, actor_id="actor-0", prompt_tokens=int32s([2, 3])
    )


def answers(prompt: Prompt) -> list[str]:
    """Four completions: right for a solved prompt, a wrong number otherwise."""
    return [prompt.payload["answer"] if prompt.prompt_id in SOLVED else "000"] * 4


def test_partial_credit_neither_passes_every_sample_nor_retires_unsolved_prompts(tmp_path):
    coordinator, admission, prompts = build(tmp_path)
    accounting = Accounting(num_params=1000, learner_devices=1)
    pass_rates = []
    for step in range(3):  # every prompt is judged each step (4 samples = curriculum.min_samples)
        batch = StepBatch()
        for prompt in prompts:
            rewards = [partial_credit_reward(text, prompt.payload) for text in answers(prompt)]
            admission.add(scored_group(prompt, rewards, f"s{step}-p{prompt.prompt_id}"), batch, VERSION)
        pass_rates.append(accounting.add_step(batch.stats, computed_tokens=0)["rollout/pass_rate"])
    assert pass_rates[0] == 2 / 8  # counting every reward above 0 made it 1.0 at every step
    assert coordinator.curriculum.retired == SOLVED  # not all eight: the run keeps its unsolved prompts
    assert not coordinator.curriculum.exhausted


def test_rollout_reward_mean_and_pass_rate_are_different_metrics(tmp_path):
    _, admission, prompts = build(tmp_path)
    batch = StepBatch()
    admission.add(scored_group(prompts[5], [1.0, 0.1, 0.1, 0.1], "g"), batch, VERSION)
    metrics = Accounting(num_params=1000, learner_devices=1).add_step(batch.stats, computed_tokens=0)
    assert metrics["rollout/pass_rate"] == 0.25
    assert abs(metrics["rollout/reward_mean"] - 1.3 / 4) < 1e-9


def test_a_threshold_on_another_scale_counts_passes_by_it(tmp_path):
    # two components summed (accuracy 1 + format 1): a solved sample earns at least 1.5 here
    coordinator, admission, prompts = build(tmp_path, pass_threshold=1.5, num_prompts=2)
    batch = StepBatch()
    admission.add(scored_group(prompts[0], [2.0, 2.0, 1.5, 2.0], "a"), batch, VERSION)
    admission.add(scored_group(prompts[1], [1.0, 1.0, 1.0, 0.0], "b"), batch, VERSION)
    assert batch.stats["passed"] == 4
    assert coordinator.curriculum.retired == {0}  # format alone (1.0) never solves a prompt


def test_rewards_beyond_0_and_1_at_the_default_threshold_warn_once(tmp_path, caplog):
    _, admission, prompts = build(tmp_path)
    batch = StepBatch()
    with caplog.at_level(logging.WARNING, logger="tidal.learner.rank0.admission"):
        admission.add(scored_group(prompts[2], [1.0, 0.0, 1.0, 0.0], "binary"), batch, VERSION)
        assert caplog.records == []
        for i in range(3):
            admission.add(scored_group(prompts[3], [0.1, 1.0, 0.1, 0.1], f"partial{i}"), batch, VERSION)
    [warning] = caplog.records
    assert "task.pass_threshold" in warning.getMessage() and "0.1" in warning.getMessage()


def test_an_explicit_threshold_does_not_warn(tmp_path, caplog):
    _, admission, prompts = build(tmp_path, pass_threshold=0.5)
    with caplog.at_level(logging.WARNING, logger="tidal.learner.rank0.admission"):
        admission.add(scored_group(prompts[3], [0.1, 1.0, 0.7, 0.1], "g"), StepBatch(), VERSION)
    assert caplog.records == []


def test_an_evaluation_logs_its_pass_rate_and_its_mean_reward_apart(tmp_path):
    coordinator, _, _ = build(tmp_path)
    logged = []
    metrics_log = SimpleNamespace(log=lambda metrics, step: logged.append((step, metrics)))
    accounting = SimpleNamespace(compute_axis=lambda num_actors: {"compute/samples": 8.0})
    transport = SimpleNamespace(actors=lambda: ["actor-0"])
    evaluator = Evaluator(coordinator, metrics_log, accounting, transport)
    evaluator.evals.expect(VERSION, {"e": Release(0, VERSION, 4, "", eval_version=VERSION)})
    group = scored_group(Prompt(0, "", {}), [1.0, 0.1, 0.1, 0.1], "e")
    group.eval_version = VERSION
    evaluator.on_group(group, VERSION)
    [(step, metrics)] = logged
    assert step == VERSION and metrics["eval/pass_rate"] == 0.25  # the mean reward was logged as pass rate
    assert abs(metrics["eval/reward_mean"] - 0.325) < 1e-9


def test_a_named_reward_function_decides_a_pass_in_training_the_curriculum_and_evaluations(tmp_path):
    """reward = accuracy + format, task.pass_on=accuracy: a well-formatted wrong answer earns 1.0, the
    threshold, and is still no pass; a sample whose accuracy gave no value is no pass either."""
    right, wrong, no_accuracy = {"accuracy": 1.0, "format": 1.0}, {"accuracy": 0.0, "format": 1.0}, {"format": 1.0}
    coordinator, admission, prompts = build(tmp_path, pass_threshold=1.0, num_prompts=3, pass_on="accuracy")
    batch = StepBatch()
    admission.add(scored_group(prompts[0], [2.0] * 4, "a", [right] * 4), batch, VERSION)
    admission.add(scored_group(prompts[1], [1.0] * 4, "b", [wrong] * 4), batch, VERSION)
    admission.add(scored_group(prompts[2], [1.0] * 4, "c", [no_accuracy] * 4), batch, VERSION)
    assert batch.stats["passed"] == 4  # by the sum, all twelve would pass
    assert coordinator.curriculum.retired == {0}  # by the sum, all three prompts would retire

    logged = []
    evaluator = Evaluator(
        coordinator,
        SimpleNamespace(log=lambda metrics, step: logged.append(metrics)),
        SimpleNamespace(compute_axis=lambda num_actors: {}),
        SimpleNamespace(actors=lambda: []),
        pass_threshold=1.0,
        pass_on="accuracy",
    )
    evaluator.evals.expect(VERSION, {"e": Release(0, VERSION, 4, "", eval_version=VERSION)})
    group = scored_group(Prompt(0, "", {}), [2.0, 2.0, 1.0, 1.0], "e", [right, right, wrong, no_accuracy])
    group.eval_version = VERSION
    evaluator.on_group(group, VERSION)
    assert logged[0]["eval/pass_rate"] == 0.5 and logged[0]["eval/reward_mean"] == 1.5


def test_pass_on_names_one_of_the_reward_functions(tmp_path):
    from tidal.config import ConfigError, load_config
    from tidal.tasks.rewards import load_reward_funcs

    with pytest.raises(ConfigError, match="task.pass_on"):
        load_config(None, ["task.pass_on=accuracy"])
    cfg = load_config(None, ["task.reward_funcs=[os.path:isabs]", "task.pass_on=accuracy"]).task
    with pytest.raises(ConfigError, match=r"'task.pass_on' = 'accuracy': not one of task.reward_funcs' names"):
        load_reward_funcs(cfg)


def test_failed_episodes_are_summed_up_by_kind_not_by_message(tmp_path):
    """A reward that quotes each completion in its error is one bug: one kind, with two of its messages
    (the first alone would stand for all of them)."""
    from tidal.broker.schema import Episode

    _, admission, prompts = build(tmp_path)
    where = '\n  File "/tmp/my_rewards.py", line 9, in picky\n    raise ValueError(f"cannot read {c!r}")'
    errors = [f"reward function picky raised ValueError: cannot read '{n}+'{where}" for n in range(40)]
    errors += ["Countdown.step took longer than env.step_timeout_s = 5 s"] * 3
    samples = [sample([(VERSION, 2)], 0.0, episode=Episode(turns=1, env_error=e)) for e in errors]
    samples.append(sample([(VERSION, 2)], 1.0))
    group = RolloutGroup.pack(samples, group_id="g", prompt_id=0, actor_id="actor-0", prompt_tokens=int32s([2, 3]))
    admission.add(group, StepBatch(), VERSION)
    picky = (
        f"reward function picky raised ValueError with different messages, e.g. \"cannot read '0+'\" and "
        f"\"cannot read '1+'\"{where}"
    )
    assert admission.failure_summary() == {"count": 43, "reasons": [(picky, 40), (errors[-1], 3)]}


def test_a_reward_that_fails_every_episode_stops_the_run_naming_why(tmp_path):
    """Every reward 0 makes every group zero-variance: without the stop the learner samples forever."""
    import pytest

    from tidal.broker.schema import Episode
    from tidal.learner.rank0.admission import FAILING_RUN, EpisodesFailing

    _, admission, prompts = build(tmp_path)
    error = "reward function broken raised KeyError: 'answr'\n  File \"/tmp/my_rewards.py\", line 20, in broken"
    failed = [sample([(VERSION, 2)], 0.0, episode=Episode(turns=1, env_error=error)) for _ in range(8)]

    def group(i, samples):
        return RolloutGroup.pack(
            samples, group_id=f"g{i}", prompt_id=i % 8, actor_id="actor-0", prompt_tokens=int32s([2, 3])
        )

    admission.add(group(0, failed[:7] + [sample([(VERSION, 2)], 1.0)]), StepBatch(), VERSION)  # one episode worked
    for i in range(1, FAILING_RUN // 8):
        admission.add(group(i, failed), StepBatch(), VERSION)
    with pytest.raises(EpisodesFailing, match=rf"the last {FAILING_RUN} training episodes all failed \(each") as err:
        admission.add(group(FAILING_RUN // 8, failed), StepBatch(), VERSION)
    assert str(err.value).endswith(f"({FAILING_RUN + 7} times):\n{error}")
