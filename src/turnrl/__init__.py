"""turnrl: RL for multi-turn, tool-using language-model agents.

The public API. ``import turnrl`` stays light (no torch): ``train`` and ``evaluate``
import the trainer when first used.

    import turnrl
    turnrl.train("grpo", env=turnrl.Environment(tasks, make_env), out="runs/mine")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from turnrl._lazy import lazy_attribute
from turnrl.envs import Environment, TextEnv, ToolEnv, check_env, make_env_family
from turnrl.envs.agent import AgentEnvironment
from turnrl.envs.agent_processes import AgentProcesses
from turnrl.errors import ConfigError, EpisodeFailures, TurnrlError
from turnrl.formats import get_format
from turnrl.rewards import Verdict
from turnrl.tools import Tool, ToolSet, tool
from turnrl.types import Message, StepResult, Task, ToolCall, Trajectory

if TYPE_CHECKING:
    from turnrl.api import train
    from turnrl.evaluation import EvalConfig, evaluate
    from turnrl.trainer.config import Config, load_config
    from turnrl.trainer.loop import RunResult

__all__ = [
    "AgentEnvironment",
    "AgentProcesses",
    "Config",
    "ConfigError",
    "Environment",
    "EpisodeFailures",
    "EvalConfig",
    "Message",
    "RunResult",
    "StepResult",
    "Task",
    "TextEnv",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolSet",
    "Trajectory",
    "TurnrlError",
    "Verdict",
    "check_env",
    "evaluate",
    "get_format",
    "load_config",
    "make_env_family",
    "tool",
    "train",
]

_LAZY = {  # name -> module: these import torch, so only when first asked for
    "train": "turnrl.api",
    "evaluate": "turnrl.evaluation",
    "EvalConfig": "turnrl.evaluation",
    "Config": "turnrl.trainer.config",
    "load_config": "turnrl.trainer.config",
    "RunResult": "turnrl.trainer.loop",
}


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, globals(), name)
