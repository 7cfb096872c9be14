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

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from turnrl.envs.swe.mutate import Mutation, apply, candidates
from turnrl.envs.swe.runner import TEST_PYTHON, TestRun, package_name, run_tests_on_host
from turnrl.errors import ConfigError

CACHE_FORMAT = 4
"""Bumped when cached baselines or mutants would no longer match (v2: fixed hash seed; v3:
outcomes from the runner's report, with failure messages; v4: negated conditions)."""
POOL_SEED = 0
"""Seed of the order in which mutations are tried. Fixed, so every ``SWE(seed=...)`` draws
its tasks from the same cached bugs (a new seed must not cost a new validation)."""
MAX_WORKERS = 4


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


def is_module(path: str) -> bool:
    """Whether a path inside the tree is library code, not test code: a ``.py`` file
    outside any ``tests``/``test`` directory, not ``test*.py`` nor ``conftest.py``. Only
    such files of the model's workspace are graded (a conftest.py there could rewrite
    every outcome)."""
    parts = Path(path).parts
    name = parts[-1] if parts else ""
    return (
        name.endswith(".py")
        and not name.startswith("test")
        and name != "conftest.py"
        and not {"tests", "test"} & set(parts[:-1])
    )


def cache_root() -> Path:
    return Path(os.environ.get("TURNRL_CACHE", Path.home() / ".cache" / "turnrl")) / "swe"


def run_pytest(library: Library, root: Path, paths: list[str], timeout_s: float = 120.0) -> TestRun:
    """Run tests of ``library``'s tree at ``root`` on the host (trusted code only: the
    pristine library or one with a bug we made)."""
    return run_tests_on_host(
        root, library.import_root, package_name(library.package), paths, timeout_s
    )


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
        """Download and unpack the sdist once; return the pristine tree. Safe to run in
        several processes at once: each works in its own staging dir, the first to finish
        renames its tree into place and the others drop theirs."""
        if (self.tree / self.library.package).is_dir():
            return self.tree
        self.dir.mkdir(parents=True, exist_ok=True)
        spec = f"{self.library.name}=={self.library.version}"
        staging = Path(tempfile.mkdtemp(prefix="fetch-", dir=self.dir))
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                 "--quiet", "-d", str(staging / "sdist"), spec],
                capture_output=True, text=True,
            )  # fmt: skip
            archives = sorted((staging / "sdist").glob("*.tar.gz"))
            if done.returncode != 0 or not archives:
                raise ConfigError(
                    f"cannot fetch the sdist of {spec} for the swe environment (pip download "
                    f"--no-binary :all:, exit status {done.returncode}): it needs a package "
                    f"index that serves sdists, or {self.dir} filled on another machine "
                    f"(python -m turnrl.envs.swe; TURNRL_CACHE moves the cache). pip said: "
                    f"{done.stderr.strip()[-500:]}"
                )
            with tarfile.open(archives[0]) as tar:
                tar.extractall(staging / "unpacked", filter="data")
            (top,) = [p for p in (staging / "unpacked").iterdir() if p.is_dir()]
            if not (top / self.library.package).is_dir():
                raise ConfigError(f"{spec}'s sdist has no {self.library.package}/")
            with contextlib.suppress(OSError):  # another process was first: keep its tree
                top.rename(self.tree)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self.tree

    def modules(self) -> list[str]:
        """The package's mutable modules (paths relative to the tree), sorted."""
        if self.library.modules:
            return list(self.library.modules)
        package = self.tree / self.library.package
        return sorted(
            rel for p in package.rglob("*.py") if is_module(rel := str(p.relative_to(self.tree)))
        )

    def baseline(self) -> TestRun:
        """The pristine suite's outcomes (run once, cached)."""
        return self._baseline()[0]

    def _baseline(self) -> tuple[TestRun, float]:
        """The pristine outcomes and how long the suite took (the bugs' timeout scales
        with it)."""
        path = self.dir / "baseline.json"
        if path.is_file():
            data = json.loads(path.read_text())
            return TestRun(**data["run"]), float(data["seconds"])
        check_test_python()
        tree = self.fetch()
        start = time.perf_counter()
        run = run_pytest(self.library, tree, [self.library.tests])
        seconds = time.perf_counter() - start
        if not run.passed():
            raise ConfigError(
                f"{self.library.key}: no test passes on the pristine library "
                f"(exit status {run.returncode}): {run.tail[-500:]}"
            )
        _write_json(path, {"run": asdict(run), "seconds": seconds})
        return run, seconds

    def mutants(self, limit: int, seed: int = POOL_SEED) -> list[Mutant]:
        """Up to ``limit`` validated bugs, tried in a seeded order (cached and extended).

        Candidates are tried in batches, one test run per core; the kept list is the one a
        one-by-one pass would keep (a batch's results are taken in pool order and the pass
        stops at the ``limit``-th bug), so the cache does not depend on the core count.
        """
        path = self.dir / f"mutants-seed{seed}.json"
        state: dict[str, Any] = (
            json.loads(path.read_text()) if path.is_file() else {"tried": 0, "kept": []}
        )
        kept = [_mutant_from_json(m) for m in state["kept"]]
        if len(kept) >= limit:
            return kept[:limit]
        tree = self.fetch()
        baseline, seconds = self._baseline()
        passing = baseline.passed()
        timeout_s = max(20.0, 10.0 * seconds)  # a bug that loops for ever is dropped
        pool = [
            (module, m)
            for module in self.modules()
            for m in candidates((tree / module).read_text())
        ]
        random.Random(seed).shuffle(pool)
        workers = max(1, min(MAX_WORKERS, os.cpu_count() or 1))

        def broken(item: tuple[str, Mutation]) -> tuple[str, ...]:
            module, mutation = item
            with _scratch_copy(tree, self.dir) as work:
                (work / module).write_text(apply((tree / module).read_text(), mutation))
                run = run_pytest(self.library, work, [self.library.tests], timeout_s)
            if run.returncode == -1:
                return ()  # a hang
            return tuple(sorted(t for t in passing if run.outcomes.get(t) in ("FAILED", "ERROR")))

        with ThreadPoolExecutor(workers) as executor:
            while len(kept) < limit and state["tried"] < len(pool):
                batch = pool[state["tried"] : state["tried"] + workers]
                for (module, mutation), failing in zip(
                    batch, executor.map(broken, batch), strict=True
                ):
                    if len(kept) >= limit:
                        break
                    state["tried"] += 1
                    if failing:  # else: a crash at import, or a bug no test sees
                        kept.append(Mutant(self.library.key, module, mutation, failing))
                state["kept"] = [_mutant_to_json(m) for m in kept]
                _write_json(path, state)
        return kept[:limit]


@contextlib.contextmanager
def _scratch_copy(tree: Path, where: Path) -> Iterator[Path]:
    """A throw-away copy of ``tree`` under ``where``."""
    work = Path(tempfile.mkdtemp(prefix="work-", dir=where)) / "tree"
    try:
        shutil.copytree(tree, work)
        yield work
    finally:
        shutil.rmtree(work.parent, ignore_errors=True)


def _write_json(path: Path, data: object) -> None:
    """Write ``path`` atomically: a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)


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
