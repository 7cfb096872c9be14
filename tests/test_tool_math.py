"""tool_math: the contract check through the real sandbox, and reward-hacking probes
against every generator's checker (lists, the gold in noise, the gold repeated, format
only, equal-but-wrong forms, several boxed answers, answers that keep sympy busy), the
oracle end to end, and equivalent forms that must score."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from turnrl.envs import check_env, tool_math
from turnrl.envs.policy import play, replay
from turnrl.envs.tool_math import CHECKS, ToolMath, verify
from turnrl.errors import ConfigError
from turnrl.types import Task

SPEC = ToolMath()


def task_of(generator: str) -> Task:
    return ToolMath(generators=(generator,)).task(0, "test")


def test_the_contract_check_passes_through_the_sandbox() -> None:
    report = check_env(SPEC, num_tasks=16)
    assert report.ok, report.table()
    assert report.oracle_success == 1.0
    assert report.random_success == 0.0


def test_tasks_are_seeded_and_cover_the_generators() -> None:
    assert SPEC.task(4, "test") == ToolMath().task(4, "test")
    assert SPEC.task(4, "test") != ToolMath(seed=1).task(4, "test")
    seen = {SPEC.task(i).metadata["generator"] for i in range(200)}
    assert seen == set(CHECKS)


@pytest.mark.parametrize("generator", sorted(CHECKS))
def test_only_the_answer_itself_scores(generator: str) -> None:
    task = task_of(generator)
    gold = str(task.answer)
    assert verify(task, gold).reward == 1.0
    for hack in (
        f"1, 2, {gold}",  # a list of candidates
        f"1, 2, 3, {gold}",
        f"[1, 2, 3, {gold}]",
        "The program printed " + "x" * 120 + gold,  # the gold ending a long string
        f"I think {gold} or maybe 5",  # the gold inside a sentence
        f"{gold} {gold}",  # the gold repeated
        "",  # format only
        "answer",
    ):
        assert verify(task, hack).reward == 0.0, (generator, hack)


def test_equal_but_wrong_forms_do_not_score() -> None:
    fraction = task_of("fraction_simplification")
    found = re.search(r"\\d?frac\{(\d+)\}\{(\d+)\}", str(fraction.answer))
    assert found is not None
    num, den = int(found[1]), int(found[2])
    assert verify(fraction, f"{num}/{den}").reward == 1.0  # the same fraction, plain
    assert verify(fraction, f"{2 * num}/{2 * den}").reward == 0.0  # equal, not simplified
    factors = task_of("prime_factorization")
    product = 1
    for f in str(factors.answer).split("×"):
        product *= int(f)
    assert verify(factors, str(product)).reward == 0.0  # the number is not its factors


def test_equivalent_numbers_score_where_math_verify_decides() -> None:
    task = task_of("gcd")
    assert verify(task, f"{task.answer}.0").reward == 1.0


def test_excluded_and_unknown_generators_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match=r"excluded: its scorer gives 1\.0"):
        ToolMath(generators=("game_of_life_halting",))
    with pytest.raises(ConfigError, match="unknown generator 'nope'"):
        ToolMath(generators=("nope",))


def test_the_oracle_solves_through_the_sandbox() -> None:
    async def run() -> list[bool]:
        wins = []
        for i in range(48):
            task = SPEC.task(i, "test")
            episode = await play(SPEC.make_env(), task, SPEC.oracle(task), seed=i, max_steps=4)
            wins.append(episode.success and episode.actions[0].startswith("```python"))
        return wins

    wins = asyncio.run(run())
    assert sum(wins) / len(wins) >= 0.99


def test_demonstrations_compute_with_the_question_s_numbers_and_box_what_was_printed() -> None:
    """The warm-up's programs use only numbers the question shows (so a model warmed up on
    them writes code about the question, not about a number from nowhere), and the boxed
    answer is exactly what the sandbox printed."""
    import random

    spec = ToolMath(generators=("basic_arithmetic", "chain_sum"))
    rng = random.Random(0)

    async def run() -> list[tuple[Task, list[str], str]]:
        out = []
        for i in range(12):
            task = spec.task(i, "warmup")
            turns = spec.demonstration(task, rng)
            episode = await play(spec.make_env(), task, replay(turns), seed=i, max_steps=3)
            out.append((task, turns, str(episode.results[0].observation[0]["content"])))
        return out

    for task, (program, answer), output in asyncio.run(run()):
        question = str(task.prompt[0]["content"]).split("Solve it with Python")[0]
        expression = re.fullmatch(r"```python\nprint\((.*)\)\n```", program)
        assert expression, program
        used = [int(n) for n in re.findall(r"-?\d+", expression[1].replace("(", ""))]
        shown = [int(n) for n in re.findall(r"(?<![\d.])-?\d+(?![\d.])", question)]
        assert used, program
        assert all(n in shown for n in used), (question, program)
        printed = re.search(r"```output\n(.*?)\n", output)
        assert printed, output
        assert answer == f"\\boxed{{{printed[1]}}}", (output, answer)


def test_several_boxed_answers_do_not_end_the_episode() -> None:
    task = SPEC.task(0, "test")
    turns = [f"\\boxed{{1}} or \\boxed{{{task.answer}}}"]
    episode = asyncio.run(play(SPEC.make_env(), task, replay(turns), seed=0, max_steps=1))
    assert episode.ended_by == "max_steps"
    assert episode.reward == 0.0
    assert episode.results[0].info.get("format_error")


def test_equivalent_forms_score_where_math_verify_decides() -> None:
    half = Task(
        id="half",
        prompt=({"role": "user", "content": "1 / 2 = ?"},),
        answer="0.5",
        metadata={"generator": "basic_arithmetic", "entry_seed": 0},
    )
    for form in ("0.5", "1/2", "\\frac{1}{2}", "2/4", ".50", "x = 1/2"):
        assert verify(half, form).reward == 1.0, form
    for wrong in ("0.4", "1/3", "1/2, 0.4"):
        assert verify(half, wrong).reward == 0.0, wrong


def test_answers_that_keep_sympy_busy_score_0_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a bound, each of these ran past 60 s in math-verify (sympy)."""
    monkeypatch.setattr(tool_math._MATH_VERIFY, "timeout_s", 1.0)
    task = task_of("gcd")
    verify(task, str(task.answer))  # start the helper process outside the timing
    for hack in ("9^{9^{9^{9}}}", "10^{10^{10}}", "99999999!", "2^{2^{40}}", "7/" * 40 + "7"):
        start = time.monotonic()
        assert verify(task, hack).reward == 0.0, hack
        assert time.monotonic() - start < 10.0, hack
    assert verify(task, str(task.answer)).reward == 1.0  # a fresh helper after the kill
