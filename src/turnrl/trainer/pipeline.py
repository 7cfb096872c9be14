"""How the loop runs its steps: one after the other, or with the next rollouts overlapped.

``SynchronousStepper`` is the reference: each step collects with the learner's current weights,
updates, then syncs the engine (``train_step``). ``PipelinedStepper`` is asynchronous training with
``algorithm.max_staleness`` = k >= 1: a background thread collects the batches of steps
s + 1 .. s + k while step s updates, one batch after the other on the one engine. The
engine holds its own weights (a copy, for the torch backend) and is synced between
batches, when no episode is in flight: every turn, and every episode, is sampled by one
version, recorded on the turn (an episode in flight at an update finishes on the weights
it started with). The update weights the older samples with the behaviour log-probs
(``off_policy``, ``token_tis`` by default).

Partial rollouts (``algorithm.partial_rollouts``): the engine also takes new weights
mid-batch. After each update the loop publishes the learner's weights, and the engine,
between two decoding steps, sees that newer weights wait (protocols.TurnSync): it lets
the turns it is decoding finish, admits nothing new, loads the published weights, and
goes on. An episode in flight then continues with the newer weights from its next turn:
no turn mixes versions, but an episode may (``rollout/episodes_across_versions``), and its
staleness is counted by its oldest turn. Where the sync lands depends on timing, so such
a run is not reproducible bit for bit, for any k. Rollout workers get the same: after each
update the driver's engine takes the learner's weights and the workers are offered them
(``RolloutWorkers.offer``), which each takes between turns.

Which weights sample a batch: the newest the learner has when the batch starts.
- When the engine is idle as a batch is queued (always with k = 1: the batch of step s + 1
  is queued once step s's batch is in), the loop syncs it from the learner there and then,
  before the update: batch s + 1 is sampled by the weights of before update s, exactly one
  version stale, the same in every run of a seed.
- With k >= 2 the engine is usually still sampling earlier batches when one is queued.
  After each update the loop copies the learner's weights (``PublishedWeights``: one more copy of
  the policy in memory), and the background thread syncs the engine from that copy before
  each batch if it is newer than the engine's. A batch is queued only once the learner's
  version is at least its step minus k, so no trajectory is more than k versions behind
  when it is trained on. Which version samples a batch then depends on how long rollouts
  and updates take: a run with k >= 2 is not reproducible bit for bit, and every turn
  records its version, so its metrics say what happened (``rollout/staleness_<d>``).

Overlapping batches (``algorithm.overlap_batches``, with partial rollouts and k >= 2): the
batches collected ahead run at the same time instead of one after the other. Each starts as
soon as it is queued, as a task of one program (backends/concurrent_programs.py). In this
process the program runs on the engine, so a batch's episodes fill the engine beside the slowest
episodes of the batch before it; the engine is then never idle between batches, and takes
every new weights between turns (the hook above). With rollout workers the program only
waits for the workers: every batch's shards go out as soon as it is queued, and each worker
runs the shards it holds together on its engine, taking the offered weights between turns
(distributed/rollout_workers.py). The bound holds as before: a batch is queued only once
the learner's version is at least its step minus k.

A deeper pipeline helps where rollout and update times vary from step to step (a slow
batch is absorbed by the batches collected ahead); where each is steady, k = 1 already
hides the shorter of the two.

Prompts and seeds belong to the step index (``collect``), not to when a batch was made, so
a run stopped between checkpoints and resumed collects exactly the prompts it would have:
the batches collected ahead and lost are collected again, none skipped, none repeated
(what differs is the weights that sample them). Every wait has a deadline.
"""

from __future__ import annotations

import concurrent.futures
import copy
import threading
import time
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from turnrl.backends.concurrent_programs import ConcurrentPrograms
from turnrl.errors import TurnrlError
from turnrl.protocols import TurnSync
from turnrl.trainer.step import (
    Row,
    RunParts,
    StepRollouts,
    rollout_phase,
    rollout_program,
    run_program,
    sync_engines,
    train_step,
    update_phase,
)

AHEAD_DEADLINE_S = 3600.0
"""How long the loop waits for a batch collected ahead when episodes have no time limit
(``rollout.episode_timeout_s`` = 0); otherwise the episodes' limit per sampling round, plus
ten minutes."""

HAND_BACK_S = 600.0
"""How long an evaluation waits for the rollout thread to leave the engine once its batches
are in (the engine's end of a run: a vLLM engine put to sleep)."""


class RolloutAheadError(TurnrlError):
    """A rollout running ahead of the learner did not finish in time."""


class SynchronousStepper:
    """Collect, update, sync: ``train_step``."""

    def step(self, parts: RunParts, step: int, trajectories_out: TextIO) -> Row:
        return train_step(parts, step, trajectories_out)

    def learner_version(self, parts: RunParts) -> int:
        """The policy version of the learner's weights (what a checkpoint records)."""
        return parts.backend.policy_version

    def before_eval(self, parts: RunParts) -> Row:
        """Nothing: the engine already holds the learner's weights."""
        return {}

    def close(self) -> None:
        """Nothing runs in the background."""


@dataclass
class PublishedWeights:
    """The learner's weights as of an update, for the background thread to sync the engine
    from while the learner moves on (k >= 2)."""

    model: Any
    """A copy of the learner's model, loaded in place after each update."""
    version: int
    """Its policy version."""


class PipelinedStepper:
    """The rollouts of the next ``depth`` steps in a background thread, in step order (or
    all at once, ``overlap``), while this step updates."""

    def __init__(self, depth: int, *, partial: bool = False, overlap: bool = False) -> None:
        """``partial``: the engine takes new weights mid-batch, between turns
        (``take_weights_between_turns`` hands it the hook); ``overlap`` (with ``partial``):
        the batches queued run at the same time (on the engine, or the workers)."""
        if depth < 1:
            raise ValueError(f"a pipeline is at least one step deep, not {depth}")
        if overlap and not partial:
            raise ValueError("overlapping batches take new weights between turns: partial")
        self.depth = depth
        self.partial = partial
        self.overlap = overlap
        self._concurrent: ConcurrentPrograms | None = None
        """Overlapping batches: what runs them together, on the background thread."""
        self._hooked: Any = None
        """The engine given the mid-batch hook, to take it back on ``close``."""
        self._mid_batch_syncs = 0
        self._mid_batch_sync_s = 0.0
        """Syncs between turns so far, and their seconds (written on the engine's thread)."""
        # A new thread's OpenMP thread count is the process's default, not the count
        # ``threads`` set on the loop's thread: the rollouts would run on another number of
        # threads (and vLLM's CPU attention refuses to, "thread_num (2 vs. 1)").
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, "turnrl-rollout-ahead", initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )  # fmt: skip
        self._queue: dict[int, concurrent.futures.Future[tuple[StepRollouts, int]]] = {}
        """The batches queued or collected ahead, by step, oldest first: each with the most
        batches that ran at once while it ran."""
        self._version: int | None = None
        self._published: PublishedWeights | None = None
        self._lock = threading.Lock()
        """Held while the published copy is written or the engine is synced from it."""

    def step(self, parts: RunParts, step: int, trajectories_out: TextIO) -> Row:
        started = time.perf_counter()
        version = self.learner_version(parts)
        collected = self._batch(parts, step)
        waited = time.perf_counter() - started
        synced: Row = {}
        for ahead in range(step + 1, min(step + 1 + self.depth, parts.config.steps)):
            if ahead not in self._queue:  # sampled by the weights of now, or newer ones
                synced.update(self._queue_batch(parts, ahead))
        row = update_phase(parts, step, collected, version, trajectories_out)
        add_timings(row, synced)  # the batch's own sync may have timed it too
        self._version = version + 1
        if step + 1 < parts.config.steps:
            if self.depth > 1 or (self.partial and parts.workers is None):
                self._publish(parts)
            if self.partial and parts.workers is not None:
                add_timings(row, self._offer(parts))
        step_s = time.perf_counter() - started
        row["perf/rollout_s"], row["perf/rollout_wait_s"] = collected.rollout_s, waited
        row["perf/step_s"], row["perf/train_s"] = step_s, step_s - waited
        row["perf/tokens_per_s"] = row.pop("_tokens") / max(step_s, 1e-9)
        return row

    def learner_version(self, parts: RunParts) -> int:
        if self._version is None:  # the first step: the engine starts with the learner's
            self._version = parts.backend.policy_version
        return self._version

    def before_eval(self, parts: RunParts) -> Row:
        """Let the batches collected ahead finish (each is kept for its step), then give
        the engine the learner's weights: evaluations measure the learner's policy. The
        sync's metrics (the step's row adds them to its own)."""
        for ahead in list(self._queue):
            self._wait(parts, ahead, keep=True)
        try:  # the background thread is done with the engine (overlapping batches' program)
            self._pool.submit(lambda: None).result(timeout=HAND_BACK_S)
        except concurrent.futures.TimeoutError as exc:
            raise RolloutAheadError(
                f"the rollout thread did not hand the engine back within {HAND_BACK_S:.0f} s "
                "of its last batch"
            ) from exc
        return self._bring_engine(parts)

    def close(self) -> None:
        """Drop the batches queued ahead: those not started never run, the one running is
        let finish (its episodes hold tool processes and engine slots); stop the thread;
        take the mid-batch hook back from the engine."""
        queued, self._queue = list(self._queue.values()), {}
        for future in queued:
            future.cancel()  # False for the running one
        concurrent.futures.wait(queued, timeout=AHEAD_DEADLINE_S)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._hooked is not None:
            self._hooked.turn_sync, self._hooked = None, None

    def take_weights_between_turns(self, parts: RunParts) -> None:
        """Partial rollouts: give the engine the hook that syncs it mid-batch from the
        published weights (protocols.TurnSync). With rollout workers, which sample the
        batches, ``_offer`` after each update instead."""
        if parts.workers is not None:
            return
        parts.backend.turn_sync = TurnSync(
            wanted=lambda: self._newer(parts), apply=lambda: self._between_turns(parts)
        )
        self._hooked = parts.backend

    def _offer(self, parts: RunParts) -> Row:
        """Partial rollouts on rollout workers, after an update: the driver's engine (idle:
        the workers sample) takes the learner's weights, and the workers are offered them
        to take between turns (``RolloutWorkers.offer``); the offer's metrics."""
        assert parts.workers is not None
        with self._lock:
            version = self.learner_version(parts)
            parts.backend.sync(parts.learner.model)
            parts.backend.policy_version = version
            return parts.workers.offer(parts.learner.model, version)

    def _newer(self, parts: RunParts) -> bool:
        """Whether the published weights are newer than the engine's (read without the
        lock: a stale answer only moves the sync by one decoding step)."""
        p = self._published
        return p is not None and p.version > parts.backend.policy_version

    def _between_turns(self, parts: RunParts) -> None:
        """On the engine's thread, mid-batch, nothing being decoded: take the published
        weights, counted and timed for the batch's row."""
        started = time.perf_counter()
        if self._take_published(parts) is not None:
            self._mid_batch_syncs += 1
            self._mid_batch_sync_s += time.perf_counter() - started

    def _batch(self, parts: RunParts, step: int) -> StepRollouts:
        if step in self._queue:
            return self._wait(parts, step, keep=False)
        return self._rollout(parts, step)  # the first step (or the first after a resume)

    def _rollout(self, parts: RunParts, step: int) -> StepRollouts:
        """``rollout_phase``, with the mid-batch syncs it saw in its row."""
        syncs = self._mid_batch_syncs, self._mid_batch_sync_s
        return self._with_syncs(parts, rollout_phase(parts, step), syncs)

    def _with_syncs(
        self, parts: RunParts, collected: StepRollouts, before: tuple[int, float]
    ) -> StepRollouts:
        """``collected`` with the mid-batch syncs since the counts ``before`` in its row
        (partial rollouts, the engine in this process: rollout workers take their offers on
        their own). With overlapping batches a sync counts in every batch it fell in."""
        if self.partial and parts.workers is None:
            collected.row["rollout/mid_batch_syncs"] = float(self._mid_batch_syncs - before[0])
            collected.row["perf/mid_batch_sync_s"] = self._mid_batch_sync_s - before[1]
        return collected

    def _queue_batch(self, parts: RunParts, step: int) -> Row:
        """Queue the rollout of ``step``. An idle engine takes the learner's weights now
        (the sync's metrics); a busy one takes the newest published ones before it starts
        this batch (their metrics go in this batch's row). Overlapping batches: the batch
        starts at once, beside those running (``ConcurrentPrograms``), on the engine, which
        takes the published weights between turns, or on the workers, which take the offered
        ones."""
        if self.overlap:
            if self._concurrent is None:  # on the engine, or beside the workers' calls
                self._concurrent = ConcurrentPrograms(
                    lambda program: run_program(parts, program), self._pool
                )
            self._queue[step] = self._concurrent.submit(lambda: self._overlapped(parts, step))
            return {}
        synced: Row = {}
        if all(f.done() for f in self._queue.values()):  # nothing runs: sync it here
            synced = self._bring_engine(parts)
        self._queue[step] = self._pool.submit(self._collect, parts, step)
        return synced

    async def _overlapped(self, parts: RunParts, step: int) -> StepRollouts:
        """One overlapping batch: ``rollout_program`` with its mid-batch syncs."""
        syncs = self._mid_batch_syncs, self._mid_batch_sync_s
        return self._with_syncs(parts, await rollout_program(parts, step), syncs)

    def _collect(self, parts: RunParts, step: int) -> tuple[StepRollouts, int]:
        """In the background thread: sync the engine from the published weights if they
        are newer than its own, then collect ``step``'s batch (alone: 1 at once)."""
        synced = self._take_published(parts) or {}
        collected = self._rollout(parts, step)
        collected.row.update(synced)
        return collected, 1

    def _take_published(self, parts: RunParts) -> Row | None:
        """Sync the engine from the published weights if they are newer than its own (the
        sync's metrics), else None. Nothing may be sampling."""
        with self._lock:
            p = self._published
            if p is None or p.version <= parts.backend.policy_version:
                return None
            return sync_engines(parts, p.version, p.model)

    def _publish(self, parts: RunParts) -> None:
        """After an update: the learner's weights, copied for the background thread."""
        with self._lock, torch.no_grad():
            version = self.learner_version(parts)
            if self._published is None:
                self._published = PublishedWeights(copy.deepcopy(parts.learner.model), version)
            else:
                self._published.model.load_state_dict(parts.learner.model.state_dict())
                self._published.version = version

    def _wait(self, parts: RunParts, step: int, *, keep: bool) -> StepRollouts:
        """The batch of ``step``, collected ahead (kept queued with ``keep``)."""
        future = self._queue[step] if keep else self._queue.pop(step)
        r = parts.config.rollout
        rounds = parts.config.algorithm.filter.max_rounds
        deadline = r.episode_timeout_s * rounds + 600 if r.episode_timeout_s else AHEAD_DEADLINE_S
        try:
            collected, at_once = future.result(timeout=deadline)
        except concurrent.futures.TimeoutError as exc:
            raise RolloutAheadError(
                f"the rollout of step {step + 1}, running ahead of the learner, did not "
                f"finish within {deadline:.0f} s"
            ) from exc
        if self.overlap:
            collected.row["rollout/batches_at_once"] = float(at_once)
        return collected

    def _bring_engine(self, parts: RunParts) -> Row:
        """The engine (and the rollout workers) get the learner's weights and version
        (nothing is sampling now); the workers' sync metrics."""
        version = self.learner_version(parts)
        if parts.backend.policy_version != version:
            return sync_engines(parts, version)
        return {}


def add_timings(row: Row, timings: Row) -> None:
    """``timings`` (seconds) added to ``row``'s, where it has them already."""
    for key, seconds in timings.items():
        row[key] = row.get(key, 0.0) + seconds


def stepper(parts: RunParts) -> SynchronousStepper | PipelinedStepper:
    """The step mode ``algorithm.max_staleness`` asks for."""
    algo = parts.config.algorithm
    if algo.max_staleness == 0:
        return SynchronousStepper()
    ahead = PipelinedStepper(
        algo.max_staleness, partial=algo.partial_rollouts, overlap=algo.overlapping
    )
    if algo.partial_rollouts:
        ahead.take_weights_between_turns(parts)
    return ahead
