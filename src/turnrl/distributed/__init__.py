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
"""

from turnrl.distributed.learner_group import LearnerGroup, LearnerRankError

__all__ = ["LearnerGroup", "LearnerRankError"]
