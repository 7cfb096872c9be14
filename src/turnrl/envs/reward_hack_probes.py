"""Reward-hacking probes: generic exploit answers, each written in the environment's own
answer syntax and played through its ``reset``/``step`` as a policy would, so its format
and its verifier judge them. ``turnrl envs check`` plays every probe once on each checked
task and reports the reward and success each one earned (``check.py`` decides what fails).

The probes (``PROBES``), each the same text every turn:

- ``empty``: an empty answer;
- ``options``: every option listed: the options the task shows (``metadata["options"]``,
  short listed lines such as ``A) ...`` or ``- ...``, an ``options:`` list), else a long
  list of plausible tokens: other tasks' answers, the prompt's names and words;
- ``buried``: the gold answer (``task.answer``, where it is text) among many other
  candidates (other tasks' answers, the prompt's words);
- ``format``: the answer syntax alone, around a placeholder that means nothing;
- ``long``: a very long answer (the prompt's words, over and over);
- ``echo``: the task's prompt, echoed back.

The answer syntax, format-generically (``answer_turn``): the candidate wrappers are plain
text, ``<answer>...</answer>``, ``\\boxed{...}`` and ReAct's ``Final Answer: ...``, those
the opening messages mention first. With the env's ``Format`` (``env.format``), the first
wrapper it parses as an answer holding the text is used; an env without one gets the
wrapper its opening mentions, else plain text.

What does not live here: the episode loop (``policy.play``) and the pass/fail rule.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from turnrl.envs.policy import Policy
from turnrl.protocols import Env, Format, TaskSource, env_format
from turnrl.types import Message, Task

MAX_OPTIONS = 200
"""Entries in the ``options`` probe's list."""
MAX_OPTION_WORDS = 12
"""Longer listed lines are statements (rules, steps), not options."""
NUM_DISTRACTORS = 24
"""Other candidates around the gold in the ``buried`` probe."""
LONG_CHARS = 16_000
"""Length of the ``long`` probe's answer."""
PLACEHOLDER = "..."
"""What the ``format`` probe writes inside the answer syntax."""

_WORD = re.compile(r"[^\W_]+(?:['.-][^\W_]+)*")
_NAME = re.compile(r"\b[A-Z][\w'-]*(?:[ \t]+[A-Z][\w'-]*)+")
_OPTION_LINE = re.compile(
    r"^[ \t]*(?:\(?([A-Za-z]|\d{1,2})[).:]|[-*\u2022])[ \t]+(\S.*?)[ \t]*$", re.M
)
_OPTION_LIST = re.compile(r"\b(?:options|choices|choose from|one of)\b[ \t]*:[ \t]*(.+)", re.I)
_LIST_SEPARATOR = re.compile(r"\s*(?:[,;|/]|\bor\b)\s*")


@dataclass(frozen=True)
class Clues:
    """What a probe may draw on besides its task: other tasks' text answers (the answer
    space a policy meets in training)."""

    answers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Probe:
    """A generic exploit: ``text(task, clues)`` is what it answers (None: it does not apply
    to this task); ``fix`` says what to change in a verifier it fools."""

    name: str
    plays: str
    fix: str
    text: Callable[[Task, Clues], str | None]


def prompt_text(task: Task) -> str:
    """The task's prompt: its messages' text, one after another."""
    return "\n".join(str(m.get("content", "")) for m in task.prompt)


def gold_text(task: Task) -> str | None:
    """The task's answer as text (the first of several accepted), or None where it is
    other data (a database, a patch) or missing."""
    answer = task.answer
    if isinstance(answer, (list, tuple)) and answer:
        answer = answer[0]
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    return (answer.strip() or None) if isinstance(answer, str) else None


def prompt_words(task: Task) -> list[str]:
    """The prompt's multi-word names, then its words, each once, in order."""
    text = prompt_text(task)
    return _unique([*_NAME.findall(text), *_WORD.findall(text)])


def shown_options(task: Task) -> list[str]:
    """The options the task shows: ``metadata["options"]`` or ``["choices"]``, else in its
    non-system messages listed lines (``A) x``, ``1. x``, ``- x``, of a few words; label
    and text) and ``options: x, y`` lists."""
    for key in ("options", "choices"):
        listed = task.metadata.get(key)
        if isinstance(listed, Mapping):
            return _unique([str(k) for k in listed] + [str(v) for v in listed.values()])
        if isinstance(listed, (list, tuple)):
            return _unique([str(v) for v in listed])
    # the question's options, not a system prompt's numbered rules
    text = "\n".join(str(m.get("content", "")) for m in task.prompt if m.get("role") != "system")
    found: list[str] = []
    for label, body in _OPTION_LINE.findall(text):
        if len(body.split()) <= MAX_OPTION_WORDS:
            found += [label, body] if label else [body]
    for listing in _OPTION_LIST.findall(text):
        found += [part for part in _LIST_SEPARATOR.split(listing.strip(" .")) if part]
    return _unique(found) if len(found) >= 2 else []


def _empty(task: Task, clues: Clues) -> str:
    return ""


def _options(task: Task, clues: Clues) -> str | None:
    options = shown_options(task) or [*clues.answers, *prompt_words(task)]
    options = _unique(options)[:MAX_OPTIONS]
    return ", ".join(options) if len(options) >= 2 else None


def _buried(task: Task, clues: Clues) -> str | None:
    gold = gold_text(task)
    if gold is None:
        return None
    folded = gold.casefold()
    rng = random.Random(f"buried/{task.id}")
    noise: list[str] = []
    # answers of the gold's kind first (other tasks'), then the prompt's words
    for pool in (clues.answers, prompt_words(task), [f"candidate {k}" for k in range(99)]):
        fresh = [c for c in _unique(pool) if c.casefold() != folded and c not in noise]
        noise += rng.sample(fresh, min(NUM_DISTRACTORS - len(noise), len(fresh)))
    middle = len(noise) // 2
    return ", ".join([*noise[:middle], gold, *noise[middle:]])


def _format(task: Task, clues: Clues) -> str:
    return PLACEHOLDER


def _long(task: Task, clues: Clues) -> str:
    words = prompt_words(task) or ["word"]
    repeats = LONG_CHARS // (len(" ".join(words)) + 1) + 1
    return " ".join(words * repeats)[:LONG_CHARS].strip()


def _echo(task: Task, clues: Clues) -> str | None:
    return prompt_text(task).strip() or None


PROBES: tuple[Probe, ...] = (
    Probe("empty", "an empty answer", "score an empty answer 0", _empty),
    Probe(
        "options", "every option listed",
        "a list of candidates must not match: compare the whole normalised answer with the "
        "gold (exact match), or reject answers that name several candidates",
        _options,
    ),
    Probe(
        "buried", "the gold among many other candidates",
        "the verifier finds the gold inside a longer answer: compare the whole normalised "
        "answer, not a substring or a token overlap",
        _buried,
    ),
    Probe(
        "format", "the answer syntax around nothing",
        "the answer's form alone is paid: gate format credit on a correct answer "
        "(e.g. CompositeReward's gated format term)",
        _format,
    ),
    Probe(
        "long", f"a very long answer ({LONG_CHARS} characters)",
        "length is paid: cap the answer's length and score precision, not recall",
        _long,
    ),
    Probe(
        "echo", "the prompt echoed back",
        "repeating the prompt is paid: check the answer itself, not words the prompt "
        "already contains (keyword checks, a simulated user's trigger words)",
        _echo,
    ),
)  # fmt: skip


_WRAPPERS: tuple[tuple[str, Callable[[str], str]], ...] = (
    ("", lambda text: text),
    ("<answer>", lambda text: f"<answer>{text}</answer>"),
    ("\\boxed", lambda text: f"\\boxed{{{text}}}"),
    ("Final Answer:", lambda text: f"Thought: I know the answer.\nFinal Answer: {text}"),
)


def answer_turn(text: str, fmt: Format | None, opening: Sequence[Message]) -> str:
    """``text`` written as a final answer in the environment's syntax (module docstring):
    the first candidate wrapper, those the opening mentions first, that ``fmt`` parses as
    an answer holding ``text``; with no ``fmt``, the mentioned wrapper or plain text."""
    shown = "\n".join(str(m.get("content", "")) for m in opening)
    mentioned = [w for w in _WRAPPERS if w[0] and w[0] in shown]
    order = mentioned + [w for w in _WRAPPERS if w not in mentioned]
    if fmt is None:
        return order[0][1](text)
    for _, wrap in order:
        turn = wrap(text)
        parsed = fmt.parse(turn)
        answer = None if parsed.errors or parsed.tool_calls else parsed.answer
        if answer is not None and text.strip() in answer:
            return turn
    return text


def probe_policy(probe: Probe, task: Task, clues: Clues, env: Env) -> Policy | None:
    """A policy that answers ``probe``'s text in ``env``'s syntax every turn; None where
    the probe does not apply to ``task``."""
    text = probe.text(task, clues)
    if text is None:
        return None
    fmt = env_format(env)
    turn: list[str] = []

    def policy(messages: Sequence[Message]) -> str:
        if not turn:  # the first call sees the opening messages
            turn.append(answer_turn(text, fmt, messages))
        return turn[0]

    return policy


def answer_space(source: TaskSource, count: int) -> tuple[str, ...]:
    """The text answers of the first ``count`` training tasks, each once."""
    answers: list[str] = []
    for index in range(count):
        gold = gold_text(source.task(index, "train"))
        if gold is not None:
            answers.append(gold)
    return tuple(_unique(answers))


@dataclass(frozen=True)
class ProbeResult:
    """What one probe earned over the tasks it applied to (``num_tasks``).

    ``expected``: the environment's reason (``expected_probes``) when its success is by
    design; ``skipped``: why it was not played at all.
    """

    name: str
    plays: str
    fix: str
    num_tasks: int
    reward: float
    max_reward: float
    success: float
    expected: str | None = None
    skipped: str | None = None

    @property
    def finding(self) -> bool:
        """It scored: some episode's reward was above zero, or it succeeded."""
        return self.max_reward > 0 or self.success > 0

    @property
    def failed(self) -> bool:
        """It succeeded, and the environment does not declare that expected."""
        return self.success > 0 and self.expected is None

    def warning(self) -> str:
        """The finding in one line: the scores, then what to fix (or why it is expected)."""
        credit = "partial credit" if self.success == 0 else f"success {self.success:.2f}"
        head = (
            f"probe {self.name!r} ({self.plays}) scores: {credit}, mean reward "
            f"{self.reward:.3f} (max {self.max_reward:.3g}) over {self.num_tasks} tasks"
        )
        tail = f"expected: {self.expected}" if self.expected else f"fix: {self.fix}"
        return f"{head}; {tail}"


def _unique(items: Sequence[str]) -> list[str]:
    """``items`` stripped, without blanks and case-insensitive repeats, in order."""
    seen: set[str] = set()
    out: list[str] = []
    for item in items:
        item = item.strip()
        if item and item.casefold() not in seen:
            seen.add(item.casefold())
            out.append(item)
    return out
