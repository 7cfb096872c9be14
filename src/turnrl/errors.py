"""Exceptions turnrl raises on purpose. Each says what was wrong and what to do about it."""

from __future__ import annotations


class TurnrlError(Exception):
    """Base class: catch this to catch every error turnrl raises deliberately."""


class ConfigError(TurnrlError, ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""


class TemplateError(TurnrlError):
    """A tokenizer's chat template cannot render what turnrl needs (e.g. no tool support)."""


class BackendError(TurnrlError):
    """A generation backend failed (an infrastructure failure, recorded on the trajectory)."""


class ToolDefinitionError(TurnrlError, TypeError):
    """A Python function cannot become a tool (missing annotations, unsupported types)."""


class EpisodeFailures(TurnrlError):
    """Episodes of a step raised: a bug in user code (the environment, a tool factory, the
    verifier) or a backend failure, beyond ``rollout.max_error_frac``. The model's own
    mistakes (malformed calls, bad arguments, unknown tools, a tool's error) are
    observations, never this."""
