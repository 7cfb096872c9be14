"""Real libraries for the ``swe`` environment: pinned PyPI source distributions with their
own test suites, fetched once and cached, and the bugs that their tests catch.

``Library.fetch()`` downloads the sdist (``pip download --no-binary :all: --no-deps``) into
the cache (``$TURNRL_CACHE/swe``, default ``~/.cache/turnrl/swe``) and unpacks it.
``baseline()`` runs the pristine test suite once and keeps which tests pass.
``mutants(limit)`` tries single-site AST mutations (``mutate.candidates``) of the package's
modules, seeded order, and keeps a mutant only when at least one passing test fails with
it: the bug is real and the tests see it. Results are cached as JSON next to the sdist, so
building the task list is paid once per machine.

Tests here run as ordinary subprocesses of Debian's ``/usr/bin/python3`` with its pytest
(``apt-get install python3-pytest``; ``make setup`` does): the code is the library's own,
mutated by us, never the model's. The model's edits run only in the sandbox.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from turnrl.envs.swe.mutate import Mutation, apply, candidates
from turnrl.errors import ConfigError

TEST_PYTHON = "/usr/bin/python3"
"""The interpreter tests run under, here and in the sandbox (world-readable, has pytest)."""

TEST_ENV = {"LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
"""Test runs' environment, here and in the sandbox. A fixed hash seed keeps test ids
stable: some suites build parameter ids from set order (isodate's ``expectedN``)."""
CACHE_FORMAT = 2
"""Bumped when cached baselines or mutants would no longer match (v2: fixed hash seed)."""

_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (\S+)", re.MULTILINE)


@dataclass(frozen=True)
class Library:
    """A pinned pure-Python library whose sdist ships its tests."""

    name: str
    version: str
    package: str
    """The import package's directory inside the sdist (e.g. ``toolz``)."""
    tests: str
    """The tests' directory inside the sdist (e.g. ``toolz/tests``)."""
    modules: tuple[str, ...] = ()
    """Package modules to mutate (paths inside the sdist); empty: every non-test module."""
    import_root: str = "."
    """Where the package is imported from, inside the sdist (``src`` for a src layout)."""

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"


@dataclass(frozen=True)
class Mutant:
    """A validated bug: where, what, and which tests it breaks."""

    library: str
    path: str
    mutation: Mutation
    fail_to_pass: tuple[str, ...]
    """Tests that pass on the pristine library and fail with the bug."""


@dataclass
class TestRun:
    """Per-test outcomes of one pytest run, its exit status and its output's tail."""

    outcomes: dict[str, str] = field(default_factory=dict)
    returncode: int = 0
    tail: str = ""

    def passed(self) -> set[str]:
        return {t for t, o in self.outcomes.items() if o in ("PASSED", "XFAIL")}


def cache_root() -> Path:
    return Path(os.environ.get("TURNRL_CACHE", Path.home() / ".cache" / "turnrl")) / "swe"


def parse_outcomes(text: str) -> dict[str, str]:
    """``-rA`` summary lines -> {test id: PASSED | FAILED | ERROR | XFAIL | XPASS}."""
    return {m.group(2): m.group(1) for m in _OUTCOME.finditer(text)}


def pytest_argv(paths: list[str]) -> list[str]:
    """The pytest command line (after the interpreter) used everywhere: quiet, a summary
    line per test, no cache files, no plugins from the environment."""
    return ["-m", "pytest", "-q", "-rA", "--tb=line", "-p", "no:cacheprovider", *paths]


def run_pytest(
    root: Path, paths: list[str], timeout_s: float = 120.0, import_root: str = "."
) -> TestRun:
    """Run the library's tests in ``root`` as a plain subprocess (trusted code only)."""
    env = {**TEST_ENV, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(root / import_root)}
    try:
        done = subprocess.run(
            [TEST_PYTHON, *pytest_argv(paths)], cwd=root, env=env, capture_output=True,
            text=True, timeout=timeout_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return TestRun({}, -1, "timed out")
    text = done.stdout + done.stderr
    return TestRun(parse_outcomes(text), done.returncode, text[-2000:])


def check_test_python() -> None:
    """Refuse early, with the fix, when the test interpreter lacks pytest."""
    probe = subprocess.run([TEST_PYTHON, "-c", "import pytest"], capture_output=True)
    if probe.returncode != 0:
        raise ConfigError(
            f"the swe environment runs tests with {TEST_PYTHON} and its pytest, which is "
            "missing: apt-get install python3-pytest (`make setup` installs it)"
        )


class Checkout:
    """A library fetched into the cache: its pristine tree, baseline and mutants."""

    def __init__(self, library: Library, root: Path | None = None) -> None:
        self.library = library
        self.dir = (root or cache_root()) / f"{library.key}-v{CACHE_FORMAT}"
        self.tree = self.dir / "src"

    def fetch(self) -> Path:
        """Download and unpack the sdist once; return the pristine tree."""
        if (self.tree / self.library.package).is_dir():
            return self.tree
        self.dir.mkdir(parents=True, exist_ok=True)
        spec = f"{self.library.name}=={self.library.version}"
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
             "--quiet", "-d", str(self.dir), spec],
            capture_output=True, text=True,
        )  # fmt: skip
        archives = sorted(self.dir.glob("*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise ConfigError(f"cannot fetch the sdist of {spec}: {done.stderr.strip()[-500:]}")
        staging = self.dir / "staging"
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(archives[0]) as tar:
            tar.extractall(staging, filter="data")
        (top,) = [p for p in staging.iterdir() if p.is_dir()]
        shutil.rmtree(self.tree, ignore_errors=True)
        top.rename(self.tree)
        shutil.rmtree(staging)
        return self.tree

    def modules(self) -> list[str]:
        """The package's mutable modules (paths relative to the tree), sorted."""
        if self.library.modules:
            return list(self.library.modules)
        package = self.tree / self.library.package
        return sorted(
            str(p.relative_to(self.tree))
            for p in package.rglob("*.py")
            if "tests" not in p.relative_to(self.tree).parts and not p.name.startswith("test")
        )

    def baseline(self) -> TestRun:
        """The pristine suite's outcomes (cached)."""
        path = self.dir / "baseline.json"
        if path.is_file():
            return TestRun(**json.loads(path.read_text()))
        check_test_python()
        run = run_pytest(self.fetch(), [self.library.tests], import_root=self.library.import_root)
        if not run.passed():
            raise ConfigError(f"{self.library.key}: no test passes on the pristine library")
        path.write_text(json.dumps(asdict(run)))
        return run

    def mutants(self, limit: int, seed: int = 0) -> list[Mutant]:
        """Up to ``limit`` validated bugs, tried in a seeded order (cached and extended)."""
        path = self.dir / f"mutants-seed{seed}.json"
        state: dict[str, Any] = (
            json.loads(path.read_text()) if path.is_file() else {"tried": 0, "kept": []}
        )
        kept = [_mutant_from_json(m) for m in state["kept"]]
        if len(kept) >= limit:
            return kept[:limit]
        tree = self.fetch()
        passing = self.baseline().passed()
        pool = [
            (module, m)
            for module in self.modules()
            for m in candidates((tree / module).read_text())
        ]
        random.Random(seed).shuffle(pool)
        work = self.dir / "work"
        for module, mutation in pool[state["tried"] :]:
            if len(kept) >= limit:
                break
            state["tried"] += 1
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(tree, work)
            original = (tree / module).read_text()
            (work / module).write_text(apply(original, mutation))
            run = run_pytest(
                work, [self.library.tests], timeout_s=60, import_root=self.library.import_root
            )
            broken = sorted(t for t in passing if run.outcomes.get(t) in ("FAILED", "ERROR"))
            if run.returncode == -1 or not run.outcomes or not broken:
                continue  # a hang, a crash at import, or a bug no test sees
            kept.append(Mutant(self.library.key, module, mutation, tuple(broken)))
            state["kept"] = [_mutant_to_json(m) for m in kept]
            path.write_text(json.dumps(state))
        shutil.rmtree(work, ignore_errors=True)
        path.write_text(json.dumps({**state, "kept": [_mutant_to_json(m) for m in kept]}))
        return kept


def _mutant_to_json(m: Mutant) -> dict[str, object]:
    return {"library": m.library, "path": m.path, "mutation": asdict(m.mutation),
            "fail_to_pass": list(m.fail_to_pass)}  # fmt: skip


def _mutant_from_json(d: dict[str, object]) -> Mutant:
    return Mutant(
        str(d["library"]),
        str(d["path"]),
        Mutation(**d["mutation"]),  # type: ignore[arg-type]
        tuple(d["fail_to_pass"]),  # type: ignore[arg-type]
    )
