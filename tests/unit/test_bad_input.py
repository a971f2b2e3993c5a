"""Bad input is one line and exit 2, naming the place: malformed YAML (file and line), an empty or
unreadable dataset, a bad row (file and line). A launch that fails its checks leaves no run
directory behind."""
import pytest

from conftest import ROOT
from tidal.cli import main


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


@pytest.mark.parametrize("content, says", [
    ("", "the file is empty (task.data_path)"),
    ('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?"\n', "data.jsonl:2: not valid JSON"),
    ('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?", "answer": 4}\n', "data.jsonl:2: 'answer' is int 4"),
    ("\x00\x01\x02", "data.jsonl:1:"),
])
def test_a_bad_dataset_is_one_line_before_anything_starts(tmp_path, capsys, content, says):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    message = tidal_run(tmp_path, capsys, ROOT / "configs/math.yaml", f"task.data_path={data}", "task.num_val=1",
                        f"model.path={tmp_path}")
    assert says in message


def test_a_missing_model_folder_is_one_line(tmp_path, capsys):
    assert "is not a Hugging Face model folder" in tidal_run(tmp_path, capsys, ROOT / "configs/tiny.yaml",
                                                             f"model.path={tmp_path / 'nothing'}")


def test_tidal_run_refuses_curve_off(tmp_path, capsys):
    """A run authenticates every actor, loopback included: curve=off is for a role started on its own."""
    assert "broker.zmq.curve=off" in tidal_run(tmp_path, capsys, ROOT / "configs/tiny.yaml", "broker.zmq.curve=off")
