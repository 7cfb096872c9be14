"""Environments by name: what ``turnrl train``'s config and ``turnrl envs`` look up."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Protocol

from turnrl.envs.games import Bandit, FrozenLake, Sokoban
from turnrl.envs.search_qa import SearchQA
from turnrl.envs.secret_lookup import SecretLookup
from turnrl.envs.service import Service
from turnrl.envs.shop import Shop
from turnrl.envs.swe.env import SWE
from turnrl.envs.tool_math import ToolMath
from turnrl.errors import ConfigError
from turnrl.protocols import Env
from turnrl.types import Task


class EnvSpec(Protocol):
    """A named environment family: tasks by index, fresh env per episode, a format teacher.

    A family may also offer ``oracle(task)`` (a scripted policy that solves its tasks, see
    ``turnrl.envs.policy``), a ``card`` (``turnrl.envs.card.EnvCard``), ``chance`` (the
    random policy's success) and ``reward_range`` (default ``(0.0, 1.0)``); ``turnrl envs
    check`` and ``benchmarks/envs.py`` use them where present.
    """

    name: str

    def task(self, index: int, split: str = "train") -> Task: ...

    def make_env(self) -> Env: ...

    def demonstration(self, task: Task, rng: random.Random) -> list[str]: ...

    def corpus(self) -> list[str]: ...


ENVIRONMENTS: dict[str, type[Any]] = {
    "secret_lookup": SecretLookup,
    "sokoban": Sokoban,
    "frozen_lake": FrozenLake,
    "bandit": Bandit,
    "search_qa": SearchQA,
    "shop": Shop,
    "service": Service,
    "tool_math": ToolMath,
    "swe": SWE,
}


def make_env_spec(name: str, **options: Any) -> EnvSpec:
    """Build the named environment family with ``options`` (its dataclass fields)."""
    if name not in ENVIRONMENTS:
        raise ConfigError(f"unknown environment {name!r}; known: {', '.join(sorted(ENVIRONMENTS))}")
    cls = ENVIRONMENTS[name]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(
            f"unknown option(s) {unknown} for environment {name!r}; known: {sorted(known)}"
        )
    spec: EnvSpec = cls(**options)
    return spec
