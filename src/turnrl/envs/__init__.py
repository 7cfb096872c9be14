"""Environments: tasks, tools and verifiers. No torch here (env authors need no ML stack)."""

from turnrl.envs.registry import ENVIRONMENTS, EnvSpec, make_env_spec
from turnrl.envs.secret_lookup import SecretLookup
from turnrl.envs.tool_env import ToolEnv, Verifier

__all__ = ["ENVIRONMENTS", "EnvSpec", "SecretLookup", "ToolEnv", "Verifier", "make_env_spec"]
