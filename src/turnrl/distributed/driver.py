"""A training run beyond one process: its learner a ``LearnerGroup``
(``cluster.learner_ranks >= 1``), its episodes on Ray rollout workers
(``cluster.rollout_workers >= 1``, rollout_workers.py), or both.

The loop is the in-process one (trainer/loop.py), unchanged: it takes a learner factory
(``make_learner``) and a rollout workers' one (``make_workers``). ``train`` here gives it
``RayRolloutWorkers`` and ``GroupLearner``, which has the part of the
``Learner`` interface the step, the loop and the checkpoints use (``model``, ``optimizer``,
``critic``, ``step_samples``, ``sampler_gap``, ``reference_kl``) and runs the update on the
group's ranks. Nothing of the step is repeated here.

Weight sync: after every update the group's whole weights are gathered from the shards
(``LearnerGroup.full_state_dict``; a LoRA policy's adapters only, its base being frozen)
and copied into the driver's model, in place. The engine
samples with that model (the torch backend holds the same object; vLLM is synced from it by
the step, as in process; with rollout workers their engines take it from there), and the
step moves the policy version on after it: a version's samples come from that version's
weights only. Checkpoints are the in-process ones (the
driver's model, the optimizer's state in torch.optim's layout): a run resumes with any
``cluster.learner_ranks``, 0 included.

PPO's critic (``advantage = "gae"``) trains on the ranks too: its state is read and
written in the in-process layout (``GroupCritic``), so checkpoints stay interchangeable.

LoRA: every rank puts the same adapters on the start policy and loads the driver's fresh
adapter weights; FSDP2 shards the frozen base with them, and only the adapters train. A
critic beside them: a value head, or a value model that starts as the driver's policy
(adapters included) and trains its own adapters, as in process.

From the driver's model the weights go on to the rollout workers as
``cluster.weight_sync`` says (rollout_workers.py): through Ray's object store, or by a
broadcast of their own. The broadcast of a synchronous run, or of an asynchronous one a
step deep, skips the driver (``sends_from_ranks``): the ranks send the weights to the
workers themselves (ranks_to_workers.py), and the driver's model is brought up to date
only when it is read (a checkpoint; in a synchronous run, a replacement worker's start
weights: in an asynchronous one, rank 0 keeps what it sent for that).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from turnrl.distributed import ray_cluster
from turnrl.distributed.learner_group import LearnerGroup, LearnerRankError
from turnrl.distributed.rollout_workers import RayRolloutWorkers
from turnrl.envs import EnvFamily
from turnrl.errors import ConfigError, TurnrlError
from turnrl.models import load_model
from turnrl.models.lora import add_lora, is_lora
from turnrl.trainer.checkpoint import CheckpointWriteError, latest_checkpoint
from turnrl.trainer.config import Config
from turnrl.trainer.loop import RunResult
from turnrl.trainer.loop import train as train_in_loop
from turnrl.trainer.startup import LearnerSpec, MakeLearner, WorkersSpec
from turnrl.types import Sample

CALL_TIMEOUT_S = 900.0
"""The deadline of each call to the group (an update of a large model on a CPU is slow; a
rank that dies is noticed at once, whatever this says)."""


def train(
    config: Config,
    run_dir: Path,
    *,
    resume: bool = False,
    progress: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    env: EnvFamily | None = None,
    make_learner: MakeLearner | None = None,
) -> RunResult:
    """``trainer.loop.train`` with the learner on ``cluster.learner_ranks`` ranks (if >= 1;
    else ``make_learner``'s, or in this process) and the episodes on
    ``cluster.rollout_workers`` Ray actors (if >= 1). A rank that fails
    stops the run with a ``LearnerRankError`` naming it, and saying where ``--resume``
    continues from; a rollout worker that dies is replaced (rollout_workers.py). Every
    rank and worker is stopped when the run ends, however it ends."""
    started: list[GroupLearner] = []
    workers: list[RayRolloutWorkers] = []

    def make_group_learner(spec: LearnerSpec) -> GroupLearner:
        learner = GroupLearner.start(spec)
        started.append(learner)
        return learner

    def make_workers(spec: WorkersSpec) -> RayRolloutWorkers:
        c = spec.config.cluster
        fleet = RayRolloutWorkers(
            spec, c.rollout_workers, address=c.address, call_timeout_s=c.worker_timeout_s,
            weight_sync=c.weight_sync,
        )  # fmt: skip
        workers.append(fleet)
        if started and sends_from_ranks(spec.config, fleet.weight_sync):
            keep = spec.config.algorithm.max_staleness > 0
            fleet.send_from_ranks(started[0], keep=keep)
        return fleet

    run_dir = Path(run_dir)
    cluster = config.cluster
    if cluster.address and (cluster.rollout_workers or cluster.learner_placement == "ray"):
        ray_cluster.knock(cluster.address)  # before the start model is built: a typo fails now
    try:
        return train_in_loop(
            config, run_dir, resume=resume, progress=progress, on_row=on_row, env=env,
            make_learner=make_group_learner if cluster.learner_ranks >= 1 else make_learner,
            make_workers=make_workers if cluster.rollout_workers >= 1 else None,
        )  # fmt: skip
    except LearnerRankError as exc:
        raise resumable(exc, run_dir) from exc
    except CheckpointWriteError as exc:  # the rank died while the checkpoint was written
        if isinstance(exc.__cause__, LearnerRankError):
            raise resumable(exc.__cause__, run_dir) from exc
        raise
    finally:
        for learner in started:
            learner.group.close()
        for fleet in workers:
            fleet.close()


def sends_from_ranks(config: Config, weight_sync: str) -> bool:
    """Whether the learner's ranks send the weights to the rollout workers themselves
    (ranks_to_workers.py): a broadcast run whose syncs are all of the learner's weights
    of the moment, as the ranks hold them: a synchronous one, or an asynchronous one a
    step deep (``max_staleness = 1``), whose sync comes between two updates. Deeper
    pipelines sync from a copy of the weights made after each update, and partial
    rollouts offer the weights through the object store: both read the driver's model
    after every update, so their syncs go through it."""
    algo = config.algorithm
    shallow = algo.max_staleness <= 1 and not algo.partial_rollouts
    return weight_sync == "broadcast" and shallow


def with_adapters(load: Callable[[], Any], **lora: Any) -> Any:
    """``load()``'s model with LoRA adapters (``add_lora``'s settings: ``rank``, ``alpha``,
    ``target_modules``, ``dropout``): a ``LearnerGroup``'s source for a LoRA policy, each
    rank building the same adapters, as ``functools.partial(with_adapters, load,
    **lora)`` (it pickles where ``load`` does), e.g. ``load`` a ``functools.partial`` of
    ``turnrl.models.load_model``. The adapters' weights are the driver's to load next
    (``LearnerGroup.load_weights``)."""
    return add_lora(load(), **lora)


def resumable(exc: LearnerRankError, run_dir: Path) -> LearnerRankError:
    """``exc`` with where the run continues from."""
    try:
        newest = latest_checkpoint(run_dir, warn=lambda _: None)
    except TurnrlError:
        newest = None
    since = (
        f"its newest whole checkpoint is {newest.name}"
        if newest is not None
        else "no checkpoint was written yet (it starts again)"
    )
    first, _, details = str(exc).partition("\n")  # a rank's traceback, if it raised
    message = (
        f"learner {first}. The run stopped; {since}: continue it with --resume (with any "
        "cluster.learner_ranks, 0 included)." + (f"\n{details}" if details else "")
    )
    return LearnerRankError(message, ranks=exc.ranks, call=exc.call)


class GroupLearner:
    """A ``LearnerGroup`` as the trainer uses a ``Learner``: the learner of a run with
    ``cluster.learner_ranks >= 1`` (``start``), or of a loop of your own over a group and
    the driver's ``model`` (``GroupLearner(group, model)``).

    ``model`` is the driver's copy of the policy: the engine samples with it and
    checkpoints save it; ``step_samples`` leaves the group's new weights in it, unless
    ``model_lags`` (the ranks send them to the rollout workers themselves,
    ``RayRolloutWorkers.send_from_ranks``: then ``refresh_model`` brings them when the
    model is read)."""

    def __init__(self, group: LearnerGroup, model: Any) -> None:
        self.group = group
        self.model = model
        self.model_lags = False
        """Whether an update leaves ``model`` as it was (ranks_to_workers.py)."""
        self._behind = False
        """Whether ``model`` lags the ranks' weights now."""
        self.optimizer = GroupOptimizer(group, model)
        """The group's optimizer state as checkpoints read and write it."""
        self.critic = GroupCritic(group) if group.config.advantage == "gae" else None
        """PPO's critic on the ranks (``ShardedCritic``), as checkpoints read and write it."""

    @classmethod
    def start(cls, spec: LearnerSpec) -> GroupLearner:
        """Start ``cluster.learner_ranks`` ranks. Each loads the start policy (and from it
        the KL reference, sharded the same way); on a resume the checkpoint's weights and
        optimizer state follow through ``optimizer.load_state_dict``, as in process."""
        c = spec.config
        device = "cuda" if next(spec.model.parameters()).device.type == "cuda" else "cpu"
        source: Callable[[], Any] = functools.partial(
            load_model, spec.start_model, dtype=torch.float32, attention=c.model.attention
        )
        lo = c.model.lora
        if lo.rank > 0:  # the same adapters on the start policy; their weights come next
            source = functools.partial(
                with_adapters, source, rank=lo.rank, alpha=lo.alpha,
                target_modules=tuple(lo.target_modules), dropout=lo.dropout,
            )  # fmt: skip
        try:
            group = LearnerGroup(
                source, c.algorithm, num_ranks=c.cluster.learner_ranks,
                temperature=c.rollout.temperature, max_length=c.rollout.max_episode_tokens,
                device=device, autocast=spec.autocast, timeout_s=CALL_TIMEOUT_S,
                seed=c.seed, num_threads=c.threads,
                checkpoint_activations=c.model.gradient_checkpointing,
                fsdp_unit=c.cluster.fsdp_unit, placement=c.cluster.learner_placement,
                address=c.cluster.address, min_cpus=c.cluster.rollout_workers,
            )  # fmt: skip
        except ValueError as exc:  # e.g. fewer GPUs than ranks
            raise ConfigError(f"cluster.learner_ranks = {c.cluster.learner_ranks}: {exc}") from exc
        if lo.rank > 0 and not spec.resumed:  # the driver's fresh adapters, not the ranks' own
            weights = spec.model.state_dict()
            group.load_weights(weights)
            if c.algorithm.advantage == "gae" and c.algorithm.critic.placement == "model":
                group.load_critic_weights(weights)  # the value model starts as the policy
        return cls(group, spec.model)

    def step_samples(
        self,
        samples: Sequence[Sample],
        advantages: Sequence[float | Sequence[float]],
        pad_id: int,
    ) -> dict[str, float]:
        """The group's update (``Learner.step_samples`` across the ranks), then the weight
        sync: the new weights gathered and copied into ``model`` (``perf/weight_sync_s``)."""
        return self._synced(self.group.step_samples(samples, advantages, pad_id))

    def step_samples_gae(
        self,
        samples: Sequence[Sample],
        token_rewards: Sequence[float | Sequence[float]],
        pad_id: int,
    ) -> dict[str, float]:
        """PPO's update on the group (``Learner.step_samples_gae`` across the ranks: the
        critic's values, GAE, the policy's step, the critic's), then the weight sync."""
        return self._synced(self.group.step_samples_gae(samples, token_rewards, pad_id))

    def _synced(self, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` of an update, after the new weights are gathered and copied into
        ``model`` (``perf/weight_sync_s``); where ``model_lags``, not now."""
        if self.model_lags:
            self._behind = True
            return metrics
        t0 = time.perf_counter()
        self._behind = True
        self.refresh_model()
        metrics["perf/weight_sync_s"] = time.perf_counter() - t0
        return metrics

    def refresh_model(self) -> None:
        """``model`` holds the ranks' newest weights: gathered from the shards and copied
        in, in place (the engine's object keeps them), if it lags them. A LoRA policy's
        adapters only: its base is frozen, the same here as on the ranks."""
        if not self._behind:
            return
        lora = is_lora(self.model)
        weights = self.group.full_state_dict(trainable=lora)
        with torch.no_grad():
            if lora:
                missing = {n for n, p in self.model.named_parameters() if p.requires_grad}
                missing -= weights.keys()
                _, unexpected = self.model.load_state_dict(weights, strict=False)
                if missing or unexpected:
                    raise TurnrlError(
                        "the learner's ranks and the driver train different adapters: "
                        f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
                    )
            else:
                self.model.load_state_dict(weights)
        self._behind = False

    def sampler_gap(self, samples: Sequence[Sample], pad_id: int) -> float:
        return self.group.sampler_gap(samples, pad_id)

    def reference_kl(self, samples: Sequence[Sample], pad_id: int) -> list[list[float]]:
        return self.group.reference_kl(samples, pad_id)


class GroupCritic:
    """The group's critic state in the in-process ``Critic.state_dict`` layout, so a PPO
    checkpoint resumes with any number of ranks, 0 included."""

    def __init__(self, group: LearnerGroup) -> None:
        self.group = group

    def state_dict(self) -> dict[str, Any]:
        return self.group.critic_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.group.load_critic_state_dict(state)


class GroupOptimizer:
    """The group's optimizer state in torch.optim's layout, as the in-process learner's
    optimizer gives it (parameters by their index among the model's trainable ones), so
    checkpoints are the same whatever the number of ranks. The group keys it by parameter
    name (``LearnerGroup.state_dict``); this translates both ways."""

    def __init__(self, group: LearnerGroup, model: Any) -> None:
        self.group = group
        self.model = model
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        """Index -> parameter name: the order of ``trainable_parameters(model)``."""

    def state_dict(self) -> dict[str, Any]:
        return by_index(self.group.state_dict()["optimizer"], self.names)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state`` into the group, with the driver's model weights (a resume has
        just loaded the checkpoint's into it)."""
        named = by_name(state, self.names)
        self.group.load_state_dict({"model": self.model.state_dict(), "optimizer": named})


def by_index(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name, keyed by index in ``names`` instead."""
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted({n for g in state["param_groups"] for n in g["params"]} - set(index))
    if unknown:
        raise TurnrlError(f"the group's optimizer holds parameters the model lacks: {unknown}")
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [
            {**g, "params": [index[name] for name in g["params"]]} for g in state["param_groups"]
        ],
    }


def by_name(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """An optimizer state keyed by index in ``names``, keyed by parameter name instead."""
    ids = [i for g in state["param_groups"] for i in g["params"]]
    if sorted(ids) != list(range(len(names))):
        raise ConfigError(
            f"the checkpoint's optimizer holds {len(ids)} parameters, the model "
            f"{len(names)} trainable ones: it was written for another model"
        )
    return {
        "state": {names[int(i)]: value for i, value in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }
