"""tool_math: the contract check through the real sandbox, and reward-hacking probes
against every generator's checker (lists, the gold in noise, the gold repeated, format
only, equal-but-wrong forms)."""

from __future__ import annotations

import re

import pytest

from turnrl.envs import check_env
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
