"""``swe``: fix a single-site bug in a real library, checked by the library's own tests.

Each task is one validated bug (``library.Checkout.mutants``) in a pinned library. The
episode's workspace is a copy of the library with the bug, in a sandbox slot's work dir.
Tools (hermes format): ``list_files``, ``read_file``, ``search``, ``edit_file`` on the host,
confined to the workspace (paths are resolved and must stay inside it, so a symlink made
by sandboxed code cannot lead out), and ``run_tests``, which runs pytest on the model's
code inside the sandbox. When the model answers, the verifier rebuilds the library from
the pristine sdist with only the package's modules taken from the workspace (tests,
conftest files and configuration always pristine: editing, deleting or skipping tests
changes nothing) and runs the whole suite in the sandbox. Reward 1 exactly when every
test that failed because of the bug passes and every test that passed still passes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from turnrl.envs.card import EnvCard
from turnrl.envs.policy import Policy, demonstration_corpus
from turnrl.envs.swe.library import (
    TEST_ENV,
    TEST_PYTHON,
    Checkout,
    Library,
    Mutant,
    check_test_python,
    parse_outcomes,
    pytest_argv,
)
from turnrl.envs.swe.mutate import apply
from turnrl.envs.tool_env import ToolEnv
from turnrl.errors import ConfigError
from turnrl.formats import get_format
from turnrl.rewards import Verdict
from turnrl.tools import Sandbox, Tool, ToolSet
from turnrl.tools.sandbox import SandboxSlot
from turnrl.types import Message, Task, ToolCall

LIBRARIES = {
    "toolz": Library("toolz", "1.1.0", package="toolz", tests="toolz/tests"),
    "cachetools": Library(
        "cachetools", "6.2.1", package="src/cachetools", tests="tests", import_root="src"
    ),
    "isodate": Library("isodate", "0.7.2", package="src/isodate", tests="tests", import_root="src"),
}
"""The pinned libraries (their sdists ship tests that pass offline)."""

REPO = "repo"
"""The library's tree inside the slot's work dir (what the model's tools see)."""
MAX_LINES = 200
MAX_HITS = 40


@dataclass(frozen=True)
class SWE:
    """SWE-style bug fixing in a real library, graded by its own tests; see the module docstring."""

    libraries: tuple[str, ...] = ("toolz", "cachetools", "isodate")
    num_bugs: int = 40
    """Validated bugs per library (built once per machine, cached; the test split is one
    bug in five)."""
    max_tool_calls: int = 30
    test_timeout_s: float = 120.0
    seed: int = 0

    name = "swe"
    chance = 0.0
    """An agent that edits nothing fixes nothing."""

    def __post_init__(self) -> None:
        unknown = [name for name in self.libraries if name not in LIBRARIES]
        if not self.libraries or unknown:
            raise ConfigError(
                f"swe.libraries: unknown {unknown or 'none given'}; known: {', '.join(LIBRARIES)}"
            )
        if self.num_bugs < 1 or self.max_tool_calls < 1 or not self.test_timeout_s > 0:
            raise ConfigError("swe: num_bugs >= 1, max_tool_calls >= 1, test_timeout_s > 0")

    @functools.cached_property
    def _checkouts(self) -> dict[str, Checkout]:
        check_test_python()
        return {name: Checkout(LIBRARIES[name]) for name in self.libraries}

    @functools.cached_property
    def _bugs(self) -> list[Mutant]:
        return [m for c in self._checkouts.values() for m in c.mutants(self.num_bugs, self.seed)]

    @functools.cached_property
    def _sandbox(self) -> Sandbox:
        return Sandbox(python=TEST_PYTHON)

    def task(self, index: int, split: str = "train") -> Task:
        bugs = self._bugs
        pool = [b for i, b in enumerate(bugs) if (i % 5 == 4) == (split == "test")] or bugs
        bug = pool[random.Random(f"swe/{self.seed}/{split}/{index}").randrange(len(pool))]
        library = next(c.library for c in self._checkouts.values() if c.library.key == bug.library)
        failing = list(bug.fail_to_pass)
        shown = ", ".join(failing[:3]) + (
            f" and {len(failing) - 3} more" if len(failing) > 3 else ""
        )
        prompt = (
            f"The library {library.name} {library.version} is checked out in your workspace, "
            f"with a bug: these tests fail: {shown}. Find the bug in the library's code and "
            f"fix it (do not edit the tests; they are restored before grading). Use the "
            "tools to look around, edit and run the tests. When the tests pass, answer done."
        )
        return Task(
            id=f"{split}-{index}",
            prompt=({"role": "user", "content": prompt},),
            answer=None,
            metadata={"library": bug.library, "path": bug.path,
                      "mutation": bug.mutation.__dict__, "fail_to_pass": failing},
        )  # fmt: skip

    def _bug(self, task: Task) -> Mutant:
        meta = task.metadata
        return next(
            b for b in self._bugs
            if b.library == meta["library"] and b.path == meta["path"]
            and b.mutation.__dict__ == meta["mutation"]
        )  # fmt: skip

    def make_env(self) -> SweEnv:
        return SweEnv(Workspace(self), self.max_tool_calls)

    def oracle(self, task: Task) -> Policy:
        """Undoes the bug with one ``edit_file`` (the mutated line back to the pristine
        one), runs the failing tests, answers done."""
        bug = self._bug(task)
        pristine = (self._checkouts[LIBRARIES_BY_KEY[bug.library]].tree / bug.path).read_text()
        old, new = _unique_hunk(pristine, apply(pristine, bug.mutation), bug.mutation.lineno)
        hermes = get_format("hermes")
        edit = hermes.render_call(ToolCall("edit_file", {"path": bug.path, "old": old, "new": new}))
        run = hermes.render_call(ToolCall("run_tests", {"tests": " ".join(bug.fail_to_pass)}))

        def policy(messages: Sequence[Message]) -> str:
            made = sum(m["role"] == "tool" for m in messages)
            return edit if made == 0 else run if made == 1 else "done"

        return policy

    @property
    def oracle_success(self) -> float:
        return 1.0

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """Format-only turns: look at a random file, run the tests, answer done."""
        hermes = get_format("hermes")
        library = LIBRARIES[rng.choice(self.libraries)]
        path = f"{library.package}/{rng.choice(['__init__', 'core', 'utils'])}.py"
        return [
            hermes.render_call(ToolCall("read_file", {"path": path, "start": rng.randint(1, 50)})),
            hermes.render_call(ToolCall("run_tests", {"tests": ""})),
            "done",
        ]

    def corpus(self) -> list[str]:
        return demonstration_corpus(self, 40)

    @property
    def card(self) -> EnvCard:
        isolation = "bubblewrap" if self._sandbox.isolated else "rlimit fallback, NOT isolated"
        return EnvCard(
            name=self.name,
            summary="fix a single-site bug in a real library so that its own tests pass",
            tools=(
                "list_files(path) -> the directory's entries",
                "read_file(path, start, end) -> numbered lines",
                "search(text, path) -> file:line: matching lines",
                "edit_file(path, old, new) -> replace one exact, unique occurrence",
                "run_tests(tests) -> pytest summary and failures (sandboxed)",
            ),
            tool_budget=self.max_tool_calls,
            turn_limit=None,
            scaffold=f"hermes <tool_call> format; the prompt names the failing tests; "
            f"tests run in the sandbox ({isolation})",
            evaluator="the library rebuilt from the sdist with only the package's modules from "
            "the workspace (tests and config pristine); reward 1 when every test failing "
            "because of the bug passes and every other passing test still passes",
            on_failure="a bad path, a missing or ambiguous edit and a test error are "
            "observations; an answer with tests still failing scores 0",
            chance=self.chance,
        )


LIBRARIES_BY_KEY = {lib.key: name for name, lib in LIBRARIES.items()}


def _unique_hunk(pristine: str, buggy: str, lineno: int) -> tuple[str, str]:
    """The buggy lines around ``lineno``, grown until they occur once in the buggy file,
    and the pristine lines they stand for (what an ``edit_file`` that fixes it needs)."""
    before, after = pristine.splitlines(keepends=True), buggy.splitlines(keepends=True)
    shift = len(before) - len(after)
    start, stop = lineno - 1, lineno
    while True:
        old = "".join(after[start:stop])
        if buggy.count(old) == 1 or (start == 0 and stop >= len(after)):
            return old, "".join(before[start : stop + shift])
        if start > 0:
            start -= 1
        if stop < len(after):
            stop += 1


class SweEnv(ToolEnv):
    """A ``ToolEnv`` whose tools and verifier share one episode's ``workspace``."""

    def __init__(self, workspace: Workspace, max_tool_calls: int) -> None:
        super().__init__(
            workspace.open, get_format("hermes"), workspace.verify, max_tool_calls=max_tool_calls
        )
        self.workspace = workspace


class Workspace:
    """One episode's copy of a library in a sandbox slot, its tools and its verifier."""

    def __init__(self, spec: SWE) -> None:
        self.spec = spec
        self.slot: SandboxSlot | None = None
        self.bug: Mutant | None = None

    @property
    def root(self) -> Path:
        assert self.slot is not None
        return self.slot.workdir / REPO

    async def open(self, task: Task) -> ToolSet:
        """Copy the buggy library into a fresh slot; return the episode's tools."""
        self.bug = self.spec._bug(task)
        checkout = self.spec._checkouts[LIBRARIES_BY_KEY[self.bug.library]]
        sandbox = self.spec._sandbox
        self.slot = await asyncio.to_thread(sandbox.acquire)
        try:
            await asyncio.to_thread(self._prepare, checkout.tree, self.bug)
        except BaseException:
            await self.close()  # the tools are not returned, so nothing else would
            raise
        tools = [
            Tool.from_function(self.list_files),
            Tool.from_function(self.read_file),
            Tool.from_function(self.search),
            Tool.from_function(self.edit_file),
            Tool.from_function(self.run_tests, timeout_s=self.spec.test_timeout_s + 10),
        ]
        return ToolSet(tools, on_close=[self.close])

    def _prepare(self, tree: Path, bug: Mutant) -> None:
        shutil.copytree(tree, self.root)
        target = self.root / bug.path
        target.write_text(apply(target.read_text(), bug.mutation))
        self._own(self.root)

    def _own(self, top: Path) -> None:
        """Hand the tree to the slot's uid so sandboxed tests can write their caches."""
        assert self.slot is not None
        if os.geteuid() != 0:
            return
        for path in [top, *top.rglob("*")]:
            if not path.is_symlink():
                os.chown(path, self.slot.uid, self.slot.gid)

    async def close(self) -> None:
        if self.slot is not None:
            slot, self.slot = self.slot, None
            await asyncio.to_thread(self.spec._sandbox.release, slot)

    # ------------------------------------------------------------------ the tools

    def _path(self, path: str) -> Path:
        """``path`` inside the workspace, resolved; anything leading out is refused."""
        if os.path.isabs(path):
            raise ValueError(f"give a path relative to the library's root, not {path!r}")
        full = (self.root / (path or ".")).resolve()
        root = self.root.resolve()
        if full != root and root not in full.parents:
            raise ValueError(f"{path!r} is outside the workspace")
        return full

    async def list_files(self, path: str = ".") -> str:
        """List a directory of the library.

        Args:
            path: A directory, relative to the library's root.
        """
        where = self._path(path)
        if not where.is_dir():
            raise ValueError(f"{path!r} is not a directory")
        entries = sorted(
            f"{p.name}/" if p.is_dir() else p.name
            for p in where.iterdir()
            if p.name != "__pycache__"
        )
        return "\n".join(entries) or "(empty)"

    async def read_file(self, path: str, start: int = 1, end: int = 0) -> str:
        """Read lines of a file, numbered.

        Args:
            path: A file, relative to the library's root.
            start: The first line to show (1-based).
            end: The last line to show (0: up to 200 lines from start).
        """
        where = self._path(path)
        if not where.is_file():
            raise ValueError(f"{path!r} is not a file")
        lines = where.read_text(errors="replace").splitlines()
        start = max(1, start)
        stop = min(len(lines), end if end > 0 else start + MAX_LINES - 1, start + MAX_LINES - 1)
        if start > len(lines):
            return f"{path} has {len(lines)} lines"
        shown = [f"{n:5d}  {lines[n - 1]}" for n in range(start, stop + 1)]
        return "\n".join(shown) + (f"\n... ({len(lines)} lines)" if stop < len(lines) else "")

    async def search(self, text: str, path: str = ".") -> str:
        """Find lines containing a text in the library's Python files.

        Args:
            text: The text to look for (plain text, case-sensitive).
            path: A directory or file to search, relative to the library's root.
        """
        if not text:
            raise ValueError("give a non-empty text to search for")
        where = self._path(path)
        files = [where] if where.is_file() else sorted(where.rglob("*.py"))
        root = self.root.resolve()
        hits: list[str] = []
        for f in files:
            if f.is_symlink() or root not in f.resolve().parents:
                continue
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                if text in line:
                    hits.append(f"{f.relative_to(root)}:{n}: {line.strip()}")
                    if len(hits) >= MAX_HITS:
                        return "\n".join(hits) + f"\n... (first {MAX_HITS} matches)"
        return "\n".join(hits) or f"no line contains {text!r}"

    async def edit_file(self, path: str, old: str, new: str) -> str:
        """Replace one exact occurrence of a text in a file.

        Args:
            path: A file, relative to the library's root.
            old: The exact text to replace; it must occur exactly once in the file.
            new: The text to put in its place.
        """
        where = self._path(path)
        if not where.is_file():
            raise ValueError(f"{path!r} is not a file")
        content = where.read_text()
        count = content.count(old) if old else 0
        if count != 1:
            raise ValueError(
                f"the text to replace occurs {count} times in {path}; give a longer, "
                "unique piece of the file"
            )
        where.write_text(content.replace(old, new, 1))
        return f"edited {path}"

    async def run_tests(self, tests: str = "") -> str:
        """Run the library's tests with pytest, in the sandbox.

        Args:
            tests: Test files or ids separated by spaces (empty: the whole suite).
        """
        assert self.bug is not None
        library = self.spec._checkouts[LIBRARIES_BY_KEY[self.bug.library]].library
        paths = tests.split() or [library.tests]
        for p in paths:
            self._path(p.split("::")[0])
        outcomes, text = await self._pytest(REPO, paths, library.import_root)
        failed = sorted(t for t, o in outcomes.items() if o in ("FAILED", "ERROR"))
        passed = sum(o == "PASSED" for o in outcomes.values())
        summary = f"{passed} passed, {len(failed)} failed"
        if not outcomes:
            return f"no test ran:\n{text[-1500:]}"
        if not failed:
            return summary
        details = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
        return summary + "\n" + "\n".join(details[:15])

    async def _pytest(
        self, where: str, paths: list[str], import_root: str
    ) -> tuple[dict[str, str], str]:
        """Run pytest in ``where`` (under the slot's work dir) inside the sandbox, the
        package importable from ``import_root`` (relative to ``where``)."""
        assert self.slot is not None
        sandbox = self.spec._sandbox
        inner = os.path.join(sandbox.code_workdir(self.slot), where)
        script = (  # the test environment, then pytest in a fresh interpreter
            "import json, os, sys; os.chdir(sys.argv[1]); env = dict(os.environ, "
            "**json.loads(sys.argv[3]), PYTHONPATH=os.path.abspath(sys.argv[2])); "
            "os.execve(sys.executable, [sys.executable, *sys.argv[4:]], env)"
        )
        argv = [TEST_PYTHON, "-c", script, inner, import_root, json.dumps(TEST_ENV),
                *pytest_argv(paths)]  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            *sandbox.command(self.slot, argv), **sandbox.popen_kwargs(self.slot),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        try:
            out, _ = await asyncio.wait_for(process.communicate(), self.spec.test_timeout_s)
        except TimeoutError:
            await asyncio.to_thread(sandbox.kill_all, self.slot)
            process.kill()
            await process.wait()
            return {}, f"the tests ran past {self.spec.test_timeout_s:.0f} s and were stopped"
        text = out.decode(errors="replace")
        return parse_outcomes(text), text

    # ------------------------------------------------------------------ grading

    async def verify(self, task: Task, answer: str) -> Verdict:
        """The pristine library with the workspace's package modules; the whole suite."""
        assert self.bug is not None
        assert self.slot is not None
        checkout = self.spec._checkouts[LIBRARIES_BY_KEY[self.bug.library]]
        graded = self.slot.workdir / "graded"
        await asyncio.to_thread(self._assemble, checkout, graded)
        library = checkout.library
        outcomes, _ = await self._pytest("graded", [library.tests], library.import_root)
        baseline = checkout.baseline().passed()
        fail_to_pass = set(self.bug.fail_to_pass)
        pass_to_pass = baseline - fail_to_pass
        fixed = sum(outcomes.get(t) == "PASSED" for t in fail_to_pass) / len(fail_to_pass)
        kept = sum(outcomes.get(t) == "PASSED" for t in pass_to_pass) / max(1, len(pass_to_pass))
        success = fixed == 1.0 and kept == 1.0
        return Verdict(
            reward=1.0 if success else 0.0, success=success,
            components={"fail_to_pass": fixed, "pass_to_pass": kept},
        )  # fmt: skip

    def _assemble(self, checkout: Checkout, graded: Path) -> None:
        shutil.rmtree(graded, ignore_errors=True)
        shutil.copytree(checkout.tree, graded)
        root = self.root.resolve()
        for module in checkout.modules():
            mine = self.root / module
            if mine.is_file() and not mine.is_symlink() and root in mine.resolve().parents:
                shutil.copyfile(mine, graded / module)
        self._own(graded)
