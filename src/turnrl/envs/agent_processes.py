"""Agents in worker processes: the agents' own Python off the policy's process.

An agent written against the ``openai`` SDK spends most of its time in the SDK: building
each request from its messages and parsing each reply (about 1 ms a call here, more than
the endpoint's own work). In the training process that Python shares one interpreter lock
with the sampler, whose decoding loop is Python too, so the two take turns. Wrapped in
``AgentProcesses``, the agent runs in ``processes`` worker processes of its own, each an
event loop with its own client, and reaches the policy endpoint over loopback HTTP as any
remote agent would (the episode id in the base URL is the only coupling; nothing else
changes: token-exactness, rewards, failures).

    agent = AgentProcesses(my_agent, processes=1)   # my_agent(task, client), async or not
    turnrl.train(agent=agent, tasks=..., reward=...)

The agent and its tasks and answers cross a process boundary, so they must pickle: a
function defined at the top level of an importable module (or of a script run as
``__main__``), not a lambda or a closure. Workers are started with ``spawn`` (they import
the agent's module afresh, never a copy of the training process).

Failures stay the episode's: an agent that raises fails its episode with the worker's
traceback (or, when the exception is one of the environment's ``model_errors``, recognised
by the names of its classes, ends it as the model's failure); a worker that dies fails the episodes it was running, naming it and its exit
code, and is started again for the next ones; an episode past its deadline is cancelled in
the worker too.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import multiprocessing as mp
import os
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from turnrl.errors import TurnrlError

START_TIMEOUT_S = 120.0
"""How long a worker may take to import the agent and say it is ready."""


class AgentProcessError(TurnrlError):
    """An agent in a worker process raised, or its worker died.

    ``remote_types``: the qualified names of the classes of the exception the agent raised
    there, most derived first (empty when the worker died), so that a framework's exception
    for the model's mistake is recognised as one (``turnrl.envs.agent.model_error_type``)
    without the exception itself having to pickle.
    """

    def __init__(self, message: str, remote_types: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.remote_types = remote_types


class AgentProcesses:
    """``agent(task, client)`` (async, or sync run in a thread there) run in ``processes``
    worker processes; call it as ``await agent_processes(task, base_url=, api_key=)``,
    which is the form ``turnrl.train(agent=...)`` takes. ``close`` stops the workers (also
    at interpreter exit: they are daemons)."""

    def __init__(self, agent: Callable[..., Any], processes: int = 1) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        if not callable(agent):
            raise TypeError(f"agent must be a function, got {agent!r}")
        self.agent = agent
        self.processes = processes
        self._workers: list[_Worker | None] = [None] * processes
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._next = 0
        try:  # started now, not on the event loop at the first episode
            for k in range(processes):
                self._workers[k] = _Worker(agent, k)
        except BaseException:
            self.close()
            raise

    async def __call__(self, task: Any, *, base_url: str, api_key: str) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        call_id = next(self._ids)
        worker = self._worker()
        worker.pending[call_id] = (loop, future)
        try:
            try:
                worker.send(("run", call_id, task, base_url, api_key))
            except OSError as exc:  # it died since it was chosen
                raise AgentProcessError(f"agent worker {worker.index} is gone: {exc}") from exc
            except Exception as exc:  # e.g. a task that does not pickle
                raise AgentProcessError(
                    f"cannot send the task to agent worker {worker.index} (tasks must "
                    f"pickle): {type(exc).__name__}: {exc}"
                ) from exc
            return await future
        except asyncio.CancelledError:  # the episode's deadline: stop it there too
            with contextlib.suppress(OSError, ValueError):
                worker.send(("cancel", call_id))
            raise
        finally:
            worker.pending.pop(call_id, None)

    def close(self) -> None:
        with self._lock:
            workers, self._workers = self._workers, [None] * self.processes
        for w in workers:
            if w is not None:
                w.stop()

    def __enter__(self) -> AgentProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("AgentProcesses holds running processes and cannot be pickled")

    def _worker(self) -> _Worker:
        """The next worker in turn, started (again) if it is not running."""
        with self._lock:
            k = self._next
            self._next = (k + 1) % self.processes
            w = self._workers[k]
            if w is None or not w.alive():
                w = self._workers[k] = _Worker(self.agent, k)
            return w


class _Worker:
    """One worker process, its pipe and the calls it is running."""

    def __init__(self, agent: Callable[..., Any], index: int) -> None:
        self.index = index
        self.pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        self.conn: Connection = ours
        self.process = ctx.Process(
            target=_serve, args=(agent, theirs, os.getpid()), daemon=True,
            name=f"turnrl-agent-{index}",
        )  # fmt: skip
        try:
            self.process.start()
        except Exception as exc:  # pickling the agent failed
            raise AgentProcessError(
                f"cannot start an agent worker with {getattr(agent, '__qualname__', agent)!r}: "
                f"{type(exc).__name__}: {exc}. The agent must pickle: a function defined at "
                "the top level of an importable module, not a lambda or a nested function"
            ) from exc
        finally:
            theirs.close()
        self._send_lock = threading.Lock()
        if not self.conn.poll(START_TIMEOUT_S):
            self.stop()
            raise AgentProcessError(
                f"agent worker {index} did not start within {START_TIMEOUT_S:.0f} s"
            )
        kind, detail = self.conn.recv()
        if kind != "ready":
            self.stop()
            raise AgentProcessError(f"agent worker {index} failed to start:\n{detail}")
        self._reader = threading.Thread(target=self._read, name=f"turnrl-agent-{index}-reader")
        self._reader.daemon = True
        self._reader.start()

    def alive(self) -> bool:
        return self.process.is_alive()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self.conn.send(message)

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send(("close",))
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        with contextlib.suppress(OSError):
            self.conn.close()

    def _read(self) -> None:
        """Settle each call's future as its result comes back; when the worker is gone,
        fail what it was running."""
        while True:
            try:
                kind, call_id, value = self.conn.recv()
            except (EOFError, OSError):
                break
            self._settle(call_id, kind, value)
        self.process.join(timeout=5)
        code = self.process.exitcode
        for call_id in list(self.pending):
            self._settle(
                call_id, "error",
                f"agent worker {self.index} died (exit code {code}) while running this episode",
            )  # fmt: skip

    def _settle(self, call_id: int, kind: str, value: Any) -> None:
        entry = self.pending.get(call_id)
        if entry is None:  # cancelled meanwhile
            return
        loop, future = entry

        def settle() -> None:
            if future.done():
                return
            if kind == "ok":
                future.set_result(value)
            elif isinstance(value, tuple):  # the agent raised: (traceback, its classes)
                future.set_exception(AgentProcessError(*value))
            else:
                future.set_exception(AgentProcessError(value))

        with contextlib.suppress(RuntimeError):  # that event loop has closed
            loop.call_soon_threadsafe(settle)


# -- the worker process ------------------------------------------------------------------


def _serve(agent: Callable[..., Any], conn: Connection, parent: int) -> None:
    """A worker's main: run the calls that arrive until told to close or the parent goes."""
    with contextlib.suppress(KeyboardInterrupt):  # the parent's Ctrl-C
        asyncio.run(_worker_main(agent, conn, parent))


async def _worker_main(agent: Callable[..., Any], conn: Connection, parent: int) -> None:
    from turnrl.envs.agent import _is_async, _openai, async_openai_client

    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
    client: Any = None
    sync_client: Any = None
    send_lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with send_lock, contextlib.suppress(OSError, ValueError):
            conn.send(message)

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("close",)
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message[0] == "close":
                return

    def watch_parent() -> None:  # an orphaned worker exits
        while True:
            if os.getppid() != parent:
                os._exit(0)
            threading.Event().wait(1.0)

    try:
        is_async = _is_async(agent)
        openai = _openai()
    except BaseException:
        send(("error", traceback.format_exc()))
        return
    send(("ready", None))
    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=watch_parent, daemon=True).start()
    running: dict[int, asyncio.Task[Any]] = {}

    async def run(call_id: int, task: Any, base_url: str, api_key: str) -> None:
        nonlocal client, sync_client
        try:
            if is_async:
                if client is None:
                    client = async_openai_client(base_url, api_key)
                answer = agent(task, client.with_options(base_url=base_url))
                if inspect.isawaitable(answer):
                    answer = await answer
            else:
                if sync_client is None:
                    sync_client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
                view = sync_client.with_options(base_url=base_url)
                answer = await asyncio.to_thread(agent, task, view)
        except asyncio.CancelledError:
            return
        except BaseException as exc:
            classes = tuple(f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__)
            send(("error", call_id, (traceback.format_exc(), classes)))
        else:
            try:
                send(("ok", call_id, answer))
            except Exception:  # an answer that does not pickle
                send(("error", call_id, traceback.format_exc()))
        finally:
            running.pop(call_id, None)

    while True:
        message = await inbox.get()
        if message[0] == "close":
            break
        if message[0] == "cancel":
            job = running.get(message[1])
            if job is not None:
                job.cancel()
            continue
        _, call_id, task, base_url, api_key = message
        running[call_id] = asyncio.create_task(run(call_id, task, base_url, api_key))
    for job in running.values():
        job.cancel()
    if client is not None:
        with contextlib.suppress(Exception):
            await client.close()
