"""The rollout: episodes of a model and an environment, token-exact. ``collect_groups``
runs ``group_size`` episodes of each task concurrently on an engine (``turnrl.backends``),
its requests batched together; a ``ChatRenderer`` turns the conversation into the exact
tokens the model saw; ``SamplingParams`` and ``EpisodeLimits`` say how completions are
sampled and what ends an episode; a ``Batch`` is the padded tensors the learner trains on.
For writing your own loop or benchmark; ``turnrl.train`` runs all of it. Each name is
imported when first used."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from turnrl._lazy import lazy_attribute

if TYPE_CHECKING:
    from turnrl.rollout.batch import Batch
    from turnrl.rollout.chat import ChatRenderer
    from turnrl.rollout.episode import EpisodeLimits, SamplingParams
    from turnrl.rollout.groups import GroupSpec, collect_groups
    from turnrl.types import ToolCallRecord

__all__ = [
    "Batch",
    "ChatRenderer",
    "EpisodeLimits",
    "GroupSpec",
    "SamplingParams",
    "ToolCallRecord",
    "collect_groups",
]

_LAZY = {  # name -> module: imported when first asked for
    "Batch": "turnrl.rollout.batch",
    "ChatRenderer": "turnrl.rollout.chat",
    "EpisodeLimits": "turnrl.rollout.episode",
    "SamplingParams": "turnrl.rollout.episode",
    "GroupSpec": "turnrl.rollout.groups",
    "collect_groups": "turnrl.rollout.groups",
    "ToolCallRecord": "turnrl.types",
}


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, globals(), name)
