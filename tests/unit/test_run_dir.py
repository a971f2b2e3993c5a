"""Two runs never mix: a run_dir that holds a run is continued (--resume), deleted first (--overwrite) or
refused in one line, by `tidal run` and by `tidal learner` alike."""

import subprocess
import sys

from tidal.ops.launcher import check_run_dir, overwrite_run_dir


def test_a_new_or_empty_folder_takes_a_run(tmp_path):
    assert check_run_dir(tmp_path / "new", None, False)
    assert check_run_dir(tmp_path, None, False)  # exists, holds nothing of a run


def test_a_folder_holding_a_run_is_refused_in_one_line_naming_the_ways_on(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("name: tiny\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert not check_run_dir(tmp_path, None, False)
    [line] = capsys.readouterr().err.splitlines()
    assert line == (
        f"tidal run: run_dir={tmp_path} holds a run already (metrics.jsonl, config.yaml): pass "
        "--resume to continue it, --overwrite to start over in it (its files are deleted), or choose "
        "another run_dir"
    )
    assert (tmp_path / "metrics.jsonl").exists()  # nothing touched
    assert check_run_dir(tmp_path, "required", False)


def test_overwrite_deletes_a_run_tidal_made_and_nothing_else(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: tiny\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert check_run_dir(run, None, True) and run.exists()  # deleted only once every other check passed
    overwrite_run_dir(run)
    assert not run.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text("my own file\n")
    assert not check_run_dir(mine, None, True) and (mine / "metrics.jsonl").exists()
    assert "--overwrite deletes only a folder tidal made" in capsys.readouterr().err
    assert not check_run_dir(run, "required", True)  # both: which one was meant?


def test_the_learner_alone_refuses_a_run_dir_with_a_run_unless_resumed(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    done = subprocess.run(
        [sys.executable, "-m", "tidal", "learner", "tiny", f"run_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"tidal learner: run_dir={tmp_path} holds a run already (metrics.jsonl): pass --resume to continue it, or "
        "choose another run_dir"
    )
