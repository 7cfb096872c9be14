"""``turnrl.train``: a run from Python, on a recipe and your own environment.

The command line's ``turnrl train`` runs the same function. What lives elsewhere: the loop
itself (``turnrl.trainer.loop``), configuration (``turnrl.trainer.config``), environment
families (``turnrl.envs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from turnrl.envs import make_env_spec
from turnrl.envs.custom import as_environment
from turnrl.errors import ConfigError
from turnrl.trainer.config import Config, EnvConfig, load_config
from turnrl.trainer.loop import RunResult
from turnrl.trainer.loop import train as _train_loop


def train(
    recipe: str | Path | Config | None = None,
    *,
    env: Any = None,
    out: str | Path | None = None,
    overrides: Sequence[str] = (),
    resume: bool = False,
    progress: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> RunResult:
    """Train: ``recipe`` (a preset or recipe name, a .toml path, a ``Config``, or None
    for the quick-start) with ``overrides`` (``"section.key=value"``, as ``--set``), on
    ``env``, into ``out`` (default ``runs/<name>``).

    ``env`` is an environment family: an object with ``task(index, split)`` and
    ``make_env()`` (e.g. ``turnrl.Environment``), a function returning one, a registered
    name or ``"package.module:factory"``; None keeps the recipe's. Returns every metrics
    row and alarm of the run.
    """
    if isinstance(recipe, Config):
        if overrides:
            raise ConfigError("pass overrides with a recipe name, or build the Config yourself")
        config = recipe
    else:
        config = load_config(None if recipe is None else str(recipe), list(overrides))
    spec = None
    if isinstance(env, str):
        config = dataclasses.replace(config, env=EnvConfig(name=env))
        spec = make_env_spec(env)
    elif env is not None:
        if callable(env) and not hasattr(env, "make_env"):
            env = env()  # a factory of the family
        if not (callable(getattr(env, "task", None)) and callable(getattr(env, "make_env", None))):
            raise ConfigError(
                f"env must have task(index, split) and make_env() (see turnrl.Environment), "
                f"got {type(env).__name__}"
            )
        spec = as_environment(env)
        config = dataclasses.replace(
            config, env=EnvConfig(name=str(getattr(spec, "name", "custom")))
        )
    run_dir = Path(out) if out is not None else Path("runs") / config.name
    return _train_loop(config, run_dir, resume=resume, progress=progress, on_row=on_row, env=spec)
