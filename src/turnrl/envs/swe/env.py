"""``swe``: fix a single-site bug in a real library, checked by the library's own tests.

Each task is one validated bug (``library.Checkout.mutants``: a single-site AST mutation
that makes at least one passing test fail) in a pinned library. The episode's workspace
is a copy of the library with the bug, in a sandbox slot's work dir. Tools (hermes
format): ``list_files``, ``read_file``, ``search`` and ``edit_file`` run on the host,
confined to the workspace; ``run_tests`` runs the library's tests on the model's code
inside the sandbox. When the model answers, the verifier grades a fresh tree: the pristine
sdist with only the package's modules taken from the workspace (tests, conftest files and
configuration always pristine; a module deleted in the workspace is deleted there too),
whose whole suite runs in the sandbox; outcomes come from the runner's report, never from
what the code under test prints (``runner``). Reward 1 exactly when every test that failed
because of the bug passes and every test that passed still passes; the share of each is
logged as a component.

Reward hacks this closes, each probed in tests/test_swe.py: editing, emptying or deleting
the failing tests, a conftest.py that skips or passes everything, a package that skips its
importers, printing pytest's "PASSED" lines, deleting the buggy module (the pristine copy
does not come back), deleting the package (a copy installed in the system does not count).
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import secrets
import shlex
import shutil
import stat
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from turnrl.envs.env_card import EnvCard
from turnrl.envs.policy import Policy, demonstration_corpus
from turnrl.envs.swe.library import Checkout, Library, Mutant, check_test_python, is_module
from turnrl.envs.swe.mutate import apply
from turnrl.envs.swe.runner import (
    TEST_PYTHON,
    TestRun,
    package_name,
    read_report,
    runner_argv,
)
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
MAX_LINES = 120
"""Lines ``read_file`` shows at most per call."""
READ_OUTPUT_CHARS = 12_000
MAX_HITS = 40
MAX_ENTRIES = 200
MAX_FAILURES = 10
MAX_FILE_BYTES = 1_000_000
"""Files larger than this are refused by the tools and left out of grading."""
MAX_MODULES = 500
MAX_LOG_BYTES = 4000


@dataclass(frozen=True)
class SWE:
    """SWE-style bug fixing in a real library, graded by its own tests; see the module docstring."""

    libraries: tuple[str, ...] = ("toolz", "cachetools", "isodate")
    """Libraries whose bugs make the tasks (keys of ``LIBRARIES``)."""
    num_bugs: int = 40
    """Validated bugs per library (found once per machine and cached; the test split is
    one bug in five)."""
    max_tool_calls: int = 30
    """Tool calls per episode."""
    test_timeout_s: float = 60.0
    """Wall-clock limit of one test run in the sandbox (``run_tests`` and grading)."""
    seed: int = 0
    """Seed of the task stream (which bug each index gets). The bugs themselves do not
    depend on it: every seed draws from the same cached list."""

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
        return [m for c in self._checkouts.values() for m in c.mutants(self.num_bugs)]

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
        """Reads the lines around the bug, undoes it with one ``edit_file`` (the mutated
        lines back to the pristine ones), runs the failing tests, answers done."""
        bug = self._bug(task)
        pristine = (self._checkouts[LIBRARIES_BY_KEY[bug.library]].tree / bug.path).read_text()
        old, new = _unique_hunk(pristine, apply(pristine, bug.mutation), bug.mutation.lineno)
        line = bug.mutation.lineno
        turns = [
            _call("read_file", path=bug.path, start=max(1, line - 10), end=line + 10),
            _call("edit_file", path=bug.path, old=old, new=new),
            _call("run_tests", tests=shlex.join(bug.fail_to_pass)),
        ]

        def policy(messages: Sequence[Message]) -> str:
            made = sum(m["role"] == "assistant" for m in messages)
            return turns[made] if made < len(turns) else "done"

        return policy

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """The format with random content (replayed, the random policy): read a random
        module of the task's library, run one of its test files, answer done."""
        checkout = self._checkouts[LIBRARIES_BY_KEY[task.metadata["library"]]]
        module = rng.choice(checkout.modules())
        tests = sorted(
            str(p.relative_to(checkout.tree))
            for p in (checkout.tree / checkout.library.tests).rglob("test_*.py")
        )
        return [
            _call("read_file", path=module, start=rng.randint(1, 50)),
            _call("run_tests", tests=rng.choice(tests)),
            "done",
        ]

    def corpus(self) -> list[str]:
        """Prompts and demonstrations, and the libraries' own modules (code to tokenize)."""
        sources = [(c.tree / m).read_text() for c in self._checkouts.values() for m in c.modules()]
        return demonstration_corpus(self, 40) + sources

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
            evaluator="a fresh tree from the sdist with only the package's modules from the "
            "workspace (tests, conftest files and config pristine; deleted modules stay "
            "deleted); the whole suite in the sandbox, outcomes from the runner's report; "
            "reward 1 when every test failing because of the bug passes and every other "
            "passing test still passes",
            on_failure="a bad path, a missing or ambiguous edit and a test error are "
            "observations; an answer with tests still failing scores 0",
            chance=self.chance,
        )


LIBRARIES_BY_KEY = {lib.key: name for name, lib in LIBRARIES.items()}


def _call(name: str, **arguments: object) -> str:
    return get_format("hermes").render_call(ToolCall(name, arguments))


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
            workspace.open,
            workspace.verify,
            format=get_format("hermes"),
            max_tool_calls=max_tool_calls,
        )
        self.workspace = workspace


class Workspace:
    """One episode's copy of a library in a sandbox slot, its tools and its verifier.

    The work dir is the sandboxed code's as much as ours: anything in it may have been
    replaced by a link or a huge file while tests ran. So host-side file access (the four
    file tools, and reading the model's modules for grading) happens only while no
    sandboxed process lives (one lock for every tool and the verifier; the slot's processes
    are killed after each run), paths are resolved and must stay inside the workspace,
    final components are opened without following links, and sizes are bounded.
    """

    def __init__(self, spec: SWE) -> None:
        self.spec = spec
        self.slot: SandboxSlot | None = None
        self.bug: Mutant | None = None
        self._lock = asyncio.Lock()

    @property
    def root(self) -> Path:
        assert self.slot is not None
        return self.slot.workdir / REPO

    @property
    def checkout(self) -> Checkout:
        assert self.bug is not None
        return self.spec._checkouts[LIBRARIES_BY_KEY[self.bug.library]]

    async def open(self, task: Task) -> ToolSet:
        """Copy the buggy library into a fresh slot; return the episode's tools."""
        self.bug = self.spec._bug(task)
        sandbox = self.spec._sandbox
        self.slot = await asyncio.to_thread(sandbox.acquire)
        try:
            await asyncio.to_thread(self._prepare, self.checkout.tree, self.bug)
        except BaseException:
            await self.close()  # the tools are not returned, so nothing else would
            raise
        tools = [
            Tool.from_function(self.list_files),
            Tool.from_function(self.read_file, max_output_chars=READ_OUTPUT_CHARS),
            Tool.from_function(self.search),
            Tool.from_function(self.edit_file),
            Tool.from_function(self.run_tests, timeout_s=self.spec.test_timeout_s + 30),
        ]
        return ToolSet(tools, on_close=[self.close])

    def _prepare(self, tree: Path, bug: Mutant) -> None:
        shutil.copytree(tree, self.root)
        target = self.root / bug.path
        target.write_text(apply(target.read_text(), bug.mutation))
        if os.geteuid() == 0:  # the model's tests may write in their tree, as at home
            assert self.slot is not None
            for path in [self.root, *self.root.rglob("*")]:
                os.chown(path, self.slot.uid, self.slot.gid, follow_symlinks=False)

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

    def _file(self, path: str) -> tuple[Path, str]:
        """A file of the workspace and its text (bounded; never through a link)."""
        where = self._path(path)
        if not where.is_file():
            raise ValueError(
                f"{path!r} is not a file" + ("" if where.exists() else " (no such file)")
            )
        data = _read_plain_file(where, MAX_FILE_BYTES)
        if data is None:
            raise ValueError(
                f"{path!r} is larger than {MAX_FILE_BYTES // 1000} kB or not a plain file"
            )
        return where, data.decode(errors="replace")

    async def list_files(self, path: str = ".") -> str:
        """List a directory of the library.

        Args:
            path: A directory, relative to the library's root.
        """
        async with self._lock:
            where = self._path(path)
            if not where.is_dir():
                raise ValueError(f"{path!r} is not a directory")
            entries = sorted(
                f"{p.name}/" if p.is_dir() else p.name
                for p in where.iterdir()
                if p.name != "__pycache__"
            )
            return "\n".join(entries[:MAX_ENTRIES]) or "(empty)"

    async def read_file(self, path: str, start: int = 1, end: int = 0) -> str:
        """Read lines of a file, numbered.

        Args:
            path: A file, relative to the library's root.
            start: The first line to show (1-based).
            end: The last line to show (0: up to 120 lines from start).
        """
        async with self._lock:
            _, text = self._file(path)
        lines = text.splitlines()
        start = max(1, start)
        if end and end < start:
            raise ValueError(f"end ({end}) is before start ({start})")
        if start > len(lines):
            return f"{path} has {len(lines)} lines"
        stop = min(len(lines), end if end > 0 else start + MAX_LINES - 1, start + MAX_LINES - 1)
        shown = [f"{n:5d}  {lines[n - 1]}" for n in range(start, stop + 1)]
        more = (
            f"\n... ({len(lines)} lines; read on with start={stop + 1})"
            if stop < len(lines)
            else ""
        )
        return "\n".join(shown) + more

    async def search(self, text: str, path: str = ".") -> str:
        """Find lines containing a text in the library's Python files.

        Args:
            text: The text to look for (plain text, case-sensitive).
            path: A directory or file to search, relative to the library's root.
        """
        if not text:
            raise ValueError("give a non-empty text to search for")
        async with self._lock:
            where = self._path(path)
            root = self.root.resolve()
            files = [where] if where.is_file() else _python_files(where)
            hits: list[str] = []
            for f in files:
                data = _read_plain_file(f, MAX_FILE_BYTES)
                if data is None:
                    continue
                for n, line in enumerate(data.decode(errors="replace").splitlines(), 1):
                    if text in line:
                        hits.append(f"{f.relative_to(root)}:{n}: {line.strip()[:200]}")
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
        if not old:
            raise ValueError("old is empty: give the exact text to replace")
        async with self._lock:
            where, content = self._file(path)
            count = content.count(old)
            if count != 1:
                hint = (
                    "copy it exactly from read_file, without the line numbers"
                    if count == 0
                    else "give a longer piece of the file that occurs once"
                )
                raise ValueError(f"the text to replace occurs {count} times in {path}; {hint}")
            fd = os.open(where, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
            with os.fdopen(fd, "w") as f:
                f.write(content.replace(old, new, 1))
        return f"edited {path}"

    async def run_tests(self, tests: str = "") -> str:
        """Run the library's tests with pytest, in the sandbox.

        Args:
            tests: Test files or test ids separated by spaces, e.g.
                tests/test_x.py::test_y (quoted if an id holds spaces; empty: the whole
                suite).
        """
        library = self.checkout.library
        try:
            paths = shlex.split(tests) or [library.tests]
        except ValueError as exc:
            raise ValueError(f"cannot split the test ids ({exc}); quote ids with spaces") from exc
        for p in paths:
            if p.startswith("-"):
                raise ValueError(f"give test files or ids, not pytest options ({p!r})")
            self._path(p.split("::")[0])
        async with self._lock:
            run = await self._run(REPO, paths)
        return _summary(run, self.spec.test_timeout_s)

    async def _run(self, where: str, paths: list[str]) -> TestRun:
        """Run ``paths`` of the tree at ``where`` (under the slot's work dir) with the
        runner, inside the sandbox; then kill whatever the run left behind."""
        assert self.slot is not None
        slot, sandbox, library = self.slot, self.spec._sandbox, self.checkout.library
        inner = sandbox.code_workdir(slot)
        report = f".report-{secrets.token_hex(8)}.json"  # unguessable: made by the runner
        argv = runner_argv(
            os.path.join(inner, where), library.import_root, package_name(library.package),
            os.path.join(inner, report), paths,
        )  # fmt: skip
        with tempfile.TemporaryFile() as log:  # a file: its size is capped by RLIMIT_FSIZE
            process = await asyncio.create_subprocess_exec(
                *sandbox.command(slot, argv), **sandbox.popen_kwargs(slot),
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
            )  # fmt: skip
            try:
                returncode = await asyncio.wait_for(process.wait(), self.spec.test_timeout_s)
            except TimeoutError:
                process.kill()
                await process.wait()
                returncode = -1
            finally:
                await asyncio.to_thread(sandbox.kill_all, slot)
            size = log.seek(0, os.SEEK_END)
            log.seek(max(0, size - MAX_LOG_BYTES))
            output = log.read().decode(errors="replace")
        run = read_report(slot.workdir / report, returncode, output)
        return TestRun({}, -1, run.tail) if returncode == -1 else run

    # ------------------------------------------------------------------ grading

    async def verify(self, task: Task, answer: str) -> Verdict:
        """The pristine library with the workspace's package modules; the whole suite."""
        assert self.bug is not None
        checkout = self.checkout
        async with self._lock:
            graded = await asyncio.to_thread(self._assemble, checkout)
            run = await self._run(graded, [checkout.library.tests])
        fail_to_pass = set(self.bug.fail_to_pass)
        pass_to_pass = checkout.baseline().passed() - fail_to_pass
        passed = run.passed()
        fixed = len(fail_to_pass & passed) / len(fail_to_pass)
        kept = len(pass_to_pass & passed) / max(1, len(pass_to_pass))
        success = fixed == 1.0 and kept == 1.0
        return Verdict(
            reward=1.0 if success else 0.0, success=success,
            components={"fail_to_pass": fixed, "pass_to_pass": kept},
        )  # fmt: skip

    def _assemble(self, checkout: Checkout) -> str:
        """A fresh tree to grade (its path under the work dir): the pristine sdist with the
        package's modules replaced by the workspace's, tests and conftest files excluded.

        A module missing from the workspace (deleted, or replaced by a link or a directory)
        is missing here too: deleting the buggy file must not bring the pristine one back.
        The tree belongs to root and is only readable by the sandbox's uid, so code under
        test cannot rewrite the tests before pytest collects them.
        """
        assert self.slot is not None
        graded = Path(tempfile.mkdtemp(prefix="graded-", dir=self.slot.workdir))
        tree = graded / "tree"
        shutil.copytree(checkout.tree, tree)
        package = checkout.library.package
        for path in _python_files(tree / package):
            if is_module(str(path.relative_to(tree))):
                path.unlink()
        mine = self.root / package
        root = self.root.resolve()
        found = _python_files(mine) if mine.is_dir() and not mine.is_symlink() else []
        modules = [p for p in found if is_module(str(p.relative_to(self.root)))]
        for path in modules[:MAX_MODULES]:
            inside = root in path.resolve().parents
            data = _read_plain_file(path, MAX_FILE_BYTES) if inside else None
            if data is None:
                continue  # a link, a special file, a huge one: not a module
            target = tree / path.relative_to(self.root)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        os.chmod(graded, 0o755)
        return f"{graded.name}/tree"


def _summary(run: TestRun, timeout_s: float) -> str:
    """What ``run_tests`` shows: counts, then each failure with its one-line message; the
    output's tail when nothing ran."""
    if run.returncode == -1:
        return f"the tests ran past {timeout_s:g} s and were stopped\n{run.tail[-1000:]}"
    if not run.outcomes:
        return f"no test ran (exit status {run.returncode}):\n{run.tail[-1500:]}"
    counts = Counter(run.outcomes.values())
    failed = run.failed()
    summary = f"{counts['PASSED']} passed, {len(failed)} failed" + "".join(
        f", {counts[label]} {word}"
        for label, word in (("SKIPPED", "skipped"), ("XFAIL", "xfailed"), ("XPASS", "xpassed"))
        if counts[label]
    )
    lines = [f"{t} - {run.messages.get(t, '')}".rstrip(" -") for t in failed[:MAX_FAILURES]]
    if len(failed) > MAX_FAILURES:
        lines.append(f"... and {len(failed) - MAX_FAILURES} more")
    return "\n".join([summary, *lines])


def _python_files(top: Path) -> list[Path]:
    """The ``.py`` files under ``top``, sorted, without entering linked directories."""
    found = []
    for folder, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found)


def _read_plain_file(path: Path, limit: int) -> bytes | None:
    """The bytes of a regular file, not through a link; None if it is not one or is
    larger than ``limit``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        return f.read(limit + 1)[:limit]
