"""Rollout workers: engines with their environments beside the trainer's process.

``cluster.rollout_workers`` >= 1 gives the run workers (``turnrl.distributed`` makes them
Ray actors); the step then collects its groups on them (``step.groups_of``) instead of the
trainer's own engine, which only probes the sampler at start-up. This is the protocol the
trainer uses of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from turnrl.rollout.groups import GroupSpec
from turnrl.types import Task, Trajectory

Groups = list[list[Trajectory]]
"""Groups of episodes, one group per task, in task order."""


class RolloutWorkers(Protocol):
    """Engines with their environments beside this process (``cluster.rollout_workers``;
    ``turnrl.distributed`` gives Ray actors): they run a batch's episodes instead of the
    trainer's own engine, which then only probes the sampler at start-up."""

    async def collect(self, tasks: Sequence[Task], spec: GroupSpec) -> Groups:
        """``collect_groups`` of ``tasks`` with ``spec``, spread over the workers: the
        groups in task order, every task's exactly once. It waits without blocking its
        event loop, so several batches can be collected at once (overlapping batches)."""
        ...

    def sync(self, model: Any, version: int) -> dict[str, float]:
        """Every worker takes ``model``'s weights as policy version ``version`` (between
        batches, never while sampling); metrics of the sync."""
        ...

    def offer(self, model: Any, version: int) -> dict[str, float]:
        """Partial rollouts: ``model``'s weights as ``version``, for every worker to take
        between turns of the batch it samples (or before its next), without waiting;
        metrics of the offer."""
        ...

    def take_metrics(self) -> dict[str, float]:
        """What happened to the workers since the last call (restarts), as metrics."""
        ...
