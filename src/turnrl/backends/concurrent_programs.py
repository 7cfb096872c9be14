"""Several callers' programs, run at the same time on one engine (overlapping batches).

An engine runs one asyncio program at a time (``Backend.run``), and its continuous
batching serves every episode of that program together. ``ConcurrentPrograms`` takes programs
from callers on any thread and runs all those it has as tasks of one program on the engine, so
the episodes of a batch that starts fill the engine beside the slowest episodes of the
batch before it, instead of waiting for them. A program handed over while others run
starts at once, beside them; one handed over when none runs starts a new engine program.

``algorithm.overlap_batches`` uses it twice: for the engine in the trainer's process
(trainer/pipeline.py) and on each rollout worker, whose batches arrive as calls of their
own (distributed/rollout_workers.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from turnrl.errors import TurnrlError

T = TypeVar("T")

POLL_S = 0.01
"""How often the running program looks for a program newly handed over."""


class ProgramEnded(TurnrlError):
    """The engine program running several callers' programs ended before one of them did."""


class ConcurrentPrograms:
    """Programs handed over from any thread (``submit``), run together on an engine.

    ``run`` runs one program to completion on the engine: its ``run``, or ``asyncio.run``
    where the program only waits on others. ``executor`` must have one thread, which runs it:
    the engine's thread from then on (its torch thread count is the caller's to set)."""

    def __init__(
        self,
        run: Callable[[Coroutine[Any, Any, None]], None],
        executor: concurrent.futures.ThreadPoolExecutor,
    ) -> None:
        self._run = run
        self._executor = executor
        self._orders: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._orders = queue.SimpleQueue()
        self.most_at_once = 0
        """The most programs that have run at once so far."""

    def submit(
        self, make: Callable[[], Coroutine[Any, Any, T]]
    ) -> concurrent.futures.Future[tuple[T, int]]:
        """Run ``make()``'s program beside those running: a future of its result and the
        most programs that ran at once while it ran. A future cancelled before its program
        starts drops it; a program that raises sets its own future's error only."""
        future: concurrent.futures.Future[tuple[T, int]] = concurrent.futures.Future()
        self._orders.put((make, future))
        self._executor.submit(self._serve)  # finds it, or a program running did first
        return future

    def _serve(self) -> None:
        if self._orders.empty():
            return
        try:
            self._run(self._feed())
        except BaseException as exc:  # the engine failed: what waits would never start
            while not self._orders.empty():
                _, future = self._orders.get()
                if future.set_running_or_notify_cancel():
                    future.set_exception(ProgramEnded(f"the engine failed: {exc!r}"))

    async def _feed(self) -> None:
        """Start every program handed over as it comes, as a task of this event loop, and
        settle its future when it ends; return when none runs and none waits."""
        running: dict[asyncio.Task[Any], concurrent.futures.Future[Any]] = {}
        at_once: dict[asyncio.Task[Any], int] = {}
        try:
            while True:
                while not self._orders.empty():
                    make, future = self._orders.get()
                    if not future.set_running_or_notify_cancel():  # cancelled: dropped
                        continue
                    try:
                        running[asyncio.ensure_future(make())] = future
                    except Exception as exc:  # no program to run: its caller's error
                        future.set_exception(exc)
                        continue
                    at_once = {x: max(at_once.get(x, 0), len(running)) for x in running}
                    self.most_at_once = max(self.most_at_once, len(running))
                if not running:
                    return
                done, _ = await asyncio.wait(
                    running, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    future, most = running.pop(task), at_once.pop(task)
                    try:
                        result = task.result()
                    except BaseException as exc:  # the program's own error, for its caller
                        future.set_exception(exc)
                        continue
                    future.set_result((result, most))
        except BaseException as exc:  # no caller may wait on a program that is gone
            for future in running.values():
                future.set_exception(ProgramEnded(f"the engine's program ended: {exc!r}"))
            raise
