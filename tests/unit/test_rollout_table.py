"""The table of sampled training rollouts: when the learner logs it, what its rows say (advantage,
versions, lag), and the few rollouts `--print-samples` shows on the console."""

import json
import logging
from types import SimpleNamespace

import pytest

from conftest import sample
from tidal.broker.schema import RolloutGroup, int32s
from tidal.config import AdvantageNorm, LearnerConfig
from tidal.learner.rank0.admission import StepBatch
from tidal.learner.rank0.diagnostics import PRINT_SAMPLES_ENV, Diagnostics
from tidal.learner.rank0.loop import Learner
from tidal.ops.launcher import RolloutFollower
from tidal.run_files import ROLLOUTS_FILE, rollout_text

COLUMNS = [
    "step",
    "prompt",
    "completion",
    "reward",
    "task_reward",
    "advantage",
    "versions",
    "lag",
    "finish_reason",
    "tokens",
    "actor",
    "group_id",
]


def group(gid: str, samples) -> RolloutGroup:
    return RolloutGroup.pack(samples, group_id=gid, prompt_id=1, actor_id="actor-0", prompt_tokens=int32s([2, 3]))


def diagnostics(tmp_path, every: int, rows: int, decoded: list | None = None, print_samples: int = 0):
    tables = []
    tracker = SimpleNamespace(log_table=lambda columns, name: tables.append((name, columns)))
    decode = lambda ids: (decoded.append(1) if decoded is not None else None) or " ".join(map(str, ids))  # noqa: E731
    d = Diagnostics(
        tracker,
        decode,
        tmp_path,
        completions_per_eval=0,
        max_lag=2,
        rollout_table_every=every,
        rollout_table_rows=rows,
        print_samples=print_samples,
    )
    return d, tables


def run_steps(d, batch: StepBatch, versions, norm=AdvantageNorm.batch) -> None:
    """The loop's own step of the table (`Learner.show_rollouts`) at each learner version, on one batch."""
    for version in versions:
        Learner.show_rollouts(
            SimpleNamespace(
                parts=SimpleNamespace(diagnostics=d), version=version, cfg=LearnerConfig(advantage_norm=norm)
            ),
            batch,
        )


def batch_of(groups) -> StepBatch:
    batch = StepBatch()
    batch.groups = list(groups)
    return batch


def four_by_four() -> StepBatch:
    """Four groups of four one-version samples; sample j of group i has reward j == i and j + 1 tokens."""
    return batch_of(group(f"g{i}", [sample([(0, j + 1)], float(j == i)) for j in range(4)]) for i in range(4))


def test_a_table_at_steps_n_and_2n_with_its_columns_and_rows(tmp_path):
    d, tables = diagnostics(tmp_path, every=2, rows=3)
    run_steps(d, four_by_four(), range(5))  # steps 1..5
    assert [name for name, _ in tables] == ["rollouts/step-000002.json", "rollouts/step-000004.json"]
    for (_, columns), step in zip(tables, (2, 4)):
        assert list(columns) == COLUMNS
        assert all(len(values) == 3 for values in columns.values())
        assert columns["step"] == [step] * 3 and columns["prompt"] == ["2 3"] * 3
    lines = (tmp_path / ROLLOUTS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4]


def test_its_advantage_is_the_steps_and_only_chosen_rows_are_decoded(tmp_path):
    decoded = []
    d, tables = diagnostics(tmp_path, every=1, rows=5, decoded=decoded)
    run_steps(d, four_by_four(), [0], norm=AdvantageNorm.none)
    [(_, columns)] = tables
    for reward, advantage in zip(columns["reward"], columns["advantage"]):
        assert advantage == pytest.approx(reward - 0.25)  # one of four samples of each group has reward 1
    groups = len(set(columns["group_id"]))
    assert len(decoded) == 5 + groups  # each chosen completion, and each chosen group's prompt once


def test_the_rows_are_a_seeded_draw_not_the_first_ones(tmp_path):
    d, tables = diagnostics(tmp_path, every=1, rows=4)
    run_steps(d, four_by_four(), [0, 1, 0])
    chosen = [list(zip(c["group_id"], c["tokens"])) for _, c in tables]
    assert chosen[0] == chosen[2]  # the same step draws the same rows
    assert chosen[0] != chosen[1]
    first_four = [("g0", 1), ("g0", 2), ("g0", 3), ("g0", 4)]
    assert first_four not in chosen


def test_versions_and_lag_of_a_sample_generated_across_a_weight_update(tmp_path):
    d, tables = diagnostics(tmp_path, every=6, rows=8)
    # at learner version 5 (step 6): tokens of versions 3 then 4; and a fresh sample of version 5
    run_steps(d, batch_of([group("g", [sample([(3, 2), (4, 2)], 1.0), sample([(5, 3)], 0.0)])]), [5])
    [(_, columns)] = tables
    assert columns["versions"] == ["3..4", "5"] and columns["lag"] == [2, 0]


def test_nothing_is_logged_with_zero(tmp_path):
    for every, rows in ((0, 16), (2, 0)):
        d, tables = diagnostics(tmp_path, every=every, rows=rows)
        run_steps(d, four_by_four(), range(4))
        assert tables == [] and not (tmp_path / ROLLOUTS_FILE).exists()


def test_print_samples_writes_a_few_truncated_rollouts_to_the_log(tmp_path, caplog):
    d, _ = diagnostics(tmp_path, every=1, rows=4, print_samples=2)
    with caplog.at_level(logging.INFO, logger="tidal.learner.rank0.diagnostics"):
        run_steps(d, four_by_four(), [0])
    shown = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[rollout]")]
    assert len(shown) == 2 and "versions=0 lag=0" in shown[0]
    line = rollout_text(
        {
            "step": 1,
            "prompt": "p\nq",
            "completion": "x" * 500,
            "reward": 1.0,
            "reward/format": 0.5,
            "advantage": 0.5,
            "versions": "3",
            "lag": 0,
            "finish_reason": "stop",
        },
        width=20,
    )
    assert "reward/format=0.5" in line and "prompt: p\\nq" in line and "completion: " + "x" * 17 + "..." in line


def test_print_samples_from_the_environment_and_a_bad_value_named(tmp_path, monkeypatch):
    monkeypatch.setenv(PRINT_SAMPLES_ENV, "3")
    assert Diagnostics(None, str, tmp_path, 0, 1).print_samples == 3
    monkeypatch.setenv(PRINT_SAMPLES_ENV, "some")
    with pytest.raises(ValueError, match=PRINT_SAMPLES_ENV):
        Diagnostics(None, str, tmp_path, 0, 1)


def test_the_launcher_shows_the_first_rows_of_each_new_table(tmp_path):
    path = tmp_path / ROLLOUTS_FILE
    row = {
        "prompt": "p",
        "completion": "c",
        "reward": 1.0,
        "advantage": 0.5,
        "versions": "1",
        "lag": 0,
        "finish_reason": "stop",
    }
    path.write_text(json.dumps({"step": 1, "rows": [row | {"step": 1}]}) + "\n")  # before a resume: not shown
    shown = []
    follower = RolloutFollower(tmp_path, 2, shown.append)
    with open(path, "a") as f:
        f.write(json.dumps({"step": 2, "rows": [row | {"step": 2}] * 3}) + "\n" + '{"step": 3, "ro')
    follower.advance()
    assert len(shown) == 2 and all(s.startswith("[rollout] step 2 ") for s in shown)
    with open(path, "a") as f:
        f.write('ws": []}\n')  # the line the learner was still writing
    follower.advance()
    assert len(shown) == 2


@pytest.mark.parametrize("norm", list(AdvantageNorm))
def test_the_advantages_are_those_the_trainer_trains_with(tmp_path, accelerator, norm):
    from conftest import ALPHABET, TINY, learner_config, step_batch
    from tidal.config import Aggregation, LossType
    from tidal.learner.every_rank.trainer import Trainer
    from tidal.tiny import build_tiny_model

    groups, masks = step_batch(6)
    cfg = learner_config(LossType.cispo, Aggregation.token_mean, 24, minibatches=2)
    cfg = LearnerConfig(**{**cfg.__dict__, "advantage_norm": norm})
    trainer = Trainer(cfg, build_tiny_model(TINY, ALPHABET, seed=0)[0], accelerator, temperature=1.0)
    trained = sorted(row.advantage for rows in trainer._build_minibatches(groups, masks, False) for row in rows)
    d, tables = diagnostics(tmp_path, every=1, rows=100)
    run_steps(d, batch_of(groups), [2], norm=norm)
    [(_, columns)] = tables
    assert sorted(columns["advantage"]) == pytest.approx(trained, abs=1e-12)


def test_each_reward_component_has_its_own_column(tmp_path):
    d, tables = diagnostics(tmp_path, every=1, rows=2)
    parts = [{"exact": 1.0, "short": 0.5}, {"exact": 0.0, "short": 0.25}]
    run_steps(d, batch_of([group("g", [sample([(0, 1)], 1.5, reward_components=p) for p in parts])]), [0])
    [(_, columns)] = tables
    assert columns["reward/exact"] == [1.0, 0.0] and columns["reward/short"] == [0.5, 0.25]
