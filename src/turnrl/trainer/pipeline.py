"""How the loop runs its steps: one after the other, or with the next rollout overlapped.

``Synchronous`` is the reference: each step collects with the learner's current weights,
updates, then syncs the engine (``train_step``). ``Ahead`` is asynchronous training with
``algorithm.max_staleness`` >= 1, one step deep: while step s updates, a background thread
already collects step s + 1 with the weights the learner had before that update (version
s), so the batch trained at step s + 1 is exactly one version stale. The engine holds its
own weights (a copy, for the torch backend) and is synced only between batches, when no
episode is in flight: every turn, and every episode, is sampled by one version, recorded
on the turn (partial rollouts never happen: an episode in flight at an update finishes on
the weights it started with, and its batch waits for the next step). The update weights the
older samples with the behaviour log-probs (``off_policy``, ``token_tis`` by default).

Prompts and seeds belong to the step index (``collect``), not to when a batch was made, so
a run stopped between checkpoints and resumed collects exactly the prompts it would have:
the batch collected ahead and lost is collected again, none skipped, none repeated (what
differs is the weights that sample it, one version newer). Every wait has a deadline.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from typing import TextIO

from turnrl.errors import TurnrlError
from turnrl.trainer.step import (
    Collected,
    Row,
    Trainer,
    rollout_phase,
    sync_engines,
    train_step,
    update_phase,
)

AHEAD_DEADLINE_S = 3600.0
"""How long the loop waits for a batch collected ahead when episodes have no time limit
(``rollout.episode_timeout_s`` = 0); otherwise the episodes' limit per sampling round, plus
ten minutes."""


class RolloutAheadError(TurnrlError):
    """The rollout running ahead of the learner did not finish in time."""


class Synchronous:
    """Collect, update, sync: ``train_step``."""

    def step(self, t: Trainer, step: int, trajectories_out: TextIO) -> Row:
        return train_step(t, step, trajectories_out)

    def learner_version(self, t: Trainer) -> int:
        """The policy version of the learner's weights (what a checkpoint records)."""
        return t.backend.policy_version

    def before_eval(self, t: Trainer) -> None:
        """Nothing: the engine already holds the learner's weights."""

    def close(self) -> None:
        """Nothing runs in the background."""


class Ahead:
    """The next step's rollout in a background thread while this step updates."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "turnrl-rollout-ahead")
        self._ahead: tuple[int, concurrent.futures.Future[Collected]] | None = None
        self._kept: tuple[int, Collected] | None = None
        self._version: int | None = None

    def step(self, t: Trainer, step: int, trajectories_out: TextIO) -> Row:
        started = time.perf_counter()
        version = self.learner_version(t)
        collected = self._batch(t, step)
        waited = time.perf_counter() - started
        synced: Row = {}
        if step + 1 < t.config.steps:  # the next batch, sampled by the weights of now
            synced = self._bring_engine(t)
            self._ahead = (step + 1, self._pool.submit(rollout_phase, t, step + 1))
        row = update_phase(t, step, collected, version, trajectories_out)
        row.update(synced)
        self._version = version + 1
        step_s = time.perf_counter() - started
        row["perf/rollout_s"], row["perf/rollout_wait_s"] = collected.rollout_s, waited
        row["perf/step_s"], row["perf/train_s"] = step_s, step_s - waited
        row["perf/tokens_per_s"] = row.pop("_tokens") / max(step_s, 1e-9)
        return row

    def learner_version(self, t: Trainer) -> int:
        if self._version is None:  # the first step: the engine starts with the learner's
            self._version = t.backend.policy_version
        return self._version

    def before_eval(self, t: Trainer) -> None:
        """Let the batch collected ahead finish (it is kept for its step), then give the
        engine the learner's weights: evaluations measure the learner's policy."""
        if self._ahead is not None:
            index, _ = self._ahead
            self._kept = (index, self._wait(t))
        self._bring_engine(t)

    def close(self) -> None:
        """Wait for a rollout still running ahead (its batch is dropped), stop the thread."""
        if self._ahead is not None:
            _, future = self._ahead
            self._ahead = None
            with contextlib.suppress(Exception):  # the run is over: its batch is not needed
                future.result(timeout=AHEAD_DEADLINE_S)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _batch(self, t: Trainer, step: int) -> Collected:
        if self._kept is not None and self._kept[0] == step:
            collected, self._kept = self._kept[1], None
            return collected
        if self._ahead is not None and self._ahead[0] == step:
            return self._wait(t)
        return rollout_phase(t, step)  # the first step (or the first after a resume)

    def _wait(self, t: Trainer) -> Collected:
        assert self._ahead is not None
        index, future = self._ahead
        self._ahead = None
        r = t.config.rollout
        rounds = t.config.algorithm.filter.max_rounds
        deadline = r.episode_timeout_s * rounds + 600 if r.episode_timeout_s else AHEAD_DEADLINE_S
        try:
            return future.result(timeout=deadline)
        except concurrent.futures.TimeoutError as exc:
            raise RolloutAheadError(
                f"the rollout of step {index + 1}, running ahead of the learner, did not "
                f"finish within {deadline:.0f} s"
            ) from exc

    def _bring_engine(self, t: Trainer) -> Row:
        """The engine (and the rollout workers) get the learner's weights and version
        (nothing is sampling now); the workers' sync metrics."""
        version = self.learner_version(t)
        if t.backend.policy_version != version:
            return sync_engines(t, version)
        return {}


def stepper(t: Trainer) -> Synchronous | Ahead:
    """The step mode ``algorithm.max_staleness`` asks for."""
    return Ahead() if t.config.algorithm.max_staleness > 0 else Synchronous()
