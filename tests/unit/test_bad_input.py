"""Bad input is one line and exit 2, naming the place: malformed YAML (file and line), an empty or
unreadable dataset, a bad row (file and line). A launch that fails its checks leaves no run
directory behind."""

import pytest

from conftest import ROOT
from tidal.ops.cli import main


def tidal_run(tmp_path, capsys, config, *overrides) -> str:
    assert main(["run", str(config), f"run_dir={tmp_path / 'run'}", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert not (tmp_path / "run").exists()
    return err[0]


def test_malformed_yaml_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nlearner:\n  max_steps: [1\n")
    assert f"{bad}:4: not valid YAML" in tidal_run(tmp_path, capsys, bad)


@pytest.mark.parametrize(
    "content, says",
    [
        ("", "the file is empty (task.data_path)"),
        ('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?"\n', "data.jsonl:2: not valid JSON"),
        ('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?", "answer": 4}\n', "data.jsonl:2: 'answer' is int 4"),
        ("\x00\x01\x02", "data.jsonl:1:"),
    ],
)
def test_a_bad_dataset_is_one_line_before_anything_starts(tmp_path, capsys, content, says):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    message = tidal_run(
        tmp_path,
        capsys,
        ROOT / "configs/math.yaml",
        f"task.data_path={data}",
        "task.num_val=1",
        f"model.path={tmp_path}",
    )
    assert says in message


def test_a_missing_model_folder_is_one_line(tmp_path, capsys):
    assert "is not a Hugging Face model folder" in tidal_run(
        tmp_path, capsys, ROOT / "configs/tiny.yaml", f"model.path={tmp_path / 'nothing'}"
    )


def test_tidal_run_refuses_curve_off(tmp_path, capsys):
    """A run authenticates every actor, loopback included: curve=off is for a role started on its own."""
    assert "broker.zmq.curve=off" in tidal_run(tmp_path, capsys, ROOT / "configs/tiny.yaml", "broker.zmq.curve=off")


# ---- tidal fit and tidal sweep ----------------------------------------------------------------------------


def tidal_analysis(capsys, *args) -> str:
    """`tidal fit|sweep ARGS` fails as one line naming what is wrong, exit 2."""
    from tidal.ops.cli import main

    assert main(list(args)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_fit_on_a_store_that_is_not_there_is_one_line_and_makes_none(tmp_path, capsys):
    store = tmp_path / "mlfow.db"  # a typo'd store: opening it would make an empty one
    line = tidal_analysis(capsys, "fit", "--runs", "abc", "--tracking-uri", f"sqlite:///{store}")
    assert line == f"tidal fit: sqlite:///{store}: no such MLflow store ({store} does not exist)"
    assert not store.exists()


def test_fit_on_a_run_the_store_lacks_names_it_and_the_runs_it_holds(tmp_path, capsys, monkeypatch):
    from types import SimpleNamespace

    import mlflow.tracking
    from mlflow.exceptions import MlflowException

    class Store:  # an MLflow store holding one run, as MlflowClient answers for it
        def __init__(self, uri):
            self.uri = uri

        def get_run(self, run_id):
            raise MlflowException(f"Run with id={run_id} not\nfound")

        def search_experiments(self):
            return [SimpleNamespace(experiment_id="0")]

        def search_runs(self, experiment_ids, max_results):
            return [SimpleNamespace(info=SimpleNamespace(run_id="3dc6dba4", run_name="tiny-20261205"))]

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", Store)
    line = tidal_analysis(capsys, "fit", "--runs", "tiny-20261205", "--tracking-uri", "http://mlflow:5000")
    assert line == (
        "tidal fit: run 'tiny-20261205' in http://mlflow:5000: Run with id=tiny-20261205 not found; "
        "it holds: 3dc6dba4 (tiny-20261205)"
    )
    # plan-batch reads its runs before minutes of probing, and says the same in one line
    import tidal.ops.plan_batch

    monkeypatch.setattr(tidal.ops.plan_batch, "probe", lambda *a: pytest.fail("probed before reading the runs"))
    line = tidal_analysis(
        capsys, "plan-batch", "tiny", "--runs", "tiny-20261205", "--tracking-uri", "http://mlflow:5000"
    )
    assert line == (
        "tidal plan-batch: run 'tiny-20261205' in http://mlflow:5000: Run with id=tiny-20261205 not "
        "found; it holds: 3dc6dba4 (tiny-20261205)"
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["--batch-sizes", "4,x"], "--batch-sizes 4,x: prompt groups per step, whole numbers >= 1"),
        (["--runs", "abc"], "--runs needs --tracking-uri URI"),
        (["--out", "/no/such/folder/plan.png"], "--out /no/such/folder/plan.png: the folder /no/such/folder does not"),
        (["--eval-every-groups", "0"], "--eval-every-groups 0: a number of prompt groups, >= 1"),
    ],
)
def test_plan_batch_flags_are_checked_before_measuring(capsys, monkeypatch, args, says):
    import tidal.ops.plan_batch

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tidal.ops.plan_batch, "probe", lambda *a: pytest.fail("probed before checking the flags"))
    assert tidal_analysis(capsys, "plan-batch", "tiny", *args).startswith(f"tidal plan-batch: {says}")


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "Is a directory"),
        (b"\xff\xfe\x00\x01", "not a text CSV"),
        (b"compute,pass_rate\n1," + b"5" * 200_000 + b"\n", "not a text CSV"),  # past the csv module's field limit
    ],
)
def test_fit_on_a_file_that_is_not_a_csv_is_one_line(tmp_path, capsys, content, says):
    path = tmp_path / "curve.csv"
    path.mkdir() if content is None else path.write_bytes(content)
    assert tidal_analysis(capsys, "fit", "--csv", str(path)) == f"tidal fit: {path}: {says}" + (
        "" if content is None else " (a header compute,pass_rate, then a row per point)"
    )


def test_fit_without_input_says_what_it_needs_once(capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tidal_analysis(capsys, "fit").startswith("tidal fit: needs --csv FILE, or --runs RUN_ID")


def test_a_sweep_checks_every_point_of_its_grid_before_it_runs_any(tmp_path, capsys, monkeypatch):
    """A bad value at the grid's last point used to surface only after the runs before it."""
    import tidal.ops.launcher

    monkeypatch.setattr(tidal.ops.launcher, "launch", lambda cfg: pytest.fail(f"ran {cfg.run_dir} before the check"))
    out = tmp_path / "sweep"
    line = tidal_analysis(capsys, "sweep", "tiny", "learner.max_steps=1,x", "--out", str(out))
    assert line.startswith("tidal sweep: config key 'learner.max_steps': Value 'x'")
    assert not out.exists()


def test_a_sweep_into_a_file_is_one_line(tmp_path, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    line = tidal_analysis(capsys, "sweep", "tiny", "staleness.max_lag=0,2", "--out", str(taken))
    assert line == f"tidal sweep: --out {taken} exists and is not a folder: give a new or existing folder"
    assert taken.read_text() == "mine"


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--predict", "-5"], "--predict -5: the compute to predict the pass rate at must be > 0"),
        (["--predict", "nan"], "--predict nan: the compute to predict the pass rate at must be > 0"),
        (
            ["--out", "/no/such/folder/fit.png"],
            "--out /no/such/folder/fit.png: the folder /no/such/folder does not exist",
        ),
    ],
)
def test_fit_flags_that_cannot_work_are_one_line_before_any_fit(tmp_path, capsys, flags, says):
    curve = tmp_path / "curve.csv"
    curve.write_text("compute,pass_rate\n" + "".join(f"{2**i},{0.1 + i / 40}\n" for i in range(12)))
    out = [] if "--out" in flags else ["--out", str(tmp_path / "fit.png")]
    assert tidal_analysis(capsys, "fit", "--csv", str(curve), *flags, *out) == f"tidal fit: {says}"
    assert not (tmp_path / "fit.png").exists()


@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            ["task.reward_funcs=[no_such_module:accuracy]"],
            "config key 'task.reward_funcs' entry 'no_such_module:accuracy': cannot import no_such_module",
        ),
        (
            ["task.reward_funcs=[math:sqrt,math:floor]", "task.reward_weights=[1.0]"],
            "config key 'task.reward_weights' = [1.0]: one weight per reward function (2 in task.reward_funcs)",
        ),
    ],
)
def test_reward_functions_that_cannot_be_used_are_one_line(tmp_path, capsys, overrides, says):
    data = tmp_path / "data.jsonl"
    data.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?", "answer": "4"}\n')
    message = tidal_run(
        tmp_path,
        capsys,
        ROOT / "configs/math.yaml",
        f"task.data_path={data}",
        "task.num_val=1",
        f"model.path={tmp_path}",
        *overrides,
    )
    assert says in message


@pytest.mark.parametrize(
    "override, says",
    [
        (
            "actor.vllm.engine_kwargs={enable_chunked_prefil: true}",
            "config key 'actor.vllm.engine_kwargs' = {'enable_chunked_prefil': True}: vLLM's engine has no argument "
            "enable_chunked_prefil",
        ),
        ("env.tool_parser=hermez", "config key 'env.tool_parser' = 'hermez': vLLM has no such tool parser (apertus"),
    ],
)
def test_names_vllm_does_not_know_stop_at_preflight(override, says):
    """The actor found these out after every process had started."""
    from tidal.config import ConfigError, load_config
    from tidal.ops.preflight import preflight

    with pytest.raises(ConfigError) as err:
        preflight(load_config("configs/tiny.yaml", [override, "task.num_val=4"]))
    assert str(err.value).startswith(says)


@pytest.mark.parametrize(
    "preset, override, says",
    [
        (
            "tiny",
            "task.kwargs.partial_credi=0.1",
            "config key 'task.kwargs.partial_credi': task arithmetic has no such option (its options: partial_credit (",
        ),
        ("long", "task.kwargs.span=3", "config key 'task.kwargs.span': task count has no such option (it takes none)"),
        ("agent", "env.kwargs.keys=5", "config key 'env.kwargs.keys': Environment has no such option (it takes none)"),
    ],
)
def test_a_task_or_environment_option_it_does_not_take_stops_at_preflight(preset, override, says):
    """A misspelt option was silently ignored: the run went on without it."""
    from tidal.config import ConfigError, load_config
    from tidal.ops.preflight import preflight

    with pytest.raises(ConfigError) as err:
        preflight(load_config(f"configs/{preset}.yaml", [override]))
    assert str(err.value).startswith(says)


def test_an_actor_started_alone_without_the_learners_ports_is_one_line(capsys):
    """It failed once its engine was up, minutes into a pod's start on a large model."""
    from tidal.ops.cli import main

    assert main(["actor", "tiny", "broker.zmq.curve=off", "broker.zmq.control_port=5555"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("tidal actor: config key 'broker.zmq.rollout_port' = 0: an actor started on its own")


# ---- overrides, tools, reward files, export: each one line naming what to fix ---------------------------


def tidal_says(capsys, *args) -> str:
    """`tidal ARGS` fails as one line on stderr, exit 2."""
    assert main(list(args)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["run", "tiny", "learner.max_steps"],
            "tidal run: 'learner.max_steps' has no value: overrides are key=value (learner.max_steps=VALUE)",
        ),
        (
            ["config", "check", "tiny", "task.reward_funcs=[my_rewards:accuracy"],
            "tidal config: override 'task.reward_funcs=[my_rewards:accuracy': its value is not valid YAML "
            "(did not find expected ',' or ']'): close its brackets (task.reward_funcs=[a, b])",
        ),
        (
            ["config", "check", "tiny", "task.system_prompt=[answer"],
            "tidal config: override 'task.system_prompt=[answer': its value is not valid YAML "
            "(did not find expected ',' or ']'): quote it to pass it as text (\"task.system_prompt='[answer'\")",
        ),
        (
            ["config", "check", "tiny", "task.prompt_template={prompt}"],
            "tidal config: config key 'task.prompt_template': {prompt} was read as a mapping, not text: quote it, "
            "\"task.prompt_template='{prompt}'\"",
        ),
        (
            ["config", "check", "tiny", "--gpu-gib", "80", "--model-config", "nope.json"],
            "tidal config: --model-config nope.json: no such file or folder (the model's config.json, or its folder)",
        ),
    ],
)
def test_a_mistyped_command_line_is_one_line_saying_how_to_write_it(capsys, args, says):
    assert tidal_says(capsys, *args) == says


def test_exporting_a_folder_that_is_no_run_says_so(tmp_path, capsys):
    """It said the folder's config.yaml was no preset, and listed the presets."""
    assert (
        tidal_says(capsys, "export", str(tmp_path / "nope-run"))
        == f"tidal export: no run folder at {tmp_path / 'nope-run'} (no config.yaml there)"
    )


CALC = """
from tidal.tasks import Env, Turn
from tidal.tasks.arithmetic import load_prompts  # noqa: F401


def mul(a: int, b: int) -> int:
    return a * b


class Environment(Env):
    def tools(self):
        return [mul]

    def step(self, state, reply):
        return Turn(done=True, reward=1.0)
"""


def test_a_tool_without_a_docstring_is_one_line_at_its_def(tmp_path, capsys, monkeypatch):
    """It was a 30-line traceback from `config check`."""
    import sys

    (tmp_path / "my_calc").mkdir()
    (tmp_path / "my_calc" / "__init__.py").write_text("")
    (tmp_path / "my_calc" / "task.py").write_text(CALC)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("my_calc", "my_calc.task"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    line = tidal_says(capsys, "config", "check", "tiny", "task.name=my_calc.task")
    assert line == (
        f"tidal config: tool 'mul' at {tmp_path / 'my_calc' / 'task.py'}:6: Cannot generate JSON schema "
        "for mul because it has no docstring! (a tool needs type hints and a docstring with an Args: "
        "line per parameter)"
    )


def test_a_prompt_template_the_task_would_ignore_is_refused(tmp_path, capsys):
    """task rows sent each row's prompt as it was, whatever the template said."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    line = tidal_says(
        capsys,
        "config",
        "check",
        "tiny",
        "task.name=rows",
        f"task.data_path={data}",
        "task.num_val=1",
        "task.prompt_field=prompt",
        "task.reward_funcs=[math:floor]",
        "task.prompt_template='Q: {prompt}'",
    )
    assert line == (
        "tidal config: config key 'task.prompt_template' = 'Q: {prompt}': task rows sends each row's "
        "prompt as it is; the template is for task math (put the text into the prompts, or leave "
        "task.prompt_template unset)"
    )
