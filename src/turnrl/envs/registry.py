"""Environments by name: what ``turnrl train``'s config and ``turnrl envs`` look up."""

from __future__ import annotations

import dataclasses
import importlib
import random
from collections.abc import Awaitable
from typing import Any, Protocol, cast

from turnrl.envs.custom import as_environment
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


class EnvFamily(Protocol):
    """A named environment family: tasks by index, fresh env per episode, a format teacher.

    A family may also offer ``oracle(task)`` (a scripted policy that solves its tasks, see
    ``turnrl.envs.policy``), a ``card`` (``turnrl.envs.env_card.EnvCard``), ``chance`` (the
    random policy's success) and ``reward_range`` (default ``(0.0, 1.0)``); ``turnrl envs
    check`` and ``benchmarks/envs.py`` use them where present.
    """

    name: str

    def task(self, index: int, split: str = "train") -> Task: ...

    def make_env(self) -> Env: ...

    def demonstration(self, task: Task, rng: random.Random) -> list[str] | Awaitable[list[str]]: ...

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


def make_env_family(name: str, **options: Any) -> EnvFamily:
    """Build an environment family with ``options``: a registered name (its dataclass
    fields are the options), or ``"package.module:factory"``, a class or function of yours
    called with the options (it must return an object with ``task`` and ``make_env``;
    ``demonstration`` and ``corpus`` are derived where it has none, see ``envs.custom``)."""
    if ":" in name:
        return _import_env_family(name, options)
    if name not in ENVIRONMENTS:
        raise ConfigError(
            f"unknown environment {name!r}; known: {', '.join(sorted(ENVIRONMENTS))}, or "
            "'package.module:factory' for your own"
        )
    cls = ENVIRONMENTS[name]
    _check_options(cls, name, options)
    spec: EnvFamily = cls(**options)
    return spec


def _check_options(cls: type[Any], name: str, options: dict[str, Any]) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(
            f"unknown option(s) {unknown} for environment {name!r}; known: {sorted(known)}"
        )


def _import_env_family(target: str, options: dict[str, Any]) -> EnvFamily:
    """``"package.module:factory"`` imported and called with ``options``."""
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"environment {target!r}: cannot import {module_name!r}: {exc}") from exc
    factory: Any = module
    for part in attribute.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ConfigError(f"environment {target!r}: {module_name} has no {attribute!r}")
    if dataclasses.is_dataclass(factory) and isinstance(factory, type):
        _check_options(factory, target, options)
    if not callable(factory):
        raise ConfigError(f"environment {target!r} is not a class or a function")
    try:
        spec = factory(**options)
    except TypeError as exc:
        raise ConfigError(f"environment {target!r} does not take options {options}: {exc}") from exc
    missing = [m for m in ("task", "make_env") if not callable(getattr(spec, m, None))]
    if missing:
        raise ConfigError(
            f"environment {target!r} returned {type(spec).__name__}, which has no "
            f"{' or '.join(missing)} method (see turnrl.envs.registry.EnvFamily)"
        )
    return cast(EnvFamily, as_environment(spec))
