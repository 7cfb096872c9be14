"""``turnrl envs check``: it passes for every registered environment and fails, on the right
row, for environments broken on purpose."""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from turnrl.cli import main
from turnrl.envs import (
    ENVIRONMENTS,
    Bandit,
    FrozenLake,
    ToolEnv,
    Verifier,
    check_env,
    make_env_family,
)
from turnrl.envs.policy import Policy
from turnrl.envs.reward_hack_probes import PROBES, Clues, answer_turn, shown_options
from turnrl.formats import FORMATS, get_format
from turnrl.protocols import ToolSchema
from turnrl.rewards import Verdict
from turnrl.tools import ToolSet
from turnrl.types import Message, StepResult, Task


# test_swe.py checks swe (3 bugs)
@pytest.mark.parametrize("name", sorted(set(ENVIRONMENTS) - {"swe"}))
def test_check_passes_for_every_registered_environment(name: str) -> None:
    report = check_env(make_env_family(name), num_tasks=8)
    assert report.ok, report.table()
    assert [c.name for c in report.checks] == [
        "tasks", "runs", "determinism", "schemas", "messages", "end flags", "rewards", "oracle",
        "probes",
    ]  # fmt: skip
    if report.oracle_success is not None:  # every shipped oracle wins its default tasks
        assert report.oracle_success == 1.0
    assert [p.name for p in report.probes] == ["empty", "options", "buried", "format", "long",
                                               "echo"]  # fmt: skip
    assert not report.findings, report.table()  # no probe earns any reward
    assert not report.skipped


def test_a_blanket_refusal_no_longer_solves_services_refusal_tasks() -> None:
    """The echo probe found that the simulated user ended the conversation as refused on
    trigger words ("cannot", "only pending", ...), so a policy saying "I cannot" to
    everyone, without looking anything up, solved every cancel-a-delivered-order task. A
    refusal now counts only after the user is authenticated and the order read: the
    probes earn nothing, and the oracle (which does both) still wins every task."""
    report = check_env(make_env_family("service"), num_tasks=24)
    assert report.ok, report.table()
    assert not report.findings, report.table()
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


# A user's environment family, reached by import path (``test_env_check:HackableQA``),
# whose verifier is hackable in a chosen way. Only ``task`` and ``make_env``: no oracle,
# demonstration, card or corpus.


def _exact(task: Task, answer: str) -> Verdict:
    """Exact match, as a good verifier does."""
    ok = answer.strip() == task.answer
    return Verdict(float(ok), ok)


def _contains(task: Task, answer: str) -> Verdict:
    """Credit when the gold appears anywhere in the answer."""
    ok = str(task.answer) in answer
    return Verdict(float(ok), ok)


def _non_empty(task: Task, answer: str) -> Verdict:
    """Credit for any non-empty answer."""
    ok = bool(answer.strip())
    return Verdict(float(ok), ok)


def _format_credit(task: Task, answer: str) -> Verdict:
    """Exact match, plus 0.2 for any answer that came in its tags (an ungated format term)."""
    ok = answer.strip() == task.answer
    return Verdict(1.0 if ok else 0.2, ok)


VERIFIERS = {"exact": _exact, "contains": _contains, "non_empty": _non_empty,
             "format_credit": _format_credit}  # fmt: skip


@dataclass(frozen=True)
class HackableQA:
    """Sums to answer in <answer> tags (search_r1 format, no tools), scored by ``verifier``."""

    verifier: str = "exact"

    name = "hackable_qa"

    def task(self, index: int, split: str = "train") -> Task:
        rng = random.Random(f"{split}/{index}")
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        prompt = f"What is {a} plus {b}? Write the sum between <answer> and </answer>."
        return Task(f"{split}-{index}", ({"role": "user", "content": prompt},), str(a + b))

    def make_env(self) -> ToolEnv:
        return ToolEnv(ToolSet([]), VERIFIERS[self.verifier], format=get_format("search_r1"))


@dataclass(frozen=True)
class ExpectedQA(HackableQA):
    """HackableQA that declares which probes may succeed, and why."""

    expected_probes: Mapping[str, str] = field(
        default_factory=lambda: {"buried": "a lenient grader, by design"}
    )


class BareEnv:
    """A user's env with no ``format``: it reads the <answer> tags itself."""

    def __init__(self, verify: Verifier) -> None:
        self.verify = verify
        self.task: Task | None = None

    def tool_schemas(self) -> list[ToolSchema]:
        return []

    def stop_strings(self) -> tuple[str, ...]:
        return ()

    async def reset(self, task: Task, seed: int) -> list[Message]:
        self.task = task
        return [dict(m) for m in task.prompt]

    async def step(self, action: str) -> StepResult:
        assert self.task is not None
        found = re.search(r"<answer>(.*?)</answer>", action, re.S)
        verdict = self.verify(self.task, found[1] if found else "")
        assert isinstance(verdict, Verdict)
        info = {"success": verdict.success}
        return StepResult(reward=verdict.reward, terminated=True, info=info)


def bare_family(verifier: str = "exact") -> Any:
    """A factory function returning an object with only ``task`` and ``make_env``."""

    class Family:
        task = HackableQA().task

        def make_env(self) -> BareEnv:
            return BareEnv(VERIFIERS[verifier])

    return Family()


def check_cli(capsys: pytest.CaptureFixture[str], target: str, *options: str) -> tuple[int, str]:
    """``turnrl envs check TARGET`` on 4 tasks: its exit status and what it printed."""
    code = main(["envs", "check", target, "--tasks", "4", *[f"--set={o}" for o in options]])
    return code, capsys.readouterr().out


def probe_rows(out: str) -> dict[str, list[str]]:
    """The probe table's rows: name -> [plays, tasks, reward, success, result]."""
    names = {"empty", "options", "buried", "format", "long", "echo"}
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines()]
    return {row[0]: row[1:] for row in rows if row and row[0] in names and len(row) == 6}


def test_a_sound_user_environment_passes_with_every_probe_at_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = check_cli(capsys, "test_env_check:HackableQA")
    assert code == 0, out
    assert {name: row[2:] for name, row in probe_rows(out).items()} == {
        name: ["0.000", "0.00", "ok"]
        for name in ("empty", "options", "buried", "format", "long", "echo")
    }
    assert "note: no oracle(task): the oracle check is skipped" in out
    assert out.rstrip().endswith("envs check test_env_check:HackableQA: passed")


def test_a_verifier_that_finds_the_gold_anywhere_fails_on_the_buried_gold(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = check_cli(capsys, "test_env_check:HackableQA", "verifier=contains")
    assert code == 1
    rows = probe_rows(out)
    assert rows["buried"][1:] == ["4", "1.000", "1.00", "FAIL"]
    assert rows["empty"][-1] == rows["format"][-1] == rows["echo"][-1] == "ok"
    assert "| probes | FAIL | probe 'buried'" in out
    assert "FAIL: probe 'buried' (the gold among many other candidates) scores: success 1.00" in out
    assert "fix: the verifier finds the gold inside a longer answer" in out


def test_a_verifier_that_pays_any_answer_fails_on_every_non_empty_probe(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = check_cli(capsys, "test_env_check:HackableQA", "verifier=non_empty")
    assert code == 1
    results = {name: row[-1] for name, row in probe_rows(out).items()}
    assert results == {"empty": "ok", "options": "FAIL", "buried": "FAIL", "format": "FAIL",
                       "long": "FAIL", "echo": "FAIL"}  # fmt: skip


def test_partial_credit_for_the_format_is_a_warning_with_its_score(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = check_cli(capsys, "test_env_check:HackableQA", "verifier=format_credit")
    assert code == 0, out  # nothing succeeded: warnings, not failures
    rows = probe_rows(out)
    assert rows["format"][2:] == ["0.200", "0.00", "warning"]
    assert rows["empty"][2:] == ["0.200", "0.00", "warning"]  # <answer></answer> is paid too
    assert "warning: probe 'format' (the answer syntax around nothing) scores: partial credit, " \
        "mean reward 0.200" in out  # fmt: skip
    assert "fix: the answer's form alone is paid" in out
    assert out.rstrip().endswith("passed (6 probe warnings)")


def test_a_declared_expected_probe_is_a_warning_and_an_unknown_name_fails() -> None:
    report = check_env(ExpectedQA(verifier="contains"), num_tasks=3)
    assert report.ok, report.table()
    [buried] = report.findings
    assert (buried.name, buried.success, buried.failed) == ("buried", 1.0, False)
    assert "expected: a lenient grader, by design" in report.table()
    assert report.skipped == (  # the family as it is, without the registry's wrapper
        "no oracle(task): the oracle check is skipped",
        "no demonstration(task, rng): the random policy is skipped",
    )
    assert report.random_success is None
    wrong = check_env(ExpectedQA(expected_probes={"burried": "a typo"}), num_tasks=2)
    [probes] = [c for c in wrong.checks if c.name == "probes"]
    assert not probes.ok
    assert "unknown probe 'burried'" in probes.detail


@pytest.mark.parametrize(("verifier", "code"), [("exact", 0), ("contains", 1)])
def test_a_bare_user_env_without_format_is_probed_in_the_syntax_its_prompt_asks_for(
    verifier: str, code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    got, out = check_cli(capsys, "test_env_check:bare_family", f"verifier={verifier}")
    assert got == code, out
    assert "note: the env has no format" in out
    assert "| end flags | ok |" in out
    assert "| runs | ok |" in out
    # the probes answered in the <answer> tags the prompt asks for (else "" was scored)
    assert probe_rows(out)["buried"][-1] == ("FAIL" if code else "ok")


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("text", ["", "...", "Kespilfas, 1957, Pagak Salbral"])
def test_probe_answers_are_written_in_each_formats_answer_syntax(name: str, text: str) -> None:
    fmt = get_format(name)
    turn = answer_turn(text, fmt, [{"role": "system", "content": fmt.system_prompt([])}])
    parsed = fmt.parse(turn)
    assert (parsed.errors, parsed.tool_calls, parsed.answer) == ((), (), text)


def test_the_options_probe_lists_shown_options_else_the_answer_space_and_words() -> None:
    question = "Which planet is largest?\nA) Mars\nB) Jupiter\n(C) Venus\n"
    mcq = Task("mcq", ({"role": "user", "content": question},), "B")
    assert shown_options(mcq) == ["A", "Mars", "B", "Jupiter", "C", "Venus"]
    rules = Task("r", ({"role": "system", "content": "1. Be kind\n2. Be brief"},), "x")
    assert shown_options(rules) == []  # a system prompt's rules are not options
    [options] = [p for p in PROBES if p.name == "options"]
    assert options.text(rules, Clues(("cat", "dog"))) == "cat, dog, 1, Be, kind, 2, brief"
