"""``Environment``: your own task and environment, trainable as they are.

An environment family, as the trainer uses it, is a task source (``task(index, split)``)
and a fresh environment per episode (``make_env()``); for the tiny model it also gives a
format warm-up (``demonstration``) and text for the tokenizer (``corpus``). ``Environment``
holds your tasks (a list, or a function of the index) and your environment factory, and
derives the last two when you give none:

- the warm-up demonstration of a task: a call to one of the environment's tools with
  arguments of the right types (numbers and strings taken from the task's prompt at
  random), rendered by the environment's own format, then an answer made of a word or
  number of the prompt or of the tool's reply. It shows the format only, never the
  solution (the call's content is random), like the shipped families' teachers;
- the corpus: the prompts and answers of the first tasks and the tools' names,
  descriptions and a rendered call of each.

``as_environment`` completes any object with ``task`` and ``make_env`` the same way, so
``--set env.name=package.module:factory`` and ``turnrl.train(env=...)`` need no more.
"""

from __future__ import annotations

import asyncio
import copy
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnrl.formats import get_format, using_default_format
from turnrl.protocols import Env, Format, ToolSchema, close_env, env_format, env_tools
from turnrl.types import Task, ToolCall

TaskSource = Sequence[Task] | Callable[[int, str], Task]
"""A list of tasks (read in order, cycling), or a function of (index, split)."""

CORPUS_TASKS = 200
"""Tasks whose prompts and answers go into the default corpus."""


@dataclass(frozen=True)
class Environment:
    """Your environment family: tasks and a factory of fresh environments (one per episode).

    ``tasks``: the training tasks. ``test_tasks``: the held-out ones evaluation plays
    (default: the training tasks, so "held-out" success is then training success).
    ``env``: a function returning a new ``Env`` (e.g. a ``ToolEnv``). ``demonstration``
    and ``corpus`` are derived from the environment when not given (module docstring).
    ``format``: the call format of the episodes that name none (a ``ToolEnv`` or
    ``GameEnv`` built without ``format=``); None, the default, is the run's (the trained
    model family's, which ``turnrl.train`` fills in), hermes outside a run.
    """

    tasks: TaskSource
    env: Callable[[], Env]
    test_tasks: TaskSource | None = None
    name: str = "custom"
    demonstrate: Callable[[Task, random.Random], list[str]] | None = None
    """Assistant turns that show the format for a task (the warm-up plays them)."""
    corpus_text: Sequence[str] = field(default=())
    """Extra text for the tiny model's tokenizer (added to the derived corpus)."""
    format: Format | str | None = None
    """The call format of episodes built without one (see the class docstring)."""

    def __post_init__(self) -> None:
        for label, source in (("tasks", self.tasks), ("test_tasks", self.test_tasks)):
            if source is None or callable(source):
                continue
            if not isinstance(source, Sequence) or not source:
                raise TypeError(f"{label} must be a non-empty list of Task or a function")
            bad = next((t for t in source if not isinstance(t, Task)), None)
            if bad is not None:
                raise TypeError(f"{label} must hold turnrl.Task objects, got {bad!r}")
        if not callable(self.env):
            raise TypeError(f"env must be a function returning a new environment, got {self.env!r}")
        if isinstance(self.format, str):
            get_format(self.format)  # an unknown name fails here, naming the known ones

    def task(self, index: int, split: str = "train") -> Task:
        source = self.test_tasks if split == "test" and self.test_tasks is not None else self.tasks
        if callable(source):
            return source(index, split)
        return source[index % len(source)]

    def make_env(self) -> Env:
        """A new episode, built with ``format`` as the call format of what names none."""
        with using_default_format(self.format):
            return self.env()

    def with_format(self, format: Format | str) -> Environment:
        """This family with ``format`` for episodes that name none, unless it has one."""
        if self.format is not None:
            return self
        family = copy.copy(self)  # not dataclasses.replace: a subclass has its own __init__
        object.__setattr__(family, "format", format)
        return family

    def demonstration(self, task: Task, rng: random.Random) -> Any:
        """The given ``demonstrate`` (``turnrl.formats.default_format()`` in it is the
        family's format), or a derived one (an awaitable of the turns)."""
        if self.demonstrate is not None:
            with using_default_format(self.format):
                return self.demonstrate(task, rng)
        return default_demonstration(self.make_env, task, rng.getrandbits(64))

    def corpus(self) -> list[str]:
        return [*self.corpus_text, *default_corpus(self)]


def as_environment(spec: Any, format: Format | str | None = None) -> Any:
    """``spec`` with ``demonstration`` and ``corpus``: as it is if it has both, else an
    ``Environment`` over its ``task`` and ``make_env`` that passes every other attribute
    (``oracle``, ``card``, ``reward_range``, ...) through to ``spec``. ``format``: the
    call format of episodes that name none (``Environment.format``), where ``spec`` is an
    ``Environment`` without one or is completed here; a family with its own
    ``demonstration`` and ``corpus`` (as the registered ones) chooses its own formats."""
    if isinstance(spec, Environment):
        return spec if format is None else spec.with_format(format)
    if callable(getattr(spec, "demonstration", None)) and callable(getattr(spec, "corpus", None)):
        return spec
    given = getattr(spec, "demonstration", None)
    return _Completed(
        tasks=spec.task, env=spec.make_env, name=str(getattr(spec, "name", "custom")),
        demonstrate=given if callable(given) else None, format=format, source=spec,
    )  # fmt: skip


@dataclass(frozen=True)
class _Completed(Environment):
    """A user's family with the derived parts added; the rest is the user's own."""

    source: Any = None

    def __getattr__(self, name: str) -> Any:  # only for what Environment does not have
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.source, name)


async def default_demonstration(make_env: Callable[[], Env], task: Task, seed: int) -> list[str]:
    """A call to a random tool of the task's environment with typed random arguments (a
    number of the prompt where it has numbers), in its format, then an answer: a word or
    number of the prompt or of the tool's reply. Format only: the call's content is random,
    and the answer shows where answers come from, not which one is right. The call is
    played once on a fresh environment to read its reply (the warm-up plays it again)."""
    rng = random.Random(seed)
    env = make_env()
    try:
        await env.reset(task, rng.getrandbits(32))
        schemas, fmt = _tools_and_format_of(env)
        turns, words = [], _words(task)
        if schemas and fmt is not None:
            function = rng.choice(schemas)["function"]
            arguments = plausible_arguments(function.get("parameters", {}), task, rng)
            turns.append(fmt.render_call(ToolCall(function["name"], arguments)))
            reply = await env.step(turns[-1])
            seen = " ".join(str(m.get("content", "")) for m in reply.observation)
            words += _words_in(seen)
        turns.append(rng.choice(words))
        return turns
    finally:
        await close_env(env)


def default_corpus(spec: Any, num_tasks: int = CORPUS_TASKS) -> list[str]:
    """Prompts and answers of the first tasks, and each tool's name, description and a
    rendered call (the tokenizer then has pieces for what the policy will read and write)."""
    lines: list[str] = []
    tasks = [spec.task(i) for i in range(num_tasks)]
    for task in tasks:
        lines += [str(m.get("content", "")) for m in task.prompt]
        if task.answer is not None:
            lines.append(str(task.answer))
    schemas, fmt = asyncio.run(_tools_and_format(spec.make_env, tasks[0]))
    rng = random.Random(0)
    for schema in schemas:
        function = schema["function"]
        lines += [str(function["name"]), str(function.get("description", ""))]
        if fmt is not None:
            arguments = plausible_arguments(function.get("parameters", {}), tasks[0], rng)
            lines.append(fmt.render_call(ToolCall(function["name"], arguments)))
    return [line for line in lines if line]


def plausible_arguments(
    parameters: dict[str, Any], task: Task, rng: random.Random
) -> dict[str, Any]:
    """Values of the JSON schema's types for each required parameter (all if none is
    marked required): small numbers, booleans, words of the task's prompt."""
    properties: dict[str, Any] = parameters.get("properties", {})
    names = parameters.get("required") or list(properties)
    return {name: _value(properties.get(name, {}), task, rng) for name in names}


def _value(schema: dict[str, Any], task: Task, rng: random.Random) -> Any:
    if schema.get("enum"):
        return rng.choice(list(schema["enum"]))
    kind = schema.get("type", "string")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    numbers = [w for w in _words(task) if w[-1].isdigit()]
    if kind == "integer":
        whole = [int(w) for w in numbers if "." not in w]
        return rng.choice(whole) if whole else rng.randint(0, 20)
    if kind == "number":
        return float(rng.choice(numbers)) if numbers else round(rng.uniform(0, 20), 1)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_value(schema.get("items", {}), task, rng) for _ in range(rng.randint(1, 3))]
    if kind == "object":
        return plausible_arguments(schema, task, rng)
    return rng.choice(_words(task))


def _words(task: Task) -> list[str]:
    """Words and numbers of the task's prompt (a fallback word if it has none)."""
    text = " ".join(str(m.get("content", "")) for m in task.prompt)
    return _words_in(text) or ["answer"]


def _words_in(text: str) -> list[str]:
    return re.findall(r"-?\d+(?:\.\d+)?|[A-Za-z][A-Za-z'-]*", text)


async def _tools_and_format(
    make_env: Callable[[], Env], task: Task
) -> tuple[list[ToolSchema], Format | None]:
    """The tools a fresh environment offers for ``task`` and its format, if it has one."""
    env = make_env()
    try:
        await env.reset(task, 0)
        return _tools_and_format_of(env)
    finally:
        await close_env(env)


def _tools_and_format_of(env: Env) -> tuple[list[ToolSchema], Format | None]:
    """A reset environment's tools (their full schemas, whether or not its format puts
    them in the template) and its format."""
    tools = env_tools(env)
    schemas = tools.schemas() if tools is not None else []
    return list(schemas or env.tool_schemas()), env_format(env)
