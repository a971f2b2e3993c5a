"""What a user meets around the edges: output piped into a reader that stops early (`| head`) ends
quietly, and an exported model's files have the modes the user's umask gives every other file."""

import os
import stat
import subprocess
import sys

import pytest

from conftest import ALPHABET, ROOT, TINY
from tidal.ops.cli import CLOSED_PIPE_EXIT, main_to_a_pipe


def tidal_into_a_closed_pipe(*args: str, unbuffered: bool, errors_too: bool = False) -> subprocess.CompletedProcess:
    """`tidal ARGS | true`, made certain: the pipe's reading end is closed before tidal writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | (
        {"PYTHONUNBUFFERED": "1"} if unbuffered else {}
    )
    try:
        return subprocess.run(
            [sys.executable, "-m", "tidal", *args],
            stdout=write_end,
            stderr=write_end if errors_too else subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize("unbuffered", [True, False])
@pytest.mark.parametrize("args", [("presets",), ("config", "show", "tiny"), ("config", "explain")])
def test_output_into_a_reader_that_stopped_ends_quietly(args, unbuffered):
    done = tidal_into_a_closed_pipe(*args, unbuffered=unbuffered)
    assert (done.returncode, done.stderr) == (CLOSED_PIPE_EXIT, "")


def test_an_error_line_into_a_reader_that_stopped_ends_quietly():
    """`tidal fit --csv missing.csv 2>&1 | head`: the error line itself meets the closed pipe."""
    done = tidal_into_a_closed_pipe("fit", "--csv", "missing.csv", unbuffered=False, errors_too=True)
    assert done.returncode == CLOSED_PIPE_EXIT


def test_a_broken_pipe_that_is_not_the_output_is_still_raised(monkeypatch):
    """A socket whose peer went away is an error of the run, not a reader that stopped."""
    import tidal.ops.cli

    def broken(argv):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(tidal.ops.cli, "main", broken)
    with pytest.raises(BrokenPipeError):
        main_to_a_pipe([])


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_an_exported_model_has_the_modes_of_the_users_umask(tmp_path, umask, mode):
    from tidal.learner.tools.export import export_model
    from tidal.tiny import build_tiny_model, save_model

    model, tokenizer = build_tiny_model(TINY, ALPHABET, seed=0)
    save_model(model, tokenizer, tmp_path / "base")
    old = os.umask(umask)
    try:
        out = export_model(model, str(tmp_path / "base"), tmp_path / "exported", "float32")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {mode}, modes


def test_the_readme_says_what_tidal_does_not_do_yet_and_names_the_pinned_vllm():
    import re
    import tomllib

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## What tidal does not do yet\n")[1].split("\n## ")[0]
    assert len(re.findall(r"^- \*\*", section, re.M)) >= 5  # a short list, one bold topic an item
    pinned = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert f"vLLM only, at {next(p for p in pinned if p.startswith('vllm==')).removeprefix('vllm==')}" in section
