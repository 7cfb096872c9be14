"""Text-level policies and a text-level episode loop, for checking and benchmarking
environments without a model or a tokenizer.

A ``Policy`` reads the conversation so far and writes the next assistant turn. An
environment family may offer ``oracle(task)``: a scripted policy that solves its tasks. Its
``demonstration(task, rng)`` turns, replayed, are the random policy (they are the warm-up's
format demonstrations: valid calls with random content). ``play`` is the episode loop of
``turnrl.rollout.episode`` without tokens: no context or token limits, only ``max_steps``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from turnrl.envs.env_card import EnvCard
from turnrl.protocols import Env, close_env
from turnrl.types import Message, StepResult, Task

Policy = Callable[[Sequence[Message]], str]
"""The conversation so far (opening messages, then assistant turns and observations) in,
the next assistant turn's text out."""


@runtime_checkable
class HasOracle(Protocol):
    """An environment family with a scripted policy that solves its tasks."""

    def oracle(self, task: Task) -> Policy:
        """A fresh oracle for one episode of ``task``."""
        ...


@runtime_checkable
class HasCard(Protocol):
    """An environment family that describes itself with a card."""

    @property
    def card(self) -> EnvCard: ...


class _Demonstrates(Protocol):
    def task(self, index: int, split: str = "train") -> Task: ...

    def demonstration(self, task: Task, rng: random.Random) -> list[str]: ...


def demonstration_corpus(spec: _Demonstrates, count: int) -> list[str]:
    """Tokenizer text: the last opening message of ``count`` tasks of a ``corpus`` split,
    each followed by its demonstration turns (seeded by the task's index)."""
    lines: list[str] = []
    for i in range(count):
        task = spec.task(i, "corpus")
        lines.append(str(task.prompt[-1]["content"]))
        lines += spec.demonstration(task, random.Random(i))
    return lines


def replay(turns: Sequence[str], then: str = "") -> Policy:
    """A policy that says ``turns`` in order, then ``then`` forever (an empty final answer)."""
    remaining = list(turns)

    def policy(messages: Sequence[Message]) -> str:
        return remaining.pop(0) if remaining else then

    return policy


@dataclass(frozen=True)
class Episode:
    """One text-level episode: the opening messages, each action with its step result, and
    how it ended (``max_steps``: the environment never ended it)."""

    opening: tuple[Message, ...]
    actions: tuple[str, ...]
    results: tuple[StepResult, ...]
    ended_by: Literal["terminated", "truncated", "max_steps"]

    @property
    def reward(self) -> float:
        return sum(r.reward for r in self.results)

    @property
    def success(self) -> bool:
        return bool(self.results and self.results[-1].info.get("success", False))


async def play(env: Env, task: Task, policy: Policy, *, seed: int, max_steps: int) -> Episode:
    """Run ``policy`` on ``task`` in ``env`` until the episode ends or ``max_steps`` turns;
    then, as the rollout does, let the env release its tools (its ``close``, if any)."""
    try:
        opening = tuple(await env.reset(task, seed))
        messages: list[Message] = list(opening)
        actions: list[str] = []
        results: list[StepResult] = []
        ended_by: Literal["terminated", "truncated", "max_steps"] = "max_steps"
        for _ in range(max_steps):
            action = policy(messages)
            result = await env.step(action)
            actions.append(action)
            results.append(result)
            if result.terminated or result.truncated:
                ended_by = "terminated" if result.terminated else "truncated"
                break
            messages += [{"role": "assistant", "content": action}, *result.observation]
    finally:
        await close_env(env)
    return Episode(opening, tuple(actions), tuple(results), ended_by)
