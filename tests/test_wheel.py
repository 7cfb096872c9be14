"""The built wheel works on its own: installed into a fresh virtualenv and run from a
directory outside the repository, it finds everything it reads at run time (recipes
included), trains, and passes `turnrl doctor`. The torch-free layers (environments, tools,
formats, recipes) also run on every other CPython the machine has (3.10 and up).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
TINY_RUN = [  # the quick-start, shrunk to seconds
    "steps=2", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
    "model.tiny.num_heads=2", "model.tiny.vocab_size=512", "model.tiny.echo_steps=0",
    "warmup.steps=2", "eval.num_tasks=4",
    "rollout.prompts_per_step=2", "rollout.group_size=2",
]  # fmt: skip
OTHER_PYTHONS = sorted(  # pyenv's interpreters, where the machine has them
    p
    for p in Path(os.environ.get("PYENV_ROOT", "/root/.pyenv")).glob("versions/3.*/bin/python3")
    if p.parent.parent.name.split(".")[1].isdigit()
    and int(p.parent.parent.name.split(".")[1]) >= 10
)


def run(*args: str | Path, cwd: Path, timeout: float = 300) -> str:
    """Run a command; on failure, fail the test with its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{args} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", out, ROOT, cwd=out)
    (built,) = out.glob("turnrl-*.whl")
    return built


def test_the_wheel_ships_what_is_read_at_run_time(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {Path(n).name for n in names if n.startswith("turnrl/recipes/")}
    assert shipped == {p.name for p in (ROOT / "src/turnrl/recipes").glob("*.toml")}
    assert "quickstart.toml" in shipped


def test_the_installed_wheel_lists_trains_and_passes_doctor(wheel: Path, tmp_path: Path) -> None:
    venv, outside = tmp_path / "venv", tmp_path / "elsewhere"
    outside.mkdir()
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python, turnrl = venv / "bin" / "python", venv / "bin" / "turnrl"
    torch_spec = f"torch=={torch.__version__.split('+')[0]}"  # the CPU wheel on disk here
    run(python, "-m", "pip", "install", "--quiet", "--no-compile", "-c", LOCK, torch_spec, wheel, cwd=outside)  # fmt: skip
    where = run(python, "-c", "import turnrl; print(turnrl.__file__)", cwd=outside)
    assert str(venv) in where, where
    assert str(ROOT) not in where, where

    assert "secret_lookup" in run(turnrl, "envs", "list", cwd=outside)
    sets = [arg for option in TINY_RUN for arg in ("--set", option)]
    run(turnrl, "train", *sets, "--out", tmp_path / "run", cwd=outside)
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if "loss/policy" in r] == [1, 2]
    assert (tmp_path / "run" / "report.html").is_file()
    doctor = run(turnrl, "doctor", cwd=outside)
    assert "ok   rl run" in doctor, doctor


@pytest.mark.parametrize("python", OTHER_PYTHONS, ids=lambda p: p.parent.parent.name)
def test_the_torch_free_layers_run_on_each_python(
    python: Path, wheel: Path, tmp_path: Path
) -> None:
    """No torch wheel for these interpreters lies on disk (a CUDA build is gigabytes), so
    the wheel goes in without dependencies: every module must compile, and the layers an
    environment author uses must work (recipes parse, an environment passes its check)."""
    venv = tmp_path / "venv"
    run(python, "-m", "venv", venv, cwd=tmp_path)
    py = venv / "bin" / "python"
    run(py, "-m", "pip", "install", "--quiet", "--no-deps", wheel, "tomli>=2; python_version<'3.11'", cwd=tmp_path)  # fmt: skip
    package = run(
        py, "-c", "import turnrl, os; print(os.path.dirname(turnrl.__file__))", cwd=tmp_path
    ).strip()
    run(py, "-m", "compileall", "-q", "-f", package, cwd=tmp_path)
    recipes = run(py, "-c", (
        "from turnrl.trainer.config import RECIPES_DIR, load_config\n"
        "names = sorted(p.stem for p in RECIPES_DIR.glob('*.toml'))\n"
        "print(len([load_config(n) for n in names]))"
    ), cwd=tmp_path)  # fmt: skip
    assert int(recipes) == len(list((ROOT / "src/turnrl/recipes").glob("*.toml")))
    assert "passed" in run(venv / "bin" / "turnrl", "envs", "check", "secret_lookup", cwd=tmp_path)
