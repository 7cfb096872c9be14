"""The swe environment end to end on a real library (toolz 1.1.0 from its sdist): the oracle
fixes the bug, answers that game the grader score 0, and the tools stay in the workspace."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from turnrl.envs import check_env
from turnrl.envs.policy import Episode, play, replay
from turnrl.envs.swe import SWE
from turnrl.envs.swe import library as swe_library
from turnrl.formats import get_format
from turnrl.types import ToolCall

needs_pytest = pytest.mark.skipif(
    os.system(f"{swe_library.TEST_PYTHON} -c 'import pytest' 2>/dev/null") != 0
    and not os.environ.get("CI"),
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
    return asyncio.run(play(spec.make_env(), task, replay(turns, "done"), seed=0, max_steps=8))


def observations(episode: Episode) -> list[str]:
    return [str(m["content"]) for r in episode.results for m in r.observation]


def test_the_check_passes_and_the_oracle_fixes_every_bug(spec: SWE) -> None:
    report = check_env(spec, num_tasks=1)
    assert report.ok, report.table()
    assert report.oracle_success == 1.0
    for index in range(3):  # every validated bug, whichever split it is in
        task = spec.task(index, "train")
        episode = asyncio.run(play(spec.make_env(), task, spec.oracle(task), seed=0, max_steps=6))
        assert episode.success, observations(episode)
        assert episode.results[-1].info["reward_components"] == {
            "fail_to_pass": 1.0, "pass_to_pass": 1.0,
        }  # fmt: skip


def test_tasks_are_seeded_and_name_the_failing_tests(spec: SWE) -> None:
    assert spec.task(2, "train") == SWE(libraries=("toolz",), num_bugs=3).task(2, "train")
    task = spec.task(0, "test")
    assert task.metadata["fail_to_pass"][0].split("::")[0] in str(task.prompt[0]["content"])


def failing_test(spec: SWE) -> tuple[str, str]:
    """The first failing test's file and function name."""
    test_id = spec.task(0, "test").metadata["fail_to_pass"][0]
    path, name = test_id.split("::")
    return path, name.split("[")[0]


def test_editing_the_failing_test_instead_of_the_code_scores_zero(spec: SWE) -> None:
    path, name = failing_test(spec)
    hack = call("edit_file", path=path, old=f"def {name}(", new=f"def off_{name}(")  # uncollected
    episode = run(spec, [hack, call("run_tests", tests=path)])
    assert observations(episode)[0] == f"edited {path}"
    assert "0 failed" in observations(episode)[1]  # in the workspace the suite now passes
    assert not episode.success
    assert episode.reward == 0.0  # graded with the pristine tests


def test_emptying_a_test_file_scores_zero(spec: SWE) -> None:
    path, _ = failing_test(spec)
    task = spec.task(0, "test")
    env = spec.make_env()

    async def episode() -> float:
        await env.reset(task, 0)
        content = (env.workspace.root / path).read_text()
        await env.step(call("edit_file", path=path, old=content, new=""))
        result = await env.step("done")
        await env.close()
        return result.reward

    assert asyncio.run(episode()) == 0.0


def test_skipping_every_test_from_the_package_scores_zero(spec: SWE) -> None:
    skip = "import pytest\npytest.skip('nothing to see', allow_module_level=True)\n"
    first_line = '"""Toolz'
    hack = call("edit_file", path="toolz/__init__.py", old=first_line, new=skip + first_line)
    episode = run(spec, [hack, call("run_tests")])
    assert "no test ran" in observations(episode)[1] or "0 passed" in observations(episode)[1]
    assert episode.reward == 0.0


def test_answering_without_a_fix_scores_zero(spec: SWE) -> None:
    episode = run(spec, ["The bug is fixed. All tests pass."])
    assert episode.reward == 0.0
    assert episode.results[-1].info["reward_components"]["fail_to_pass"] == 0.0


def test_tools_refuse_paths_outside_the_workspace_and_say_what_is_wrong(spec: SWE) -> None:
    turns = [
        call("read_file", path="/etc/passwd"),
        call("read_file", path="../../../etc/passwd"),
        call("list_files", path="toolz/../.."),
        call("edit_file", path="toolz/itertoolz.py", old="return", new="return"),
        call("read_file", path="toolz/missing.py"),
        call("search", text="def merge_sorted"),
    ]
    seen = observations(run(spec, turns))
    assert "not '/etc/passwd'" in seen[0]
    assert "outside the workspace" in seen[1]
    assert "outside the workspace" in seen[2]
    assert "occurs" in seen[3]
    assert "times" in seen[3]
    assert "is not a file" in seen[4]
    assert "toolz/itertoolz.py:" in seen[5]


def test_a_symlink_left_by_sandboxed_code_does_not_lead_out(spec: SWE) -> None:
    task = spec.task(0, "test")
    env = spec.make_env()

    async def episode() -> list[str]:
        await env.reset(task, 0)
        root: Path = env.workspace.root
        (root / "leak").symlink_to("/etc/passwd")
        out = await env.step(call("read_file", path="leak"))
        found = await env.step(call("search", text="root", path="."))
        await env.close()
        return [str(m["content"]) for r in (out, found) for m in r.observation]

    seen = asyncio.run(episode())
    assert "outside the workspace" in seen[0]
    assert "root:" not in seen[1]
