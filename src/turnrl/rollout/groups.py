"""Many episodes at once: groups of samples per task, their requests batched together.

``collect_groups`` runs P tasks x G samples as concurrent asyncio episodes. Each episode
asks for one completion at a time; ``BatchingClient`` gathers the requests of every
episode that is waiting for the model into one backend call, so a step's forward passes
cover all live episodes, whatever turn each one is at.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from turnrl.protocols import Backend, Env
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, derive_seed, run_episode
from turnrl.types import Completion, GenerationRequest, Task, Trajectory


class BatchingClient:
    """Coalesces single requests from concurrent episodes into batched backend calls.

    A batch is sent as soon as every live episode is waiting for the model, or when the
    others stop making progress (they wait on a slow tool), so a slow tool delays nobody.
    Requests inside a batch are ordered by arrival. A backend whose ``submit`` takes them
    (continuous batching, ``TorchBackend.run``) answers each request as soon as it is done, and pauses
    until this client is ``quiet`` again, so follow-up requests join at the same decode
    step on every run; others answer a batch at once.
    """

    def __init__(self, backend: Backend, *, patience: int = 64) -> None:
        self.backend = backend
        self.patience = patience
        self.live = 0
        self._pending: list[tuple[GenerationRequest, asyncio.Future[Completion]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def generate(self, request: GenerationRequest) -> Completion:
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        # Let the other episodes reach their next request. Counting loop turns rather than
        # seconds keeps batches (and so results) the same under any machine load, as long as
        # tools answer without real waiting; an episode that makes no progress for
        # ``patience`` turns is busy elsewhere (a slow tool) and is not waited for.
        idle = 0
        while len(self._pending) < self.live and idle < self.patience:
            before = len(self._pending)
            await asyncio.sleep(0)
            idle = 0 if len(self._pending) > before else idle + 1
        batch, self._pending = self._pending, []
        futures = self.backend.submit([r for r, _ in batch], self.quiet)
        if futures is not None:  # a continuous-batching backend settles each on its own
            for (_, future), done in zip(batch, futures, strict=True):
                _chain(done, future)
        else:
            await self._generate(batch)
        if self._pending:
            self._flusher = asyncio.create_task(self._flush())

    def quiet(self) -> bool:
        """No request is waiting to be sent (the backend's lockstep barrier asks)."""
        return not self._pending

    async def _generate(
        self, batch: list[tuple[GenerationRequest, asyncio.Future[Completion]]]
    ) -> None:
        try:
            completions = await self.backend.generate([r for r, _ in batch])
            if len(completions) != len(batch):
                raise RuntimeError(
                    f"backend returned {len(completions)} completions for {len(batch)} requests"
                )
        except Exception as exc:  # every waiting episode records the failure
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
        else:
            for (_, future), completion in zip(batch, completions, strict=True):
                if not future.done():
                    future.set_result(completion)


def _chain(source: asyncio.Future[Completion], target: asyncio.Future[Completion]) -> None:
    """Settle ``target`` like ``source`` when it settles."""

    def copy(done: asyncio.Future[Completion]) -> None:
        if target.done():
            return
        if done.cancelled():
            target.cancel()
        elif done.exception() is not None:
            target.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)


@dataclass(frozen=True)
class GroupSpec:
    """What one batch of groups needs besides the tasks."""

    group_size: int
    limits: EpisodeLimits
    sampling: SamplingParams
    seed: int
    policy_version: int = 0


async def collect_groups(
    tasks: Sequence[Task],
    make_env: Callable[[], Env],
    backend: Backend,
    renderer: ChatRenderer,
    spec: GroupSpec,
) -> list[list[Trajectory]]:
    """Run ``group_size`` episodes of every task concurrently; return them grouped by task.

    Seeds derive from (run seed, task id, sample index), so a sample does not depend on
    which other episodes ran beside it.
    """
    client = BatchingClient(backend)

    async def one(task: Task, index: int) -> Trajectory:
        client.live += 1
        try:
            env = make_env()
            return await run_episode(
                env,
                task,
                client.generate,
                renderer,
                limits=spec.limits,
                sampling=spec.sampling,
                seed=derive_seed(spec.seed, task.id, index),
                sample_index=index,
                policy_version=spec.policy_version,
            )
        finally:
            client.live -= 1

    flat = await asyncio.gather(*(one(t, i) for t in tasks for i in range(spec.group_size)))
    G = spec.group_size
    return [list(flat[p * G : (p + 1) * G]) for p in range(len(tasks))]


def rollout_metrics(groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
    """The ``rollout/*`` metrics (docs/design.md, "Metric names") for one batch of groups."""
    trajs = [t for g in groups for t in g]
    n = max(1, len(trajs))
    calls = [c for t in trajs for c in t.tool_calls]
    stds = [statistics.stdev([t.reward for t in g]) if len(g) > 1 else 0.0 for g in groups]
    return {
        "rollout/reward_mean": sum(t.reward for t in trajs) / n,
        "rollout/success_mean": sum(t.success for t in trajs) / n,
        "rollout/reward_std_in_group": sum(stds) / max(1, len(stds)),
        "rollout/zero_variance_groups_frac": sum(s == 0.0 for s in stds) / max(1, len(stds)),
        "rollout/turns_mean": sum(len(t.turns) for t in trajs) / n,
        "rollout/tool_calls_mean": len(calls) / n,
        "rollout/tool_errors_frac": sum(not c.ok for c in calls) / max(1, len(calls)),
        "rollout/truncated_frac": sum(t.truncated for t in trajs) / n,
        "rollout/template_breaks": float(sum(t.template_breaks for t in trajs)),
        "rollout/context_rewrites": float(sum(t.context_rewrites for t in trajs)),
        "rollout/errors": float(sum(t.error is not None for t in trajs)),
        **_model_error_counts(trajs),
        "rollout/completion_tokens_mean": sum(t.num_completion_tokens for t in trajs) / n,
        **_component_means(trajs),
    }


def _model_error_counts(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``rollout/agent_model_errors``: episodes an agent framework ended by raising for the
    model's mistake (failed episodes, trained on: ``turnrl.envs.agent``), and the count of
    each exception type, ``rollout/agent_model_errors/<type>``."""
    kinds = Counter(
        str(t.info["model_error"].get("type")) for t in trajs if "model_error" in t.info
    )
    return {
        "rollout/agent_model_errors": float(sum(kinds.values())),
        **{f"rollout/agent_model_errors/{k}": float(n) for k, n in sorted(kinds.items())},
    }


def _component_means(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``rollout/reward/<name>``: each reward component's mean over the episodes that
    report it (every component logged separately: docs/algorithms.md, "Rewards for tool use")."""
    values: dict[str, list[float]] = {}
    for t in trajs:
        for name, value in t.reward_components.items():
            values.setdefault(name, []).append(float(value))
    return {f"rollout/reward/{name}": sum(v) / len(v) for name, v in sorted(values.items())}
