"""The LearnerGroup: N learner ranks under FSDP2, driven like the in-process ``Learner``.

The group starts its ranks itself and joins them with a rendezvous on a free port (a
``TCPStore`` the driver holds). Where they run (``placement``): processes of the driver on
its machine (``LocalRanks``: ``torch.multiprocessing`` spawn, each called over a queue and
answering over a pipe), or Ray actors anywhere in a Ray cluster (``"ray"``: ray_ranks.py).
Calls and answers are pickles that hold their tensors' data (message_pickle.py). gloo on the CPU,
NCCL on GPUs (one per rank).
Each call splits its batch across the ranks; every rank runs the ``Learner``'s update on its
shard, normalised by the whole batch's counts (rank.py), so the update equals the one the
in-process learner makes from the whole batch.

Every call has a deadline. A rank that fails, hangs or dies becomes a ``LearnerRankError``
naming the rank and the call (``rank 1 died (exit code -9) during step 7``); the group then
stops all its ranks (none is left behind) and refuses further calls: a step half-applied on
some ranks cannot be continued, only restarted from a checkpoint (``state_dict``).

A LoRA model (``model`` returning one) trains only its adapters; the frozen base is
sharded with them. The rollout workers are synced from the whole weights gathered into
the driver (``full_state_dict``), or by rank 0 itself (ranks_to_workers.py, through
``call``).

Calls may come from several threads (an asynchronous run's rollout thread asks for a
replacement worker's weights while the update runs): they take turns, a call waiting for
the one running at most that call's deadline.
"""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from turnrl.distributed import message_pickle
from turnrl.distributed.rank import ModelSource, RankSpec, serve
from turnrl.errors import TurnrlError
from turnrl.rollout.batch import Batch
from turnrl.trainer.config import AlgorithmConfig
from turnrl.types import Sample

CRASH_LINES = 60
"""How many lines of a dead rank's stack (its fatal-signal report) its error quotes."""
CLOSE_TIMEOUT_S = 10.0
"""How long ``close`` waits for the ranks to leave the group before it kills them."""
BUSY_MARGIN_S = 60.0
"""How much longer than a call's deadline a call from another thread waits for it."""
FAILURE_GRACE_S = 1.0
"""After a rank reports an error, how long to look for a rank that died first (its death
is then the cause named; the error is often a peer's broken collective)."""


class LearnerRankError(TurnrlError):
    """A rank of a ``LearnerGroup`` failed, hung or died during a call. The group has
    been stopped; resume from the last checkpoint."""

    def __init__(self, message: str, *, ranks: Sequence[int], call: str) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        """The ranks at fault (the first is the cause where one can be told)."""
        self.call = call
        """The call, with its count: ``step 7``."""


class LearnerGroup:
    """``num_ranks`` processes, each holding a shard of ``model`` under FSDP2 and running
    the ``Learner`` on its part of each batch. The interface is the ``Learner``'s
    (``step``, ``step_samples``, ``sampler_gap``, ``reference_kl``), plus the whole
    weights for syncing engines (``full_state_dict``) and the state for checkpoints.

    ``model``: a model directory or a picklable function returning the model (every rank
    builds it; it must give the same weights each time). ``device``: ``auto`` (CUDA when
    there is a GPU per rank), ``cpu`` (gloo) or ``cuda`` (NCCL). ``timeout_s``: the
    deadline of each call; ``start_timeout_s``: of the start (imports, model loading).
    ``num_threads``: torch threads per rank (0: on the CPU, the cores shared among the
    ranks; on GPUs, torch's default). ``checkpoint_activations``: each rank's model
    recomputes its layers' activations in the backward (``model.gradient_checkpointing``).
    ``fsdp_unit``: ``"layer"`` shards each decoder layer as an FSDP2 unit of its own (a rank
    holds one layer whole at a time), ``"model"`` the whole model as one (rank.py).
    ``placement``: ``"local"`` (processes of this one) or ``"ray"`` (Ray actors on the
    cluster at ``address``, "" a local one; ``min_cpus``: the one-CPU actors a local
    cluster started here must also hold, the run's rollout workers).
    Use as a context manager, or call ``close``.
    """

    def __init__(
        self,
        model: ModelSource,
        config: AlgorithmConfig,
        *,
        num_ranks: int,
        temperature: float,
        max_length: int = 0,
        device: str = "auto",
        autocast: torch.dtype | None = None,
        timeout_s: float = 120.0,
        start_timeout_s: float = 300.0,
        seed: int = 0,
        num_threads: int = 0,
        checkpoint_activations: bool = False,
        fsdp_unit: str = "layer",
        placement: str = "local",
        address: str = "",
        min_cpus: int = 0,
    ) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        if placement not in ("local", "ray"):
            raise ValueError(f"placement must be 'local' or 'ray', got {placement!r}")
        self.num_ranks = num_ranks
        self.config = config
        self.placement = placement
        self.device = _chosen_device(device, num_ranks, local=placement == "local")
        self.timeout_s = timeout_s
        """The deadline of each call, in seconds (may be changed between calls)."""
        self._closed = False
        self._failure: LearnerRankError | None = None
        """What stopped the group, if a rank's failure did: a later call (another thread's)
        raises it again, so the run's error names the rank, not a closed group."""
        self._calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        """Held through a call: calls from several threads (an asynchronous run's update,
        and its rollout thread's ask for a replacement worker's weights) take turns."""
        self._busy = ""
        """The call holding the group."""
        spec = RankSpec(
            model=model, config=config, temperature=temperature, max_length=max_length,
            device=self.device, autocast=autocast, seed=seed,
            num_threads=num_threads or (
                max(1, _num_cpus() // num_ranks) if self.device == "cpu" else 0
            ),
            # Longer than a call's deadline: the driver names a hung rank first.
            collective_timeout_s=timeout_s + 60.0,
            checkpoint_activations=checkpoint_activations, fsdp_unit=fsdp_unit,
        )  # fmt: skip
        self._ranks: Ranks
        if placement == "local":
            self._ranks = LocalRanks(spec, num_ranks)
        else:
            from turnrl.distributed.ray_ranks import RayRanks

            self._ranks = RayRanks(spec, num_ranks, address=address, min_cpus=min_cpus)
        self._await("start", start_timeout_s)

    # ------------------------------------------------------------------ the learner's calls

    def step(self, batch: Batch | Sequence[Batch]) -> dict[str, float]:
        """One update from a batch (split into ranks' shards, then each into micro-batches
        of ``micro_batch.size``) or from given micro-batches (each split across the ranks)."""
        shards = split_batch(batch, self.num_ranks)
        metrics: dict[str, float] = self._call("step", [(s,) for s in shards])[0]
        return metrics

    def step_samples(
        self,
        samples: Sequence[Sample],
        advantages: Sequence[float | Sequence[float]],
        pad_id: int,
    ) -> dict[str, float]:
        """One update from token-exact samples, shared among the ranks by token count
        (``Learner.step_samples`` on each)."""
        if len(samples) != len(advantages):
            raise ValueError("one advantage per sample is required")
        return self._step_on_shards("step_samples", samples, advantages, pad_id)

    def step_samples_gae(
        self,
        samples: Sequence[Sample],
        token_rewards: Sequence[float | Sequence[float]],
        pad_id: int,
    ) -> dict[str, float]:
        """PPO's update (``Learner.step_samples_gae``) from samples and their per-token
        rewards, shared among the ranks by token count: each rank's critic scores its
        samples, GAE runs per sample, the whitening and normalisers are the whole batch's."""
        if len(samples) != len(token_rewards):
            raise ValueError("one reward sequence per sample is required")
        return self._step_on_shards("step_samples_gae", samples, token_rewards, pad_id)

    def _step_on_shards(
        self, call: str, samples: Sequence[Sample], per_sample: Sequence[Any], pad_id: int
    ) -> dict[str, float]:
        """The update ``call`` on every rank, each given its share of ``samples`` (by token
        count) with their ``per_sample`` values; the metrics (the same on every rank)."""
        if not samples:
            raise ValueError("cannot step on no samples")
        shards = shard_by_tokens([len(s.input_ids) for s in samples], self.num_ranks)
        args = [([samples[i] for i in s], [per_sample[i] for i in s], pad_id) for s in shards]
        metrics: dict[str, float] = self._call(call, args)[0]
        return metrics

    def critic_state_dict(self) -> dict[str, Any]:
        """PPO's critic, whole, in the in-process ``Critic.state_dict`` layout."""
        state: dict[str, Any] = self._call("critic_state_dict", [()] * self.num_ranks)[0]
        return state

    def load_critic_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``critic_state_dict`` returned (or an in-process critic's state)."""
        self._call("load_critic_state_dict", [(state,)] * self.num_ranks)

    def sampler_gap(self, samples: Sequence[Sample], pad_id: int) -> float:
        """``Learner.sampler_gap`` over all samples (each rank scores its share)."""
        shards = shard_by_tokens([len(s.input_ids) for s in samples], self.num_ranks)
        gaps = self._call("sampler_gap", [([samples[i] for i in s], pad_id) for s in shards])
        return max(float(g) for g in gaps)

    def reference_kl(self, samples: Sequence[Sample], pad_id: int) -> list[list[float]]:
        """``Learner.reference_kl`` over all samples, in their order."""
        shards = shard_by_tokens([len(s.input_ids) for s in samples], self.num_ranks)
        parts = self._call("reference_kl", [([samples[i] for i in s], pad_id) for s in shards])
        out: list[list[float]] = [[] for _ in samples]
        for shard, part in zip(shards, parts, strict=True):
            for i, kl in zip(shard, part, strict=True):
                out[i] = kl
        return out

    def full_state_dict(self, trainable: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's weights, gathered from the shards (on the CPU): what an
        inference engine loads to sample with the new policy. With ``trainable``, only
        the weights that train (a LoRA policy's adapters: its frozen base never changes)."""
        calls = [(trainable,)] * self.num_ranks
        weights: dict[str, torch.Tensor] = self._call("full_state_dict", calls)[0]
        return weights

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load whole model weights (``full_state_dict``'s layout) into every rank's shard;
        the optimizer's state is left as it is."""
        self._call("load_weights", [(weights,)] * self.num_ranks)

    def load_critic_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load whole model weights into every rank's shard of PPO's separate value model
        (``critic.placement = "model"``): a fresh LoRA run's value model starts as the
        driver's policy, adapters included, as the in-process critic's copy does."""
        self._call("load_critic_weights", [(weights,)] * self.num_ranks)

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs, whole (not sharded): ``{"model": weights,
        "optimizer": state}``, the optimizer's state keyed by parameter name (the format of
        ``torch.distributed.checkpoint.state_dict``); loadable by a group of any size."""
        state: dict[str, Any] = self._call("state_dict", [()] * self.num_ranks)[0]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` returned (each rank is sent all of it and keeps its
        shard)."""
        self._call("load_state_dict", [(state,)] * self.num_ranks)

    def call(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(learner, *args)`` on every rank (``learner``: that rank's
        ``ShardedLearner``), the answers in rank order; ``fn`` must be picklable (a module's
        function). For tests and extensions; collectives in ``fn`` run on every rank."""
        return self._call(f"call {getattr(fn, '__name__', 'fn')}", [(fn, *args)] * self.num_ranks)

    # ----------------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Ask the ranks to leave the group, then stop any that has not (none outlives it)."""
        self._failure = None  # closed on purpose: later calls are refused as closed
        if self._closed:
            return
        self._closed = True
        self._ranks.close(CLOSE_TIMEOUT_S)

    def __enter__(self) -> LearnerGroup:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, in rank order."""
        return self._ranks.pids()

    # ----------------------------------------------------------------------- internals

    def _call(self, name: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``name`` on every rank, one ``args`` each, once no other call runs: the answers.
        The wait for a call running in another thread is bounded by that call's deadline."""
        wait_s = self.timeout_s + BUSY_MARGIN_S
        if not self._lock.acquire(timeout=wait_s):
            raise TurnrlError(
                f"the learner group was busy with {self._busy} for more than {wait_s:.0f} s: "
                f"{name} could not start"
            )
        try:
            if self._failure is not None:
                f = self._failure
                raise LearnerRankError(str(f), ranks=f.ranks, call=f.call)
            if self._closed:
                raise TurnrlError("this LearnerGroup is closed (after close() or a rank's failure)")
            kind = name.split(" ")[0]
            self._calls[kind] += 1
            label = f"{name} {self._calls[kind]}" if kind == name else name
            self._busy = label
            command = name if kind != "call" else "call"
            for rank, rank_args in enumerate(args):
                # bytes: tensors by value (message_pickle.py); never blocks here
                self._ranks.send(rank, message_pickle.encode((command, rank_args)))
            return self._await(label, self.timeout_s)
        finally:
            self._lock.release()

    def _await(self, label: str, timeout_s: float) -> list[Any]:
        """Each rank's answer to the call ``label``, or a ``LearnerRankError`` (and the
        group stopped) when one fails, dies or misses the deadline."""
        deadline = time.monotonic() + timeout_s
        results: dict[int, Any] = {}
        pending = set(range(self.num_ranks))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(pending)
                who = f"rank {late[0]}" if len(late) == 1 else f"ranks {_listed(late)}"
                self._fail(f"{who} did not answer {label} within {timeout_s:g} s", late, label)
            for rank, (status, value) in self._ranks.answers(sorted(pending), remaining):
                if status == "error":
                    self._rank_failed(rank, value, label)
                results[rank] = value
                pending.discard(rank)
            dead = self._ranks.dead()
            if dead:
                self._fail(self._deaths(dead, label), dead, label)
        return [results[r] for r in range(self.num_ranks)]

    def _rank_failed(self, rank: int, text: str, label: str) -> None:
        """A rank raised: name a rank that died meanwhile as the cause, else this one."""
        others = [r for r in range(self.num_ranks) if r != rank]
        self._ranks.await_deaths(others, FAILURE_GRACE_S)  # the reporting rank may exit itself
        dead = [r for r in self._ranks.dead() if r != rank]
        last = text.strip().splitlines()[-1] if text.strip() else "an error"
        if dead:
            message = f"{self._deaths(dead, label)}; rank {rank} then failed: {last}"
            self._fail(message, dead, label)
        self._fail(f"rank {rank} failed in {label}: {last}\n{text}", [rank], label)

    def _deaths(self, dead: list[int], label: str) -> str:
        """Each dead rank named with how it died, then the stacks of those that left one."""
        named = "; ".join(f"rank {r} died ({self._ranks.death(r)}) during {label}" for r in dead)
        stacks = [(r, self._ranks.last_stack(r)) for r in dead]
        return named + "".join(f"\nrank {r}'s stack as it died:\n{s}" for r, s in stacks if s)

    def _fail(self, message: str, ranks: Sequence[int], label: str) -> None:
        """Stop every rank (a failed step cannot be continued) and raise."""
        self._closed = True
        self._ranks.kill()
        self._failure = LearnerRankError(message, ranks=ranks, call=label)
        raise self._failure


class Ranks(Protocol):
    """Where a group's ranks run and how the driver reaches them: processes of this one
    (``LocalRanks``) or Ray actors (ray_ranks.py). Every rank first answers its start."""

    def send(self, rank: int, payload: bytes) -> None:
        """Send ``rank`` a call (``message_pickle``-encoded (name, args)); never blocks long."""

    def answers(self, ranks: Sequence[int], timeout_s: float) -> list[tuple[int, Any]]:
        """The (rank, (status, value)) answers of ``ranks`` that are in, waiting up to
        ``timeout_s`` for the first; none when the time is up or a rank died."""
        ...

    def dead(self) -> list[int]:
        """The ranks that are gone."""
        ...

    def death(self, rank: int) -> str:
        """How ``rank`` died: "exit code -9"."""
        ...

    def last_stack(self, rank: int) -> str:
        """The Python stacks ``rank`` left when a fatal signal killed it ("" if none)."""
        ...

    def await_deaths(self, ranks: Sequence[int], timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for any of ``ranks`` to be found dead."""

    def pids(self) -> list[int]:
        """The ranks' process ids, in rank order."""
        ...

    def close(self, timeout_s: float) -> None:
        """Ask every rank to leave, wait up to ``timeout_s``, then stop any left."""

    def kill(self) -> None:
        """Stop every rank now (none outlives the group) and release what is held."""


class LocalRanks:
    """The ranks as processes of this one (``torch.multiprocessing`` spawn) on this
    machine, joined through a store on a free local port (held here), each called over a
    queue and answering over a pipe. A rank exits with the driver's process. A rank that
    dies of a fatal signal leaves its threads' Python stacks in a file of a private
    directory (faulthandler), which ``last_stack`` reads for the error."""

    def __init__(self, spec: RankSpec, num_ranks: int) -> None:
        self._crash_dir = tempfile.mkdtemp(prefix="turnrl-ranks-")
        # The rendezvous: a store on a free port (the OS picks it), held here.
        self._store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", 0, is_master=True, wait_for_workers=False
        )
        address = ("127.0.0.1", int(self._store.port))
        ctx = mp.get_context("spawn")
        self._commands: list[Any] = []
        self._answers: list[Connection] = []
        self._processes: list[Any] = []
        for rank in range(num_ranks):
            commands = ctx.Queue()
            answers, answer_end = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=serve, name=f"turnrl-learner-rank{rank}", daemon=True,
                args=(
                    rank, num_ranks, address, spec, commands, answer_end, os.getpid(),
                    self._crash_file(rank),
                ),
            )  # fmt: skip
            process.start()
            answer_end.close()
            self._commands.append(commands)
            self._answers.append(answers)
            self._processes.append(process)
        self._finalizer = weakref.finalize(
            self, _kill, list(self._processes), crash_dir=self._crash_dir
        )
        self._released = False

    def _crash_file(self, rank: int) -> str:
        return os.path.join(self._crash_dir, f"rank{rank}.crash")

    def send(self, rank: int, payload: bytes) -> None:
        self._commands[rank].put(payload)  # a feeder thread writes it

    def answers(self, ranks: Sequence[int], timeout_s: float) -> list[tuple[int, Any]]:
        sentinels = [p.sentinel for p in self._processes]
        ready = wait([self._answers[r] for r in ranks] + sentinels, timeout_s)
        got = []
        for rank in ranks:
            if self._answers[rank] not in ready:
                continue
            try:
                got.append((rank, message_pickle.decode(self._answers[rank].recv_bytes())))
            except (EOFError, OSError):
                break  # the rank is gone: its death is found by ``dead``
        return got

    def dead(self) -> list[int]:
        """A process's sentinel is ready a moment before it can be reaped: those are
        joined (briefly), so that their exit code is known."""
        ended = set(wait([p.sentinel for p in self._processes], 0))
        for p in self._processes:
            if p.sentinel in ended and p.exitcode is None:
                p.join(1.0)
        return [r for r, p in enumerate(self._processes) if p.exitcode is not None]

    def death(self, rank: int) -> str:
        return f"exit code {self._processes[rank].exitcode}"

    def last_stack(self, rank: int) -> str:
        try:
            with open(self._crash_file(rank)) as report:
                lines = report.read().strip().splitlines()
        except OSError:
            return ""
        cut = [f"[{len(lines) - CRASH_LINES} more lines]"] if len(lines) > CRASH_LINES else []
        return "\n".join(lines[:CRASH_LINES] + cut)

    def await_deaths(self, ranks: Sequence[int], timeout_s: float) -> None:
        wait([self._processes[r].sentinel for r in ranks], timeout_s)

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._processes]

    def close(self, timeout_s: float) -> None:
        for commands in self._commands:
            commands.put(message_pickle.encode(("close", ())))
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        _kill(self._processes, crash_dir=self._crash_dir)
        if self._released:
            return
        self._released = True
        for commands in self._commands:
            commands.cancel_join_thread()  # a dead rank never reads what is queued for it
            commands.close()
        for answers in self._answers:
            answers.close()
        self._finalizer.detach()


def _kill(processes: Sequence[Any], crash_dir: str = "") -> None:
    """Kill and reap every process still running (a hung collective ignores anything
    gentler; a stopped process too), then delete ``crash_dir``."""
    for process in processes:
        if process.exitcode is None:
            process.kill()
    for process in processes:
        process.join(5.0)
    if crash_dir:
        shutil.rmtree(crash_dir, ignore_errors=True)


def _listed(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _chosen_device(device: str, num_ranks: int, local: bool = True) -> str:
    """``device`` made definite; ``local``: the ranks run on this machine, whose GPUs are
    counted (Ray's ranks are counted against the cluster's, ray_ranks.py)."""
    if device == "auto":
        usable = torch.cuda.is_available() and torch.cuda.device_count() >= num_ranks
        return "cuda" if usable or (not local and torch.cuda.is_available()) else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if local and device == "cuda" and torch.cuda.device_count() < num_ranks:
        raise ValueError(
            f"{num_ranks} ranks need {num_ranks} GPUs, found {torch.cuda.device_count()}"
        )
    return device


def _num_cpus() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def shard_by_tokens(lengths: Sequence[int], num_shards: int) -> list[list[int]]:
    """Indices of ``lengths`` in ``num_shards`` shards of about equal total length: longest
    first, each to the shard with the fewest tokens so far; each shard in index order."""
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    load = [0] * num_shards
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = min(range(num_shards), key=lambda k: (load[k], k))
        shards[k].append(i)
        load[k] += lengths[i]
    return [sorted(s) for s in shards]


def split_batch(batch: Batch | Sequence[Batch], num_shards: int) -> list[Batch | list[Batch]]:
    """Each rank's share: of one batch, a contiguous block of its rows (the rank cuts it
    into micro-batches); of given micro-batches, a block of the rows of each. Shares
    differ by at most one row per batch; a share may be empty (an empty list)."""

    def rows(b: Batch, k: int) -> slice:
        return slice(b.num_sequences * k // num_shards, b.num_sequences * (k + 1) // num_shards)

    if isinstance(batch, Batch):
        return [
            batch.select(rows(batch, k)) if rows(batch, k).start < rows(batch, k).stop else []
            for k in range(num_shards)
        ]
    return [
        [mb.select(rows(mb, k)) for mb in batch if rows(mb, k).start < rows(mb, k).stop]
        for k in range(num_shards)
    ]
