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
        str(p.relative_to(ROOT)) for p in CONFIGS
    }


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


@pytest.mark.parametrize(
    "override, key",
    [
        ("learner.no_such_key=1", "learner.no_such_key"),
        ("learner.max_steps=many", "learner.max_steps"),
        ("learner.loss.aggregation=median", "learner.loss.aggregation"),
        ("sampling.n=1", "sampling.n"),
        ("model.tiny.num_heads=8", "model.tiny.num_heads"),
        ("curriculum.retire_pass_rate=1.5", "curriculum.retire_pass_rate"),
        ("curriculum.retire_pass_rate=0", "curriculum.retire_pass_rate"),
        ("curriculum.min_samples=0", "curriculum.min_samples"),
        ("learner.fsdp.enabled=true", "learner.fsdp.enabled"),  # one rank: nothing to shard over
        ("learner.nodes=2", "learner.nodes"),  # one rank cannot be split over two machines
        ("learner.node_rank=1", "learner.node_rank"),  # one machine: node 0 only
        ("actor.on_update=reuse", "actor.on_update"),
        ("weights.transport=gloo weights.delta=true", "weights.delta"),  # broadcasts are whole
    ],
)
def test_bad_override_names_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, override.split())
    message = str(err.value)
    assert key in message and "\n" not in message


def test_bad_yaml_key_names_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  groups_per_stepp: 4\n")
    with pytest.raises(ConfigError, match="groups_per_stepp"):
        load_config(bad)


def test_cli_reports_config_error_in_one_line(capsys):
    from tidal.ops.cli import main

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
    assert (run.run_dir, run.model.path, run.broker.redis.url) == (
        str(tmp_path / "run"),
        "/models/m",
        "redis://10.0.0.1:6379/0",
    )
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


# ---- layering and asking: base keys, several configs, `tidal config`, `tidal --version` ----------


def test_layers_apply_in_order_and_an_overlay_names_its_base(tmp_path):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("base: tiny-scalerl\nstaleness:\n  max_lag: 2\n")
    second = tmp_path / "second.yaml"
    second.write_text("base: overlay.yaml\nsampling:\n  n: 4\n")  # a file next to this one
    cfg = load_config([second, ROOT / "loo/tiny-loo-tis.yaml"], ["staleness.max_lag=3"])
    assert (cfg.staleness.max_lag, cfg.sampling.n, cfg.learner.loss.type) == (3, 8, LossType.tis)
    assert load_config(second).sampling.n == 4 and load_config(second).staleness.max_lag == 2


def test_a_base_that_goes_round_is_one_line(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="goes round in a circle"):
        load_config(tmp_path / "a.yaml")


def test_config_show_prints_what_loads_again(tmp_path, capsys):
    from tidal.ops.cli import main

    assert main(["config", "show", "tiny-scalerl", "staleness.max_lag=3", "loo/tiny-loo-tis"]) == 0
    shown = tmp_path / "shown.yaml"
    shown.write_text(capsys.readouterr().out)
    cfg = load_config(shown)
    assert cfg == load_config(["tiny-scalerl", "loo/tiny-loo-tis"], ["staleness.max_lag=3"])


def test_config_check_reads_the_task_and_starts_nothing(tmp_path, capsys):
    from tidal.ops.cli import main

    assert main(["config", "check", "tiny", f"run_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "training prompts" in out and out.rstrip().endswith("config ok") and not (tmp_path / "run").exists()
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 3\n')
    assert main(["config", "check", "tiny", "task.name=math", f"task.data_path={data}"]) == 2
    assert "rows.jsonl" in capsys.readouterr().err


def test_config_explain_reads_the_schemas_help(capsys):
    from tidal.ops.cli import main

    assert main(["config", "explain", "staleness.max_lag"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("staleness.max_lag (int, default 8):") and "synchronous" in out
    assert main(["config", "explain", "learner.loss"]) == 0
    assert "  eps_max (float, default 4.0): cispo: cap" in capsys.readouterr().out
    assert main(["config", "explain", "staleness.max_lags"]) == 2
    assert "max_lag" in capsys.readouterr().err  # the error lists what the section has


def test_every_field_has_help():
    import typing

    from tidal.config import RunConfig, field_help

    hints = {}

    def walk_hints(cls, prefix=""):
        helps = field_help(cls)  # once a class, as explain reads it
        for name, hint in typing.get_type_hints(cls).items():
            if dataclasses.is_dataclass(hint):
                walk_hints(hint, f"{prefix}{name}.")
            else:
                hints[f"{prefix}{name}"] = helps.get(name, "")

    walk_hints(RunConfig)
    missing = sorted(k for k, text in hints.items() if not text)
    assert not missing, f"fields without help in the schema (opt's second argument): {missing}"


def test_version_and_flags_between_configs(capsys):
    from tidal.ops.cli import main, parse

    with pytest.raises(SystemExit) as code:
        main(["--version"])
    assert code.value.code == 0 and capsys.readouterr().out.startswith("tidal ")
    args = parse(["learner", "run.yaml", "--resume", "auto", "run_dir=/data", "overlay.yaml"])
    assert (args.layers, args.resume) == (["run.yaml", "run_dir=/data", "overlay.yaml"], "auto")
    assert main(["run", "learner.max_steps=3"]) == 2  # no config at all
    assert "needs a config" in capsys.readouterr().err


@pytest.mark.parametrize("word, value", [("on", "on"), ("off", "off"), ("auto", "auto"), ("yes", "on"), ("no", "off")])
def test_curve_on_and_off_in_yaml_are_the_words_not_booleans(tmp_path, word, value):
    """YAML 1.1 reads on/off (and yes/no) as booleans; broker.zmq.curve takes them as the words."""
    path = tmp_path / "run.yaml"
    path.write_text(f"broker:\n  zmq:\n    curve: {word}\n    keys_dir: /keys\n")
    assert load_config(path).broker.zmq.curve == value
    assert load_config(None, [f"broker.zmq.curve={word}"]).broker.zmq.curve == value


def test_curve_on_without_a_keys_folder_loads_for_tidal_run_to_fill_in():
    assert load_config(None, ["broker.zmq.curve=on"]).broker.zmq.keys_dir == ""


@pytest.mark.parametrize("key", ["rollout_hwm", "control_hwm"])
def test_receive_buffers_must_be_bounded(key):
    with pytest.raises(ConfigError, match=f"broker.zmq.{key}"):
        load_config(None, [f"broker.zmq.{key}=0"])


def test_a_rollout_buffer_that_cannot_hold_one_frame_is_refused():
    with pytest.raises(ConfigError, match="broker.zmq.rollout_buffer_bytes"):
        load_config(None, ["broker.max_message_bytes=2048", "broker.zmq.rollout_buffer_bytes=1024"])


@pytest.mark.parametrize("bad", ["../../escaped", "a/b", "x y;rm", ".hidden", "", "n" * 129])
def test_a_run_name_that_could_leave_its_folders_is_refused(bad):
    """The name is part of runs/<name>-<time>, of the weights folder in /dev/shm and of the Redis keys:
    `../` put the run folder and the weights folder (removed at the end as the run's own) elsewhere."""
    with pytest.raises(ConfigError, match="config key 'name'"):
        load_config(None, [f"name='{bad}'"])


def test_run_names_of_presets_and_sweeps_are_accepted():
    for name in ("tiny", "tiny-loo-tis", "staleness.max_lag-2_seed-1", "probe-b64", "A_1"):
        assert load_config(None, [f"name={name}"]).name == name
