"""The swe environment end to end on a real library (toolz 1.1.0 from its sdist): the oracle
fixes the bug, answers that game the grader score 0, and the tools stay in the workspace."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import swe_tests_can_run
from turnrl.envs import check_env
from turnrl.envs.policy import Episode, play, replay
from turnrl.envs.swe import SWE
from turnrl.envs.swe import runner as swe_runner
from turnrl.envs.swe.env import SweEnv
from turnrl.envs.swe.library import Checkout, Library
from turnrl.envs.swe.mutate import Mutation, apply
from turnrl.errors import ConfigError
from turnrl.formats import get_format
from turnrl.types import ToolCall

needs_pytest = pytest.mark.skipif(
    not swe_tests_can_run(),
    reason="/usr/bin/python3 has no pytest (apt-get install python3-pytest)",
)
pytestmark = needs_pytest


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SWE]:
    cache = tmp_path_factory.mktemp("swe-cache")
    old = os.environ.get("TURNRL_CACHE")
    os.environ["TURNRL_CACHE"] = str(cache)
    try:
        yield SWE(libraries=("toolz",), num_bugs=3)
    finally:
        if old is None:
            del os.environ["TURNRL_CACHE"]
        else:
            os.environ["TURNRL_CACHE"] = old


def call(name: str, **arguments: Any) -> str:
    return get_format("hermes").render_call(ToolCall(name, arguments))


def run(spec: SWE, turns: list[str], index: int = 0) -> Episode:
    task = spec.task(index, "test")
    return asyncio.run(
        play(spec.make_env(), task, replay(turns, "done"), seed=0, max_steps=len(turns) + 1)
    )


def observations(episode: Episode) -> list[str]:
    return [str(m["content"]) for r in episode.results for m in r.observation]


def test_the_check_passes_and_the_oracle_fixes_every_bug(spec: SWE) -> None:
    report = check_env(spec, num_tasks=1)
    assert report.ok, report.table()
    assert report.oracle_success == 1.0
    assert report.random_success == 0.0
    for index in range(3):  # every validated bug, whichever split it is in
        task = spec.task(index, "train")
        episode = asyncio.run(play(spec.make_env(), task, spec.oracle(task), seed=0, max_steps=6))
        assert episode.success, observations(episode)
        assert episode.results[-1].info["reward_components"] == {
            "fail_to_pass": 1.0, "pass_to_pass": 1.0,
        }  # fmt: skip
        assert "0 failed" in observations(episode)[2]  # the oracle's own run of the tests


def test_tasks_are_seeded_and_another_seed_reuses_the_cached_bugs(spec: SWE) -> None:
    assert spec.task(2, "train") == SWE(libraries=("toolz",), num_bugs=3).task(2, "train")
    task = spec.task(0, "test")
    assert task.metadata["fail_to_pass"][0].split("::")[0] in str(task.prompt[0]["content"])
    cached = sorted(Path(os.environ["TURNRL_CACHE"]).rglob("mutants-*.json"))
    before = [p.read_text() for p in cached]
    other = SWE(libraries=("toolz",), num_bugs=3, seed=1)
    tasks = [other.task(i, "train") for i in range(6)]
    assert tasks != [spec.task(i, "train") for i in range(6)]
    bugs = {(b.path, b.mutation.lineno) for b in spec._bugs}
    assert {(t.metadata["path"], t.metadata["mutation"]["lineno"]) for t in tasks} <= bugs
    assert sorted(Path(os.environ["TURNRL_CACHE"]).rglob("mutants-*.json")) == cached
    assert [p.read_text() for p in cached] == before  # nothing validated again


Hack = Callable[[Path, dict[str, Any]], None]
"""Changes a workspace (its root, the task's metadata) as the model could: with edit_file,
or with code it makes run_tests execute in the sandbox."""


def _failing_test(root: Path, meta: dict[str, Any]) -> tuple[Path, str]:
    path, name = meta["fail_to_pass"][0].split("::")
    return root / path, name.split("[")[0]


def rename_failing_test(root: Path, meta: dict[str, Any]) -> None:
    path, name = _failing_test(root, meta)
    path.write_text(path.read_text().replace(f"def {name}(", f"def off_{name}("))


def empty_failing_test_file(root: Path, meta: dict[str, Any]) -> None:
    _failing_test(root, meta)[0].write_text("")


def delete_the_tests(root: Path, meta: dict[str, Any]) -> None:
    shutil.rmtree(root / "toolz" / "tests")


def conftest_that_skips_everything(root: Path, meta: dict[str, Any]) -> None:
    skip = "def pytest_collection_modifyitems(items):\n    items[:] = []\n"
    for where in ("conftest.py", "toolz/conftest.py", "toolz/tests/conftest.py"):
        (root / where).write_text(skip)


def conftest_that_passes_everything(root: Path, meta: dict[str, Any]) -> None:
    (root / "toolz" / "conftest.py").write_text(
        "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n"
    )


def package_that_skips_its_importers(root: Path, meta: dict[str, Any]) -> None:
    init = root / "toolz" / "__init__.py"
    skip = "import pytest\npytest.skip('nothing to see', allow_module_level=True)\n"
    init.write_text(skip + init.read_text())


def print_the_passed_lines(root: Path, meta: dict[str, Any]) -> None:
    """pytest's -rA summary lines for the failing tests, printed after pytest's own."""
    lines = "".join(f"PASSED {t}\\n" for t in meta["fail_to_pass"])
    init = root / "toolz" / "__init__.py"
    forge = f"import atexit, sys\natexit.register(lambda: sys.stdout.write('{lines}'))\n"
    init.write_text(forge + init.read_text())


def delete_the_buggy_module(root: Path, meta: dict[str, Any]) -> None:
    (root / meta["path"]).unlink()


def link_the_buggy_module_to_a_copy(root: Path, meta: dict[str, Any]) -> None:
    module = root / meta["path"]
    copy = module.with_name("copy.txt")
    module.rename(copy)
    module.symlink_to(copy)


def fix_it(root: Path, meta: dict[str, Any]) -> None:
    """The control: undo the mutation on disk."""
    mutation = meta["mutation"]
    module = root / meta["path"]
    inverse = {**mutation, "before": mutation["after"], "after": mutation["before"]}
    inverse["end_lineno"] = mutation["lineno"]
    inverse["end_col"] = mutation["col"] + len(mutation["after"].encode())
    module.write_text(apply(module.read_text(), Mutation(**inverse)))


HACKS: list[Hack] = [
    rename_failing_test,
    empty_failing_test_file,
    delete_the_tests,
    conftest_that_skips_everything,
    conftest_that_passes_everything,
    package_that_skips_its_importers,
    print_the_passed_lines,
    delete_the_buggy_module,
    link_the_buggy_module_to_a_copy,
]


async def _graded(spec: SWE, hack: Hack) -> tuple[float, str]:
    """The reward of answering after ``hack``, and what run_tests showed the model."""
    task = spec.task(0, "test")
    env: SweEnv = spec.make_env()
    try:
        await env.reset(task, 0)
        hack(env.workspace.root, dict(task.metadata))
        shown = await env.step(call("run_tests"))
        result = await env.step("done")
    finally:
        await env.close()
    return result.reward, str(shown.observation[0]["content"])


def test_every_way_of_gaming_the_tests_scores_zero_and_a_fix_scores_one(spec: SWE) -> None:
    async def all_of_them() -> list[tuple[float, str]]:
        return list(await asyncio.gather(*(_graded(spec, h) for h in [*HACKS, fix_it])))

    *hacked, (fixed, fixed_shown) = asyncio.run(all_of_them())
    assert fixed == 1.0, fixed_shown
    scored = {h.__name__: reward for h, (reward, _) in zip(HACKS, hacked, strict=True)}
    assert scored == dict.fromkeys(scored, 0.0)
    shown = {h.__name__: text for h, (_, text) in zip(HACKS, hacked, strict=True)}
    # In the workspace several hacks do fool run_tests; only grading is immune.
    assert shown["conftest_that_passes_everything"].split(",")[1] == " 0 failed"


def test_answering_without_a_fix_scores_zero(spec: SWE) -> None:
    episode = run(spec, ["The bug is fixed. All tests pass."])
    assert episode.reward == 0.0
    assert episode.results[-1].info["reward_components"]["fail_to_pass"] == 0.0


def test_the_runner_refuses_a_package_imported_from_outside_the_tree(tmp_path: Path) -> None:
    """A package deleted from the workspace must not be replaced by an installed copy (on
    Debian, more_itertools is one): here the stdlib's colorsys stands for it."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_it.py").write_text(
        "import colorsys\n\n\ndef test_it():\n    pass\n"
    )
    run = swe_runner.run_tests_on_host(tmp_path, ".", "colorsys", ["tests"], timeout_s=60)
    assert run.outcomes == {}
    assert "colorsys was imported from" in run.tail
    (tmp_path / "colorsys").mkdir()
    (tmp_path / "colorsys" / "__init__.py").write_text("")
    run = swe_runner.run_tests_on_host(tmp_path, ".", "colorsys", ["tests"], timeout_s=60)
    assert run.outcomes == {"tests/test_it.py::test_it": "PASSED"}


def test_tools_refuse_bad_input_and_say_what_is_wrong(spec: SWE) -> None:
    task = spec.task(0, "test")
    module = task.metadata["path"]
    turns = [
        call("edit_file", path=module, old="return", new="return"),
        call("edit_file", path=module, old="no such text anywhere", new="x"),
        call("edit_file", path=module, old="", new="x"),
        call("read_file", path="toolz/missing.py"),
        call("read_file", path=module, start=20, end=10),
        call("read_file", path="toolz"),
        call("list_files", path="toolz/itertoolz.py"),
        call("search", text=""),
        call("run_tests", tests="--collect-only"),
        call("search", text="def merge_sorted"),
        call("read_file", path="toolz/itertoolz.py", start=1, end=3),
    ]
    seen = observations(run(spec, turns))
    assert "times in" in seen[0]
    assert "longer piece" in seen[0]
    assert "occurs 0 times" in seen[1]
    assert "without the line numbers" in seen[1]
    assert "old is empty" in seen[2]
    assert "no such file" in seen[3]
    assert "end (10) is before start (20)" in seen[4]
    assert "is not a file" in seen[5]
    assert "is not a directory" in seen[6]
    assert "non-empty text" in seen[7]
    assert "not pytest options" in seen[8]
    assert "toolz/itertoolz.py:" in seen[9]
    assert seen[10].splitlines()[0].startswith("    1  ")


def test_tools_refuse_paths_outside_the_workspace(spec: SWE) -> None:
    turns = [
        call("read_file", path="/etc/passwd"),
        call("read_file", path="../../../etc/passwd"),
        call("list_files", path="toolz/../.."),
        call("edit_file", path="../graded/x.py", old="a", new="b"),
        call("search", text="root", path="/etc"),
        call("run_tests", tests="../../etc/passwd"),
    ]
    seen = observations(run(spec, turns))
    assert "not '/etc/passwd'" in seen[0]
    assert all("outside the workspace" in s for s in seen[1:4]), seen
    assert "not '/etc'" in seen[4]
    assert "outside the workspace" in seen[5]


def test_a_symlink_left_by_sandboxed_code_does_not_lead_out(spec: SWE) -> None:
    task = spec.task(0, "test")
    env = spec.make_env()

    async def episode() -> list[str]:
        await env.reset(task, 0)
        root: Path = env.workspace.root
        (root / "leak").symlink_to("/etc/passwd")
        (root / "toolz" / "leak.py").symlink_to("/etc/passwd")
        out = await env.step(call("read_file", path="leak"))
        found = await env.step(call("search", text="root", path="."))
        edited = await env.step(call("edit_file", path="leak", old="root", new="toor"))
        await env.close()
        return [str(m["content"]) for r in (out, found, edited) for m in r.observation]

    seen = asyncio.run(episode())
    assert "outside the workspace" in seen[0]
    assert "root:" not in seen[1]
    assert "outside the workspace" in seen[2]


def test_a_library_that_cannot_be_fetched_is_a_clear_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # offline and fast: no index, an empty folder
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    checkout = Checkout(Library("toolz", "1.1.0", package="toolz", tests="toolz/tests"), tmp_path)
    with pytest.raises(ConfigError, match=r"cannot fetch the sdist of toolz==1\.1\.0") as error:
        checkout.fetch()
    assert "python -m turnrl.envs.swe" in str(error.value)
    assert not checkout.tree.exists()
    assert [p.name for p in checkout.dir.iterdir()] == []  # no staging left behind
