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
        '-m "not learning and not serial"',
        '-m "learning or serial"',
    ):
        assert step in commands, step
    if shutil.which("nvidia-smi") is None:  # a CPU machine: the vLLM tests in their venv
        assert "-m vllm" in commands
        assert "tests/test_vllm_learning.py" in commands  # their learning test among them
