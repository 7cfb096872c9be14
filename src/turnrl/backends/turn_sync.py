"""New weights taken mid-batch, between turns (``algorithm.partial_rollouts``).

In asynchronous training the engine samples the next batch while the learner updates.
Without partial rollouts the learner's new weights wait for that batch to end. With them
the engine takes them as soon as it can without splitting a turn: it stops admitting
requests, lets the completions it is decoding finish (each is one turn of one episode,
sampled by one version from its first token to its last), calls ``apply``, then admits the
requests that waited. The episodes in flight sample their next turns with the new weights,
and each turn records the version that sampled it (``Completion.policy_version``).

A backend that can do this has a ``turn_sync`` attribute (None: nothing wanted); the
trainer's pipeline sets it for the engine in its process (trainer/pipeline.py), a rollout
worker for its own (distributed/rollout_workers.py). The engine asks ``wanted`` at each
decoding step, so it must be cheap, and calls ``apply`` on its own thread."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TurnSync:
    """What an engine asks between decoding steps while it runs a batch."""

    wanted: Callable[[], bool]
    """True while newer weights are waiting for the engine."""
    apply: Callable[[], None]
    """Load them (and move the engine's ``policy_version`` on); called on the engine's
    thread, when no completion is being decoded."""
