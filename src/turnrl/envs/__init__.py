"""Environments: tasks, tools and verifiers. No torch here (env authors need no ML stack)."""

from turnrl.envs.check import EnvReport, check_env
from turnrl.envs.custom import Environment
from turnrl.envs.env_card import EnvCard
from turnrl.envs.games import Bandit, FrozenLake, GameEnv, Sokoban
from turnrl.envs.policy import Episode, HasOracle, Policy, play, replay
from turnrl.envs.registry import ENVIRONMENTS, EnvFamily, make_env_family
from turnrl.envs.secret_lookup import SecretLookup
from turnrl.envs.text_env import TextEnv
from turnrl.envs.tool_env import ToolEnv, Verifier

__all__ = [
    "ENVIRONMENTS",
    "Bandit",
    "EnvCard",
    "EnvFamily",
    "EnvReport",
    "Environment",
    "Episode",
    "FrozenLake",
    "GameEnv",
    "HasOracle",
    "Policy",
    "SecretLookup",
    "Sokoban",
    "TextEnv",
    "ToolEnv",
    "Verifier",
    "check_env",
    "make_env_family",
    "play",
    "replay",
]
