"""How the ``swe`` environment runs a library's tests and learns their outcomes.

Every run, trusted (validating bugs on the host) or not (the model's code in the sandbox),
goes through one small program, ``RUNNER``, executed by the test interpreter: it sets the
test environment (``TEST_ENV``: a fixed hash seed, so set order and parameter ids repeat),
puts the library's import root first on ``sys.path``, runs pytest with a plugin that
records each test's outcome, and writes them as JSON to a report file named by the caller.

Why a report file and not pytest's printed summary: the code under test runs in the same
interpreter and can print anything, e.g. ``PASSED tests/test_x.py::test_y`` from an
``atexit`` hook after pytest's own summary. What it prints is only shown to the model;
grading reads the report, which the runner writes after pytest returns and then leaves with
``os._exit`` (no ``atexit`` hook of the code under test runs after it). The report is
refused (no outcomes: every test counts as failing) when the package was imported from
anywhere but the tree under test (a deleted package falling back to a copy installed in the
system, e.g. Debian's ``more_itertools``) or when the file is not a plain file.

What this cannot stop: code under test that patches pytest's internals or the runner
itself while it runs (it shares the interpreter). The grader's other defences (pristine
tests, only the package's modules taken from the model) are in ``env.py``.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

TEST_PYTHON = "/usr/bin/python3"
"""The interpreter tests run under, on the host and in the sandbox (world-readable, with
Debian's pytest: ``apt-get install python3-pytest``)."""
TEST_ENV = {"LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
"""Test runs' environment, here and in the sandbox. A fixed hash seed keeps outcomes and
test ids stable (some suites build parameter ids from set order)."""
PASSING = ("PASSED", "XFAIL")
FAILING = ("FAILED", "ERROR")
MAX_REPORT_BYTES = 8 * 1024 * 1024
MAX_MESSAGE_CHARS = 300

_BOOT = "import sys; exec(sys.argv[1])"
# The runner, run as ``python -c _BOOT RUNNER env_json root import_root package report
# pytest-args...``. It re-executes itself once under TEST_ENV (the hash seed is read at
# start-up), records outcomes through a plugin, and ends with os._exit after the report.
RUNNER = r"""
import json, os, sys
env = json.loads(sys.argv[2])
if any(os.environ.get(k) != v for k, v in env.items()):
    boot = "import sys; exec(sys.argv[1])"
    os.execve(sys.executable, [sys.executable, "-c", boot, *sys.argv[1:]], {**os.environ, **env})
root, import_root, package, report = sys.argv[3:7]
args = sys.argv[7:]
os.chdir(root)
sys.path.insert(0, os.path.realpath(import_root))
results = {}


def message(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        where = os.path.relpath(str(crash.path), root)
        if where.startswith(".."):
            where = os.path.basename(str(crash.path))
        return f"{where}:{crash.lineno}: {crash.message}"
    lines = [line for line in str(report.longrepr or "").splitlines() if line.strip()]
    return "\n".join(lines[-3:])


class Recorder:
    def pytest_runtest_logreport(self, report):
        if report.failed:
            outcome = "FAILED" if report.when == "call" else "ERROR"
        elif hasattr(report, "wasxfail"):
            outcome = "XFAIL" if report.skipped else "XPASS"
        elif report.skipped:
            outcome = "SKIPPED"
        elif report.when == "call":
            outcome = "PASSED"
        else:
            return  # a passing setup or teardown: the call decides
        previous = results.get(report.nodeid)
        if previous is None or previous[0] not in ("FAILED", "ERROR"):
            results[report.nodeid] = [outcome, message(report) if report.failed else ""]

    def pytest_collectreport(self, report):
        if report.failed:
            results[report.nodeid or "<collection>"] = ["ERROR", message(report)]


import pytest

code = pytest.main(args, plugins=[Recorder()])
module = sys.modules.get(package)
if module is not None:
    where = os.path.realpath(getattr(module, "__file__", None) or "/")
    if not where.startswith(os.path.realpath(root) + os.sep):
        print(f"error: {package} was imported from {where}, not from the library's tree; "
              "no outcome counts", file=sys.stderr)
        results, code = {}, 3
with open(report, "x") as f:
    json.dump(results, f)
sys.stdout.flush()
sys.stderr.flush()
os._exit(int(code))
"""
PYTEST_ARGS = ("-q", "--tb=short", "-p", "no:cacheprovider", "--rootdir", ".")
"""Quiet, short tracebacks (shown to the model when nothing ran), no cache files."""
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


@dataclass
class TestRun:
    """Per-test outcomes of one run (PASSED, FAILED, ERROR, SKIPPED, XFAIL or XPASS), the
    failures' one-line messages, the exit status and the output's tail. No outcomes at all
    means nothing ran, or the run's report was refused."""

    outcomes: dict[str, str] = field(default_factory=dict)
    returncode: int = 0
    tail: str = ""
    messages: dict[str, str] = field(default_factory=dict)

    def passed(self) -> set[str]:
        return {t for t, o in self.outcomes.items() if o in PASSING}

    def failed(self) -> list[str]:
        return sorted(t for t, o in self.outcomes.items() if o in FAILING)


def package_name(package_dir: str) -> str:
    """The import name of a package directory inside the sdist (``src/isodate`` -> isodate)."""
    return Path(package_dir).name


def runner_argv(
    root: str, import_root: str, package: str, report: str, paths: list[str]
) -> list[str]:
    """The command line that runs pytest on ``paths`` in ``root`` (as the running program
    sees them) and writes the outcomes to ``report``, which must not exist yet."""
    return [
        TEST_PYTHON, "-c", _BOOT, RUNNER, json.dumps(TEST_ENV), root, import_root, package,
        report, *PYTEST_ARGS, *paths,
    ]  # fmt: skip


def read_report(path: Path, returncode: int, output: str) -> TestRun:
    """The run's outcomes from its report (then deleted). A missing report (the run was
    killed or left early), a link or a non-regular file, an oversized or malformed one all
    give no outcomes."""
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and info.st_size <= MAX_REPORT_BYTES:
                with os.fdopen(fd, "rb") as f:
                    fd = -1
                    data = json.loads(f.read().decode(errors="replace"))
                outcomes, messages = _parse(data)
        except (OSError, ValueError):
            outcomes, messages = {}, {}
        finally:
            if fd >= 0:
                os.close(fd)
    path.unlink(missing_ok=True)
    return TestRun(outcomes, returncode, _sanitize(output[-3000:]), messages)


def _parse(data: object) -> tuple[dict[str, str], dict[str, str]]:
    if not isinstance(data, dict):
        return {}, {}
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for test, value in data.items():
        if not (
            isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)
        ):
            return {}, {}
        outcomes[str(test)] = value[0]
        if value[1]:
            messages[str(test)] = _sanitize(value[1])[:MAX_MESSAGE_CHARS]
    return outcomes, messages


def _sanitize(text: str) -> str:
    """Object addresses vary between runs; the observations of a replayed episode must not."""
    return _ADDRESS.sub("0x…", text)


def run_tests_on_host(
    root: Path, import_root: str, package: str, paths: list[str], timeout_s: float
) -> TestRun:
    """Run the tests of a tree the project made itself (pristine or with a validated bug:
    no model's code) as a plain subprocess. Returncode -1: it ran past ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix="turnrl-swe-") as tmp:
        report = Path(tmp) / "report.json"
        argv = runner_argv(str(root), import_root, package, str(report), paths)
        try:
            done = subprocess.run(
                argv, cwd=root, env={"PATH": "/usr/bin:/bin", **TEST_ENV},
                capture_output=True, text=True, timeout=timeout_s,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return TestRun({}, -1, "timed out")
        return read_report(report, done.returncode, done.stdout + done.stderr)
