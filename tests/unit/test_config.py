"""Config: every preset loads; unknown keys and wrong types fail with one line naming the key; a
loaded config is frozen and resolved once."""
import dataclasses
from pathlib import Path

import pytest

from tidal.config import AdvantageNorm, Aggregation, ConfigError, LossType, flatten, load_config, resolve

ROOT = Path(__file__).parents[2] / "configs"
CONFIGS = sorted(ROOT.rglob("*.yaml"))  # configs/loo/ and any other folder too
TINY = ROOT / "tiny.yaml"


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT)) for p in CONFIGS])
def test_every_preset_loads(path):
    cfg = load_config(path)
    assert cfg.learner.groups_per_step >= 1


def test_presets_include_the_subfolders():
    assert {"tiny.yaml", "scalerl.yaml", "tiny-scalerl.yaml", "loo/tiny-loo-sync.yaml"} <= {
        str(p.relative_to(ROOT)) for p in CONFIGS}


def test_scalerl_preset_is_the_recipe():
    cfg = load_config(ROOT / "scalerl.yaml")
    lc = cfg.learner
    assert cfg.model.path == ""  # the user must set it
    assert (cfg.staleness.max_lag, lc.groups_per_step, cfg.sampling.n) == (8, 48, 16)
    assert lc.loss.type is LossType.cispo and lc.loss.aggregation is Aggregation.prompt_mean
    assert lc.advantage_norm is AdvantageNorm.batch and lc.zero_variance_filter
    assert cfg.curriculum.enabled and cfg.curriculum.retire_pass_rate == 0.9
    assert cfg.sampling.interrupt.enabled and not cfg.sampling.overlong.enabled
    assert (lc.optim.lr, lc.optim.eps, lc.optim.weight_decay, lc.optim.warmup_steps) == (5e-7, 1e-15, 0.01, 100)


# Each leave-one-out preset differs from configs/tiny-scalerl.yaml in its name and its one piece only.
LEFT_OUT = {
    "tiny-loo-tis.yaml": {"learner.loss.type": "tis"},
    "tiny-loo-token-mean.yaml": {"learner.loss.aggregation": "token_mean"},
    "tiny-loo-group-norm.yaml": {"learner.advantage_norm": "group"},
    "tiny-loo-no-zero-var-filter.yaml": {"learner.zero_variance_filter": "False"},
    "tiny-loo-no-curriculum.yaml": {"curriculum.enabled": "False"},
    "tiny-loo-sync.yaml": {"staleness.max_lag": "0"},
}


def test_every_leave_one_out_preset_is_listed():
    assert sorted(p.name for p in (ROOT / "loo").glob("*.yaml")) == sorted(LEFT_OUT)


@pytest.mark.parametrize("name", sorted(LEFT_OUT))
def test_leave_one_out_preset_changes_one_piece(name):
    recipe = flatten(load_config(ROOT / "tiny-scalerl.yaml"))
    variant = flatten(load_config(ROOT / "loo" / name))
    changed = {k: v for k, v in variant.items() if recipe[k] != v}
    assert changed == {"name": name.removesuffix(".yaml")} | LEFT_OUT[name]


def test_overrides_apply_with_types():
    cfg = load_config(TINY, ["learner.max_steps=7", "learner.loss.aggregation=token_mean", "staleness.max_lag=0"])
    assert cfg.learner.max_steps == 7
    assert cfg.learner.loss.aggregation is Aggregation.token_mean
    assert cfg.staleness.max_lag == 0


@pytest.mark.parametrize("override, key", [
    ("learner.no_such_key=1", "learner.no_such_key"),
    ("learner.max_steps=many", "learner.max_steps"),
    ("learner.loss.aggregation=median", "learner.loss.aggregation"),
    ("sampling.n=1", "sampling.n"),
    ("model.tiny.num_heads=8", "model.tiny.num_heads"),
    ("curriculum.retire_pass_rate=1.5", "curriculum.retire_pass_rate"),
    ("curriculum.retire_pass_rate=0", "curriculum.retire_pass_rate"),
    ("curriculum.min_samples=0", "curriculum.min_samples"),
])
def test_bad_override_names_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    message = str(err.value)
    assert key in message and "\n" not in message


def test_bad_yaml_key_names_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  groups_per_stepp: 4\n")
    with pytest.raises(ConfigError, match="groups_per_stepp"):
        load_config(bad)


def test_cli_reports_config_error_in_one_line(capsys):
    from tidal.cli import main

    assert main(["prepare", str(TINY), "eval.every=soon"]) == 2
    err = capsys.readouterr().err.strip()
    assert "eval.every" in err and len(err.splitlines()) == 1


def test_a_loaded_config_is_frozen():
    cfg = load_config(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.learner.max_steps = 3


def test_resolve_fills_what_processes_agree_on_once(tmp_path):
    cfg = load_config(TINY, [f"run_dir={tmp_path / 'run'}", "actor.index=3"])
    run = resolve(cfg, model_path="/models/m", redis_url="redis://10.0.0.1:6379/0")
    assert (run.run_dir, run.model.path, run.broker.redis.url) == (str(tmp_path / "run"), "/models/m",
                                                                    "redis://10.0.0.1:6379/0")
    assert run.weights.dir.startswith("/dev/shm/tidal-") and run.actor.id == ""  # ids belong to actor processes
    assert resolve(run) == run  # resolving again changes nothing
    actor = resolve(run, actor=True)
    assert (actor.actor.id, actor.actor.index, actor.weights.dir) == ("actor-3", 3, run.weights.dir)
    named = resolve(load_config(TINY, ["actor.id=spare", "weights.dir=/w"]), actor=True)
    assert (named.actor.id, named.weights.dir) == ("spare", "/w")
    assert cfg.run_dir == str(tmp_path / "run") and cfg.model.path == ""  # the loaded config is untouched


def test_two_runs_get_different_weight_folders(tmp_path):
    a = resolve(load_config(TINY, [f"run_dir={tmp_path / 'a'}"]))
    b = resolve(load_config(TINY, [f"run_dir={tmp_path / 'b'}"]))
    assert a.weights.dir != b.weights.dir


def test_presets_load_by_name_as_well_as_by_path():
    assert load_config("tiny") == load_config(TINY)
    assert load_config("loo/tiny-loo-sync").staleness.max_lag == 0
    with pytest.raises(ConfigError, match="'nope': no such file, and not a preset"):
        load_config("nope")
