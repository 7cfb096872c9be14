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
'turnrl[math]'``). math-verify's own timeouts are signal-based and work only on the main
thread, and without them sympy can run for ever (``\\boxed{9^{9^{9^{9}}}}``, ``99999999!``,
``7/7/.../7``, each measured past 60 s): so answers are cut to 200 characters, math-verify
only sees answers made of numbers, + - * /, brackets and fractions (``_plain``), and it
runs in a helper process that is killed past ``MATH_VERIFY_TIMEOUT_S`` (the answer then
scores 0). reasoning-gym's scorers of these generators parse numbers and never evaluate
expressions, so they run in-process.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import os
import random
import re
import select
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.envs.env_card import EnvCard
from turnrl.envs.policy import Policy, demonstration_corpus
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
# What math-verify may see of a model's answer: numbers, + - * /, brackets, fractions and
# a leading "x =". Powers, factorials and functions are kept from it: without its
# signal-based timeouts, sympy evaluates \boxed{9^{9^{9^{9}}}} or 99999999! for ever.
_PLAIN_LATEX = re.compile(r"\\(?:[dt]?frac|left|right|cdot|times|div|[,;:! ])")
_PLAIN_CHARS = re.compile(r"[0-9.,+\-*/()\[\]{}=$\s]*")
_LEADING_VARIABLE = re.compile(r"^\s*\$?\s*[A-Za-z]\s*=")


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

        return ToolEnv(tools, verify, format=get_format("code"), max_tool_calls=self.max_tool_calls)

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
        """Format-only turns (replayed, the random policy): a program printing a random
        sum, difference or product of numbers the question shows (some of them, in their
        order, with random operators), then what it printed, boxed. Drawn from what the
        model can see, so a warm-up on these teaches writing code about the question and
        copying its output, never which expression is right; a random number from outside
        the question would teach a model to ignore the question (a pretrained model warmed
        up on ``print(<random number>)`` kept printing random numbers: 0 of 64 solved)."""
        fmt = get_format("code")
        numbers = [int(n) for n in re.findall(r"(?<![\d.])-?\d+(?![\d.])", _question(task))]
        if not numbers:
            numbers = [rng.randint(0, 99)]
        chosen = [n for n in numbers if rng.random() < 0.5] or [rng.choice(numbers)]
        value, expression = chosen[0], _literal(chosen[0])
        for n in chosen[1:]:
            op = rng.choice("+-*")
            value = value + n if op == "+" else value - n if op == "-" else value * n
            expression += f" {op} {_literal(n)}"
        program = fmt.render_call(ToolCall("python", {"code": f"print({expression})"}))
        return [program, f"\\boxed{{{value}}}"]

    def corpus(self) -> list[str]:
        return demonstration_corpus(self, 60)

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


def _question(task: Task) -> str:
    """The problem statement of a task's prompt, without the instructions after it."""
    return str(task.prompt[-1]["content"]).split("\n\nSolve it with Python")[0]


def _literal(n: int) -> str:
    return f"({n})" if n < 0 else str(n)


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


def _plain(answer: str) -> bool:
    """Whether ``answer`` is arithmetic that math-verify evaluates at once (see
    ``_PLAIN_CHARS``): the bound on its time, as its own timeouts are off."""
    body = _PLAIN_LATEX.sub(" ", _LEADING_VARIABLE.sub("", answer, count=1))
    return "**" not in body and _PLAIN_CHARS.fullmatch(body) is not None


def _math_verify(gold: str, answer: str) -> bool:
    return _plain(answer) and _MATH_VERIFY.equal(gold, answer)


MATH_VERIFY_TIMEOUT_S = 5.0
"""Wall-clock limit of one math-verify comparison; past it the answer scores 0."""

# Runs in the helper process. Replies go to a private copy of stdout, so nothing the
# library prints can be taken for a reply.
_WORKER = r"""
import json, logging, os, sys, warnings
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
warnings.simplefilter("ignore")
logging.disable(logging.CRITICAL)
import math_verify

def parse(text):
    return math_verify.parse(text if text.startswith("$") else "$" + text + "$",
                             parsing_timeout=None)

replies.write("ready\n")
replies.flush()
for line in sys.stdin:
    gold, answer = json.loads(line)
    try:
        ok = bool(math_verify.verify(parse(gold), parse(answer), timeout_seconds=None))
    except BaseException:
        ok = False
    replies.write("1\n" if ok else "0\n")
    replies.flush()
"""


class _MathVerifier:
    """math-verify in a helper process, so that one comparison's time can be bounded.

    In-process, with its signal-based timeouts off (they work only on the main thread),
    math-verify can run for ever: sympy parses ``7/7/.../7`` in time exponential in its
    length and evaluates power towers whole. Here a comparison past ``timeout_s`` kills
    the helper (the next call starts a new one) and counts as not equal. Thread-safe; a
    forked child starts its own helper."""

    def __init__(self, timeout_s: float, startup_timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid = 0
        self._buffer = b""
        atexit.register(self.close)

    def equal(self, gold: str, answer: str) -> bool:
        with self._lock:
            proc = self._running()
            assert proc.stdin is not None
            try:
                proc.stdin.write(json.dumps([gold, answer]).encode() + b"\n")
            except OSError:  # died just now: a wrong answer rather than a crash
                self._kill()
                return False
            reply = self._read_line(self.timeout_s)
            if reply is None:
                self._kill()
                return False
            return reply == b"1"

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _running(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._pid != os.getpid():
            self._proc = None  # a forked child leaves its parent's helper alone
        if self._proc is not None and self._proc.poll() is not None:
            self._kill()  # died between calls
        if self._proc is None:
            if importlib.util.find_spec("math_verify") is None:
                raise ConfigError("tool_math needs math-verify: pip install 'turnrl[math]'")
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                bufsize=0,
            )
            self._pid, self._buffer = os.getpid(), b""
            if self._read_line(self.startup_timeout_s) != b"ready":
                self._kill()
                raise RuntimeError("tool_math: the math-verify helper process did not start")
        return self._proc

    def _read_line(self, timeout_s: float) -> bytes | None:
        """The helper's next reply line, or None when it is late or gone."""
        assert self._proc is not None
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.strip()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and self._pid == os.getpid():
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


_MATH_VERIFY = _MathVerifier(MATH_VERIFY_TIMEOUT_S)
