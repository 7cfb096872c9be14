"""The trainer's building blocks: the ``Learner`` (one optimizer step from a batch or from
``Sample``s) with the settings it takes (``AlgorithmConfig``, ``MicroBatchConfig``), the
syntax-only warm-up (``demonstration_trajectories``, ``warmup_samples``,
``supervised_warmup``, with ``WarmupConfig``), and ``tiny_model_config``, the tiny model a
run's config builds. What a run makes its parts from: ``LearnerSpec`` (what
``turnrl.train``'s ``make_learner`` is given; ``in_process_learner`` is the default
learner made from it), ``WorkersSpec`` (what rollout workers such as
``turnrl.distributed.RayRolloutWorkers`` are made from) and ``resolved`` (a config with its
``auto`` choices made, as a run records and uses it). For writing your own loop or
benchmark; ``turnrl.train`` runs the whole loop. Each name is imported when first used
(torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from turnrl._lazy import lazy_attribute

if TYPE_CHECKING:
    from turnrl.trainer.config import AlgorithmConfig, MicroBatchConfig, WarmupConfig, resolved
    from turnrl.trainer.learner import Learner
    from turnrl.trainer.startup import (
        LearnerSpec,
        WorkersSpec,
        in_process_learner,
        tiny_model_config,
    )
    from turnrl.trainer.warmup import demonstration_trajectories, supervised_warmup, warmup_samples
    from turnrl.types import Sample

__all__ = [
    "AlgorithmConfig",
    "Learner",
    "LearnerSpec",
    "MicroBatchConfig",
    "Sample",
    "WarmupConfig",
    "WorkersSpec",
    "demonstration_trajectories",
    "in_process_learner",
    "resolved",
    "supervised_warmup",
    "tiny_model_config",
    "warmup_samples",
]

_LAZY = {  # name -> module: imported when first asked for
    "AlgorithmConfig": "turnrl.trainer.config",
    "MicroBatchConfig": "turnrl.trainer.config",
    "WarmupConfig": "turnrl.trainer.config",
    "resolved": "turnrl.trainer.config",
    "Learner": "turnrl.trainer.learner",
    "LearnerSpec": "turnrl.trainer.startup",
    "WorkersSpec": "turnrl.trainer.startup",
    "in_process_learner": "turnrl.trainer.startup",
    "tiny_model_config": "turnrl.trainer.startup",
    "demonstration_trajectories": "turnrl.trainer.warmup",
    "supervised_warmup": "turnrl.trainer.warmup",
    "warmup_samples": "turnrl.trainer.warmup",
    "Sample": "turnrl.types",
}


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, globals(), name)
