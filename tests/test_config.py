"""Config: every preset loads; unknown keys and wrong types fail with one line naming the key."""
from pathlib import Path

import pytest

from tidal.config import Aggregation, ConfigError, load_config

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_preset_loads(path):
    cfg = load_config(path)
    assert cfg.learner.groups_per_step >= 1


def test_overrides_apply_with_types():
    cfg = load_config(CONFIGS[0], ["learner.max_steps=7", "learner.loss.aggregation=token_mean", "staleness.max_lag=0"])
    assert cfg.learner.max_steps == 7
    assert cfg.learner.loss.aggregation is Aggregation.token_mean
    assert cfg.staleness.max_lag == 0


@pytest.mark.parametrize("override, key", [
    ("learner.no_such_key=1", "learner.no_such_key"),
    ("learner.max_steps=many", "learner.max_steps"),
    ("learner.loss.aggregation=median", "learner.loss.aggregation"),
    ("sampling.n=1", "sampling.n"),
    ("model.tiny.num_heads=8", "model.tiny.num_heads"),
])
def test_bad_override_names_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS[0], [override])
    message = str(err.value)
    assert key in message and "\n" not in message


def test_bad_yaml_key_names_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  groups_per_stepp: 4\n")
    with pytest.raises(ConfigError, match="groups_per_stepp"):
        load_config(bad)


def test_cli_reports_config_error_in_one_line(capsys):
    from tidal.cli import main

    assert main(["prepare", str(CONFIGS[0]), "eval.every=soon"]) == 2
    err = capsys.readouterr().err.strip()
    assert "eval.every" in err and len(err.splitlines()) == 1
