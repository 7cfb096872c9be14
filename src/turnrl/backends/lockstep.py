"""The lockstep barrier of continuous batching: after completions are handed back, the
engine holds its next step until the episodes that got them have reacted.

Counting event-loop turns rather than seconds keeps the moment a follow-up request joins
the running batch the same under any machine load, so runs reproduce to the bit (as long
as tools answer without real waiting). Both samplers use it: ``TorchBackend`` from its
torch thread, ``VLLMBackend`` from its driver task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

LOCKSTEP_TURNS = 64
"""Event-loop turns with nothing new submitted after which the episodes are taken to
have reacted to the completions they received (as ``BatchingClient.patience``)."""


async def until_reacted(
    checks: Sequence[Callable[[], bool]], submissions: Callable[[], int]
) -> None:
    """Return once every ``check`` (a caller's "nothing left to submit") has held, and
    ``submissions()`` has not moved, for ``LOCKSTEP_TURNS`` turns of the event loop."""
    idle, seen = 0, submissions()
    while idle < LOCKSTEP_TURNS:
        await asyncio.sleep(0)
        if submissions() != seen or not all(check() for check in checks):
            idle, seen = 0, submissions()
        else:
            idle += 1
