"""``ConcurrentPrograms`` (backends/concurrent_programs.py): programs handed over from several
threads run at the same time as tasks of one program, each settling its own future; a
program's error (or one that cannot be made) is its caller's alone, a cancelled one never
starts, and an engine that fails to start, or whose program ends early, leaves no caller
waiting."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest

from turnrl.backends.concurrent_programs import ConcurrentPrograms, ProgramEnded

WAIT_S = 10.0


@pytest.fixture
def thread() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    pool = concurrent.futures.ThreadPoolExecutor(1, "concurrent-programs-test")
    yield pool
    pool.shutdown(wait=True)


def test_programs_from_two_threads_run_together_each_settling_its_own(
    thread: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """The second program starts while the first waits on it: both run in one engine
    program (one ``run``), 2 at once, each with its own result."""
    runs: list[int] = []

    def run(program: Coroutine[Any, Any, None]) -> None:
        runs.append(1)
        asyncio.run(program)

    programs = ConcurrentPrograms(run, thread)
    second_started = threading.Event()

    async def first() -> str:
        while not second_started.is_set():  # only ends once the other runs beside it
            await asyncio.sleep(0.01)
        return "first"

    async def second() -> str:
        second_started.set()
        return "second"

    a = programs.submit(first)
    with concurrent.futures.ThreadPoolExecutor(1) as caller:  # another thread's program
        b = caller.submit(programs.submit, second).result(timeout=WAIT_S)
    assert a.result(timeout=WAIT_S) == ("first", 2)
    assert b.result(timeout=WAIT_S) == ("second", 2)
    assert runs == [1]
    assert programs.most_at_once == 2


def test_a_program_s_error_is_its_own_and_a_cancelled_one_never_starts(
    thread: concurrent.futures.ThreadPoolExecutor,
) -> None:
    started: list[str] = []
    gate = threading.Event()
    thread.submit(gate.wait, WAIT_S)  # hold the engine's thread: nothing starts yet
    programs = ConcurrentPrograms(asyncio.run, thread)

    async def program(name: str) -> str:
        started.append(name)
        await asyncio.sleep(0.05)
        if name == "bad":
            raise ValueError("a bad batch")
        return name

    bad = programs.submit(lambda: program("bad"))
    dropped = programs.submit(lambda: program("dropped"))
    good = programs.submit(lambda: program("good"))
    assert dropped.cancel()
    gate.set()
    with pytest.raises(ValueError, match="a bad batch"):
        bad.result(timeout=WAIT_S)
    assert good.result(timeout=WAIT_S) == ("good", 2)
    assert sorted(started) == ["bad", "good"]
    later = programs.submit(lambda: program("later"))  # a new engine program
    assert later.result(timeout=WAIT_S) == ("later", 1)


def test_an_engine_program_that_ends_early_fails_every_caller_still_waiting(
    thread: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """The engine stops its program (here: a deadline of its own) while two programs
    run: both callers get ``ProgramEnded``, naming why, instead of waiting forever."""

    def run(program: Coroutine[Any, Any, None]) -> None:
        async def with_deadline() -> None:
            await asyncio.wait_for(program, timeout=0.2)

        asyncio.run(with_deadline())

    programs = ConcurrentPrograms(run, thread)

    async def forever() -> None:
        await asyncio.sleep(3600)

    two_callers_told(programs, forever, "the engine's program ended")


def test_an_engine_that_fails_to_start_fails_the_programs_waiting_for_it(
    thread: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """The engine's ``run`` raises before running anything (an engine that cannot wake):
    the callers get ``ProgramEnded`` naming the failure at once, not at their deadlines."""

    def run(program: Coroutine[Any, Any, None]) -> None:
        program.close()
        raise RuntimeError("the engine could not wake")

    programs = ConcurrentPrograms(run, thread)

    async def program() -> str:
        return "never"

    two_callers_told(programs, program, "the engine could not wake")


def two_callers_told(programs: ConcurrentPrograms, make: Any, why: str) -> None:
    """Two callers hand ``make``'s program over; each gets ``ProgramEnded`` saying ``why``."""
    waiting = [programs.submit(make), programs.submit(make)]
    for future in waiting:
        with pytest.raises(ProgramEnded, match=why):
            future.result(timeout=WAIT_S)


def test_a_program_that_cannot_be_made_fails_its_caller_only(
    thread: concurrent.futures.ThreadPoolExecutor,
) -> None:
    programs = ConcurrentPrograms(asyncio.run, thread)

    def unmade() -> Coroutine[Any, Any, str]:
        raise ValueError("no such batch")

    async def program() -> str:
        return "made"

    bad, good = programs.submit(unmade), programs.submit(program)
    with pytest.raises(ValueError, match="no such batch"):
        bad.result(timeout=WAIT_S)
    assert good.result(timeout=WAIT_S)[0] == "made"
