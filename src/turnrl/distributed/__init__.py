"""Beyond one process: the learner across ranks.

``LearnerGroup`` runs the in-process ``Learner``'s update on N ranks under FSDP2 (gloo on
the CPU, NCCL on GPUs), with a deadline on every call; learner_group.py is the driver's
side, rank.py a rank's. It wraps the trainer's learner and re-implements none of its math.
driver.py runs a training run with the learner on a group (``cluster.learner_ranks``):
the in-process loop with a group-backed learner, its weights synced into the engine's
model after every update. Not here yet: Ray rollout workers, weight broadcast to remote
engines, the asynchronous driver.
"""

from turnrl.distributed.learner_group import LearnerGroup, LearnerRankError

__all__ = ["LearnerGroup", "LearnerRankError"]
