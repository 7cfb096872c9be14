"""``turnrl envs check``: it passes for every registered environment and fails, on the right
row, for environments broken on purpose."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any

import pytest

from turnrl.cli import main
from turnrl.envs import ENVIRONMENTS, Bandit, FrozenLake, check_env, make_env_spec
from turnrl.envs.policy import Policy
from turnrl.protocols import ToolSchema
from turnrl.types import Message, StepResult, Task


@pytest.mark.parametrize("name", sorted(set(ENVIRONMENTS) - {"swe"}))  # test_swe.py: 3 bugs
def test_check_passes_for_every_registered_environment(name: str) -> None:
    report = check_env(make_env_spec(name), num_tasks=8)
    assert report.ok, report.table()
    assert [c.name for c in report.checks] == [
        "tasks", "runs", "determinism", "schemas", "messages", "end flags", "rewards", "oracle"
    ]  # fmt: skip
    if report.oracle_success is not None:  # every shipped oracle wins its default tasks
        assert report.oracle_success == 1.0


def test_check_passes_on_slippery_ice_against_the_oracles_own_expectation() -> None:
    report = check_env(FrozenLake(slip_prob=0.2), num_tasks=10)
    assert report.ok, report.table()


def test_cli_check_prints_the_card_and_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["envs", "check", "frozen_lake", "--tasks", "4", "--set", "size=5"]) == 0
    out = capsys.readouterr().out
    assert "cross a 5x5 frozen lake" in out
    assert "| determinism | ok |" in out
    assert out.rstrip().endswith("envs check frozen_lake: passed")


class BrokenEnv:
    """A real game env with one flaw added."""

    def __init__(self, inner: Any, flaw: str) -> None:
        self.inner, self.flaw = inner, flaw

    def stop_strings(self) -> tuple[str, ...]:
        return self.inner.stop_strings()

    def tool_schemas(self) -> list[ToolSchema]:
        if self.flaw == "schema":
            return [
                {"type": "function", "function": {"name": "move", "parameters": {"type": "array"}}}
            ]
        return self.inner.tool_schemas()

    async def reset(self, task: Task, seed: int) -> list[Message]:
        return await self.inner.reset(task, seed)

    async def step(self, action: str) -> StepResult:
        if self.inner.ended:  # "endless": keep going after the game ended
            return StepResult()
        result: StepResult = await self.inner.step(action)
        if self.flaw == "crash":
            raise KeyError("boom")
        if self.flaw == "reward" and result.terminated:
            return dataclasses.replace(result, reward=2.0)
        if self.flaw == "nan":
            return dataclasses.replace(result, reward=math.nan)
        if self.flaw == "both" and result.terminated:
            return dataclasses.replace(result, truncated=True)
        if self.flaw == "endless":
            return dataclasses.replace(result, truncated=False)
        if self.flaw == "noise":
            noise = {"role": "tool", "content": f"{random.random()}"}
            return dataclasses.replace(result, observation=(*result.observation, noise))
        if self.flaw == "message":
            return dataclasses.replace(result, observation=({"role": "robot", "content": 1},))
        return result


@dataclass(frozen=True)
class Broken(FrozenLake):
    """FrozenLake with one flaw, named by ``flaw``."""

    flaw: str = "reward"

    name = "broken"

    def task(self, index: int, split: str = "train") -> Task:
        task = super().task(index, split)
        if self.flaw == "tasks":  # unseeded: another build gives other tasks
            return dataclasses.replace(task, id=f"{split}-{index}-{random.random()}")
        return task

    def make_env(self) -> Any:
        return BrokenEnv(super().make_env(), self.flaw)

    def oracle(self, task: Task) -> Policy:
        if self.flaw == "oracle":
            return lambda messages: "I give up."
        return super().oracle(task)


@pytest.mark.parametrize(
    ("flaw", "row"),
    [
        ("reward", "rewards"),
        ("nan", "rewards"),
        ("both", "end flags"),
        ("endless", "end flags"),
        ("noise", "determinism"),
        ("tasks", "tasks"),
        ("schema", "schemas"),
        ("message", "messages"),
        ("oracle", "oracle"),
        ("crash", "runs"),
    ],
)
def test_check_fails_on_the_flaw(flaw: str, row: str) -> None:
    report = check_env(Broken(flaw=flaw), num_tasks=3)
    failed = {c.name for c in report.checks if not c.ok}
    assert not report.ok
    assert row in failed, report.table()


def test_a_task_source_whose_seed_is_ignored_fails() -> None:
    @dataclass(frozen=True)
    class Unseeded(Bandit):
        def task(self, index: int, split: str = "train") -> Task:
            return Bandit().task(index, split)

    report = check_env(Unseeded(seed=3), num_tasks=3)
    [tasks] = [c for c in report.checks if c.name == "tasks"]
    assert not tasks.ok
    assert "different seed" in tasks.detail


def test_cli_check_exits_non_zero_on_a_broken_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(ENVIRONMENTS, "broken", Broken)
    assert main(["envs", "check", "broken", "--tasks", "2", "--set", "flaw=both"]) == 1
    assert "| end flags | FAIL |" in capsys.readouterr().out
    assert main(["envs", "check", "broken", "--set", "nonsense=1"]) == 2


def test_unknown_tool_calls_are_truncated_by_the_budget_not_terminated() -> None:
    report = check_env(Bandit(), num_tasks=2)
    [flags] = [c for c in report.checks if c.name == "end flags"]
    assert flags.ok
    assert "max_moves 2/2" in flags.detail  # the unknown-tool call spent the single pull
