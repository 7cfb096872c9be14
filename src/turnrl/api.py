"""``turnrl.train``: a run from Python, on a recipe and your own environment.

The command line's ``turnrl train`` runs the same function. What lives elsewhere: the loop
itself (``turnrl.trainer.loop``), configuration (``turnrl.trainer.config``), environment
families (``turnrl.envs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from turnrl.envs import make_env_family
from turnrl.envs.agent import Agent, AgentEnvironment, ModelErrors, Reward
from turnrl.envs.custom import as_environment
from turnrl.errors import ConfigError
from turnrl.trainer.config import Config, EnvConfig, load_config, parse_override
from turnrl.trainer.loop import RunResult
from turnrl.trainer.loop import train as _train_loop
from turnrl.trainer.startup import MakeLearner


def train(
    recipe: str | Path | Config | None = None,
    *,
    env: Any = None,
    agent: Agent | None = None,
    tasks: Any = None,
    reward: Reward | None = None,
    model_errors: ModelErrors = (),
    model_error_reward: Reward | None = None,
    out: str | Path | None = None,
    config: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    resume: bool = False,
    progress: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    make_learner: MakeLearner | None = None,
) -> RunResult:
    """Train: ``recipe`` (a preset or recipe name, a .toml path, a ``Config``, or None
    for the quick-start) with ``config``'s settings (dotted keys to typed values,
    ``{"rollout.max_turns": 4}``, checked exactly as ``--set`` checks them; or
    ``overrides``, ``--set``'s strings, ``["rollout.max_turns=4"]``), on ``env``, into
    ``out`` (default ``runs/<name>``).

    ``env`` is an environment family: an object with ``task(index, split)`` and
    ``make_env()`` (e.g. ``turnrl.Environment``), a function returning one, a registered
    name or ``"package.module:factory"``; None keeps the recipe's. Or, instead of ``env``,
    an existing ``agent`` (``async def agent(task, client)``, see ``turnrl.AgentEnvironment``)
    with its ``tasks`` and ``reward(task, answer, transcript)``: the agent's model calls are
    served by the policy through an OpenAI-compatible endpoint and trained on, token-exact,
    in the model family's call format. ``model_errors`` and ``model_error_reward`` go to
    ``turnrl.AgentEnvironment``: exceptions that are the model's mistakes (beside the
    frameworks' own, which are known already) and the reward such an episode gets. Returns
    every metrics row and alarm of the run.

    ``cluster.learner_ranks >= 1`` runs the learner as a group of that many processes, and
    ``cluster.rollout_workers >= 1`` the episodes on that many Ray actors
    (``turnrl.distributed``); 0, the default for both, trains in this process.

    ``make_learner``: a learner of your own, in this process: called once, after the
    warm-up, with a ``turnrl.trainer.LearnerSpec``; it returns a ``turnrl.trainer.Learner``
    (e.g. ``turnrl.trainer.in_process_learner(spec)``, the default, subclassed or wrapped)
    or an object with the part of its interface a run uses (``model``, ``optimizer``,
    ``critic``, ``step_samples``, ``sampler_gap``, ``reference_kl``, ``refresh_model``). Not
    with ``cluster.learner_ranks >= 1``, whose learner is the ranks'.
    """
    if isinstance(recipe, Config):
        settings = [*map(parse_override, overrides), *(config or {}).items()]
        run_config = recipe.with_(dict(settings)) if settings else recipe
    else:
        run_config = load_config(None if recipe is None else str(recipe), overrides, config)
    if make_learner is not None and run_config.cluster.learner_ranks >= 1:
        raise ConfigError(
            "make_learner makes a learner in this process; cluster.learner_ranks = "
            f"{run_config.cluster.learner_ranks} runs it on ranks of its own: give one or the other"
        )
    spec = None
    if agent is not None:
        if env is not None:
            raise ConfigError("give env or agent (with tasks and reward), not both")
        if tasks is None or reward is None:
            raise ConfigError("an agent needs tasks= and reward=(task, answer, transcript)")
        env = AgentEnvironment(
            agent, tasks, reward, format=_family_format(run_config), model_errors=model_errors,
            model_error_reward=model_error_reward,
        )  # fmt: skip
        try:
            return train(
                run_config, env=env, out=out, resume=resume, progress=progress, on_row=on_row,
                make_learner=make_learner,
            )  # fmt: skip
        finally:
            env.close()
    elif tasks is not None or reward is not None or model_errors or model_error_reward:
        raise ConfigError(
            "tasks=, reward=, model_errors= and model_error_reward= go with agent=; an "
            "environment has its own"
        )
    if isinstance(env, str):
        run_config = dataclasses.replace(run_config, env=EnvConfig(name=env))
        spec = make_env_family(env)
    elif env is not None:
        if callable(env) and not hasattr(env, "make_env"):
            env = env()  # a factory of the family
        if not (callable(getattr(env, "task", None)) and callable(getattr(env, "make_env", None))):
            raise ConfigError(
                f"env must have task(index, split) and make_env() (see turnrl.Environment), "
                f"got {type(env).__name__}"
            )
        spec = as_environment(env)
        run_config = dataclasses.replace(
            run_config, env=EnvConfig(name=str(getattr(spec, "name", "custom")))
        )
    else:  # the recipe's
        spec = make_env_family(run_config.env.name, **run_config.env.options)
    spec = as_environment(spec, format=_family_format(run_config))  # for episodes naming none
    run_dir = Path(out) if out is not None else Path("runs") / run_config.name
    c = run_config.cluster
    if c.learner_ranks >= 1 or c.rollout_workers >= 1:  # processes of their own
        from turnrl.distributed.driver import train as _train_with_group

        return _train_with_group(
            run_config, run_dir, resume=resume, progress=progress, on_row=on_row, env=spec,
            make_learner=make_learner,
        )  # fmt: skip
    return _train_loop(
        run_config, run_dir, resume=resume, progress=progress, on_row=on_row, env=spec,
        make_learner=make_learner,
    )  # fmt: skip


def _family_format(config: Config) -> str:
    """The call format of the run's model family (the tiny model's ``model.tiny.arch``)."""
    from turnrl.models import FAMILIES

    family = FAMILIES.get(config.model.tiny.arch) if not config.model.path else None
    return family.tool_format if family is not None else "hermes"
