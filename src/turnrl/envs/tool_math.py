"""``tool_math``: math problems solved with a Python interpreter (ToRL style).

Problems come from reasoning-gym's procedural generators (deterministic by seed): a
curated list whose answers can be checked exactly and that a short program solves. The
model writes a ```python block, which runs in a sandboxed persistent interpreter (one per
episode; bubblewrap where it runs), reads the ```output, and answers with ``\\boxed{...}``
(the ``code`` format). The episode's reward is 1 when the boxed answer is right.

How each generator is checked, and why (reward hacks found by probing the scorers with a
list of candidates, the gold inside a sentence, the gold repeated, an empty answer):

- basic_arithmetic, chain_sum, gcd, lcm, simple_equations: math-verify equivalence, or
  reasoning-gym's score exactly 1.0 (its partial credit for the gold inside a longer
  answer is never paid);
- gsm_symbolic: math-verify only (reasoning-gym gives 1.0 to "I think 279 or maybe 5");
- decimal_arithmetic, power_function, prime_factorization: reasoning-gym's score exactly
  1.0 only (math-verify's numeric tolerance and its reading of "3 × 3 × 71" as 639 would
  accept wrong answers); a scorer that raises on garbage scores 0;
- fraction_simplification: the answer must be one fraction with exactly the gold
  numerator and denominator (an equal but unsimplified fraction is wrong; reasoning-gym
  accepts the gold repeated twice);
- excluded: game_of_life_halting (its scorer pays any non-empty answer).

reasoning-gym and math-verify are imported when first needed (``pip install
'turnrl[math]'``); math-verify runs without its signal-based timeouts (they only work on
the main thread), so answers are cut to 200 characters before parsing.
"""

from __future__ import annotations

import functools
import random
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.envs.card import EnvCard
from turnrl.envs.policy import Policy
from turnrl.envs.tool_env import ToolEnv
from turnrl.errors import ConfigError
from turnrl.formats import get_format
from turnrl.rewards import Verdict
from turnrl.tools import PythonInterpreter, Sandbox, ToolSet, python_tool
from turnrl.types import Message, Task, ToolCall

CHECKS: dict[str, str] = {
    "basic_arithmetic": "verify_or_score",
    "chain_sum": "verify_or_score",
    "gcd": "verify_or_score",
    "lcm": "verify_or_score",
    "simple_equations": "verify_or_score",
    "gsm_symbolic": "verify",
    "decimal_arithmetic": "score",
    "power_function": "score",
    "prime_factorization": "score",
    "fraction_simplification": "fraction",
}
EXCLUDED = {"game_of_life_halting": "its scorer gives 1.0 to any non-empty answer"}
MAX_ANSWER_CHARS = 200
_FRACTION = re.compile(r"^\$?\s*(-?)\s*(?:\\d?frac\{(\d+)\}\{(\d+)\}|(\d+)\s*/\s*(\d+))\s*\$?$")


@dataclass(frozen=True)
class ToolMath:
    """ToRL-style math with a sandboxed Python tool; see the module docstring."""

    generators: tuple[str, ...] = tuple(CHECKS)
    """reasoning-gym datasets to draw problems from (each task picks one, seeded)."""
    max_tool_calls: int = 4
    """Code runs per episode."""
    code_timeout_s: float = 10.0
    """Wall-clock limit of one code run."""
    sandbox: str = "auto"
    """``auto`` (bubblewrap, else the rlimit fallback, which warns), ``bwrap`` or ``rlimit``."""
    seed: int = 0
    """Seed of the task stream."""

    name = "tool_math"
    chance = 0.0
    """A random number is almost never the answer."""

    def __post_init__(self) -> None:
        if not self.generators:
            raise ConfigError("tool_math.generators: give at least one generator")
        for g in self.generators:
            if g in EXCLUDED:
                raise ConfigError(f"tool_math: generator {g!r} is excluded: {EXCLUDED[g]}")
            if g not in CHECKS:
                raise ConfigError(
                    f"tool_math: unknown generator {g!r}; supported: {', '.join(CHECKS)}"
                )
        if self.max_tool_calls < 1 or not self.code_timeout_s > 0:
            raise ConfigError("tool_math: max_tool_calls >= 1 and code_timeout_s > 0")

    @functools.cached_property
    def _sandbox(self) -> Sandbox:
        return Sandbox(self.sandbox)  # type: ignore[arg-type]

    def task(self, index: int, split: str = "train") -> Task:
        rng = random.Random(f"tool_math/{self.seed}/{split}/{index}")
        generator = rng.choice(self.generators)
        entry = _entry(generator, rng.randrange(2**31))
        prompt = (
            f"{entry['question']}\n\nSolve it with Python: write code in a ```python block "
            "and read its output. Give the final answer as \\boxed{answer}."
        )
        return Task(
            id=f"{split}-{index}",
            prompt=({"role": "user", "content": prompt},),
            answer=str(entry["answer"]),
            metadata={"generator": generator, "entry_seed": entry["seed"]},
        )

    def make_env(self) -> ToolEnv:
        def tools(task: Task) -> ToolSet:
            interpreter = PythonInterpreter(self._sandbox, timeout_s=self.code_timeout_s)
            return ToolSet([python_tool(interpreter)], on_close=[interpreter.close])

        return ToolEnv(tools, get_format("code"), verify, max_tool_calls=self.max_tool_calls)

    def oracle(self, task: Task) -> Policy:
        """Runs a program that prints the answer, then boxes what the program printed: a
        check of the scaffold end to end (sandbox, output, answer extraction, verifier),
        not of the mathematics."""
        fmt = get_format("code")
        program = fmt.render_call(
            ToolCall("python", {"code": f"answer = {str(task.answer)!r}\nprint(answer)"})
        )

        def policy(messages: Sequence[Message]) -> str:
            if messages[-1]["role"] != "tool":
                return program
            output = re.search(r"```output\n(.*?)\n```", str(messages[-1]["content"]), re.S)
            printed = output[1].strip() if output else ""
            return f"The program printed the answer. \\boxed{{{printed}}}"

        return policy

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """Format-only turns (replayed, the random policy): code printing a random number,
        then that number boxed."""
        fmt = get_format("code")
        guess = rng.randint(0, 999)
        return [fmt.render_call(ToolCall("python", {"code": f"print({guess})"})),
                f"\\boxed{{{guess}}}"]  # fmt: skip

    def corpus(self) -> list[str]:
        lines = []
        for i in range(60):
            task = self.task(i, "corpus")
            lines.append(str(task.prompt[0]["content"]))
            lines += self.demonstration(task, random.Random(i))
        return lines

    @property
    def card(self) -> EnvCard:
        isolation = "bubblewrap" if self._sandbox.isolated else "rlimit fallback, NOT isolated"
        return EnvCard(
            name=self.name,
            summary=f"solve reasoning-gym problems ({', '.join(self.generators)}) with Python",
            tools=(
                f"python(code) -> output; a persistent interpreter per episode ({isolation}), "
                f"{self.code_timeout_s:g} s per run",
            ),
            tool_budget=self.max_tool_calls,
            turn_limit=None,
            scaffold="code format (ToRL): ```python blocks run, ```output comes back, the "
            "final answer is \\boxed{...}",
            evaluator="reward 1 iff the boxed answer is right: math-verify and/or "
            "reasoning-gym's score of exactly 1.0, per generator (see turnrl.envs.tool_math)",
            on_failure="an error or timeout in the code is its output; a run past the budget "
            "is refused; a wrong or missing answer ends the episode with 0",
            chance=self.chance,
        )


@functools.lru_cache(maxsize=4096)
def _dataset(generator: str, seed: int) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import reasoning_gym

        return reasoning_gym.create_dataset(generator, size=1, seed=seed)


def _entry(generator: str, seed: int) -> dict[str, Any]:
    entry = _dataset(generator, seed)[0]
    return {"question": entry["question"], "answer": entry["answer"], "seed": seed}


def verify(task: Task, answer: str) -> Verdict:
    """The generator's check of a boxed answer; see the module docstring."""
    check = CHECKS[task.metadata["generator"]]
    answer = answer.strip()[:MAX_ANSWER_CHARS]
    gold = str(task.answer)
    if not answer:
        ok = False
    elif check == "fraction":
        ok = _fraction(answer) is not None and _fraction(answer) == _fraction(gold)
    elif check == "verify":
        ok = _math_verify(gold, answer)
    elif check == "score":
        ok = _score(task, answer) == 1.0
    else:
        ok = _math_verify(gold, answer) or _score(task, answer) == 1.0
    return Verdict(float(ok), ok, {"correct": float(ok)})


def _fraction(text: str) -> tuple[str, int, int] | None:
    found = _FRACTION.match(text.strip())
    if found is None:
        return None
    num, den = (found[2], found[3]) if found[2] is not None else (found[4], found[5])
    return found[1], int(num), int(den)


def _score(task: Task, answer: str) -> float:
    dataset = _dataset(task.metadata["generator"], task.metadata["entry_seed"])
    try:
        return float(dataset.score_answer(answer, dataset[0]))
    except Exception:  # some scorers raise on garbage: that is a wrong answer
        return 0.0


def _math_verify(gold: str, answer: str) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import logging

        import math_verify

        logging.getLogger("math_verify").setLevel(logging.ERROR)
        mv: Any = math_verify  # untyped library

        def parse(text: str) -> Any:
            return mv.parse(text if text.startswith("$") else f"${text}$", parsing_timeout=None)

        try:
            return bool(mv.verify(parse(gold), parse(answer), timeout_seconds=None))
        except Exception:  # an unparsable answer is a wrong one
            return False
