"""Beyond one process: the learner across ranks, the episodes on Ray rollout workers.

``LearnerGroup`` runs the in-process ``Learner``'s update on N ranks under FSDP2 (gloo on
the CPU, NCCL on GPUs), with a deadline on every call; learner_group.py is the driver's
side, rank.py a rank's; its ranks are processes of the driver or Ray actors anywhere in a
Ray cluster (ray_ranks.py), the run's Ray cluster shared (ray_cluster.py). It wraps the
trainer's learner and re-implements none of its math.
rollout_workers.py runs the episodes on Ray actors, each an engine with its environments
(``RayRolloutWorkers``), replacing a worker that dies. driver.py runs a training run with
either or both (``cluster.learner_ranks``, ``cluster.rollout_workers``): the in-process
loop with a group-backed learner and worker-backed rollouts, the weights synced after
every update: through Ray's object store, or by a broadcast over torch.distributed
(weight_broadcast.py: gloo, and NCCL on GPUs, which has not run) from the driver's model or,
in a synchronous run, from the learner's rank 0 itself (ranks_to_workers.py).

The building blocks of a loop of your own beyond one process: ``LearnerGroup``;
``GroupLearner``, a group used as the trainer uses a ``Learner`` (the driver's copy of the
policy kept in step with the ranks); ``with_adapters``, a group's source for a LoRA policy;
``RayRolloutWorkers``, made from a ``turnrl.trainer.WorkersSpec``, whose ``sync`` sends the
weights (``send_from_ranks``: from a ``GroupLearner``'s ranks). ``GroupLearner``,
``RayRolloutWorkers`` and ``with_adapters`` are imported when first used (the run's driver,
Ray's client).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from turnrl._lazy import lazy_attribute
from turnrl.distributed.learner_group import LearnerGroup, LearnerRankError

if TYPE_CHECKING:
    from turnrl.distributed.driver import GroupLearner, with_adapters
    from turnrl.distributed.rollout_workers import RayRolloutWorkers

__all__ = [
    "GroupLearner",
    "LearnerGroup",
    "LearnerRankError",
    "RayRolloutWorkers",
    "with_adapters",
]

_LAZY = {  # name -> module: imported when first asked for
    "GroupLearner": "turnrl.distributed.driver",
    "with_adapters": "turnrl.distributed.driver",
    "RayRolloutWorkers": "turnrl.distributed.rollout_workers",
}


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, globals(), name)
