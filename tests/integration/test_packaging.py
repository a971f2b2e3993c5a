"""tidal as users install it: the wheel builds without a warning of tidal's own, carries every
subpackage and the presets, and `tidal` works from any folder by preset name. The wheel goes into a
fresh virtual environment whose dependencies come from this one (installing torch and vLLM again
would not fit CI)."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_the_wheel_runs_presets_by_name_from_any_folder(tmp_path, tiny_model_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    # the build says nothing of tidal's packaging (a folder of presets it would import but not list, ...);
    # byte-compiling is off where PYTHONDONTWRITEBYTECODE is set, which is the machine's doing
    warned = [
        line
        for line in (built.stdout + built.stderr).splitlines()
        if "warn" in line.lower() and "byte-compiling is disabled" not in line
    ]
    assert warned == [], "\n".join(warned)
    [wheel] = (tmp_path / "dist").glob("tidal-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "-q", "--no-deps", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    # the dependencies (torch, vLLM, ...) from this environment, after the wheel's own files
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "zz-dependencies.pth").write_text("\n".join(deps) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def tidal(*args):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return subprocess.run(
            [str(venv / "bin/tidal"), *args], cwd=elsewhere, capture_output=True, text=True, timeout=300, env=env
        )

    where = subprocess.run(
        [
            str(venv / "bin/python"),
            "-c",
            "import tidal.broker.weights, tidal.presets, "
            "tidal.learner.rank0.loop, tidal.actor.loop; print(tidal.presets.__file__)",
        ],
        cwd=elsewhere,
        capture_output=True,
        text=True,
    )
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(site)  # the wheel's copy, not this checkout
    listed = tidal("presets")
    assert listed.returncode == 0 and {"tiny", "long", "math", "scalerl", "loo/tiny-loo-sync"} <= {
        line.split()[0] for line in listed.stdout.splitlines()
    }
    assert tidal("run", "tiny", "--help").returncode == 0
    prepared = tidal("prepare", "tiny")  # the preset by name, its model found in the cache
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    assert prepared.stdout.strip().splitlines()[-1] == tiny_model_path
    missing = tidal("prepare", "no-such-preset")
    assert missing.returncode == 2 and "not a preset (agent, long, loo/tiny-loo-group-norm" in missing.stderr
