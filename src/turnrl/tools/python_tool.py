"""A persistent sandboxed Python interpreter per episode, and the tool that runs code in it.

``PythonInterpreter`` keeps one interpreter process alive for an episode inside a
``Sandbox``, so state carries across calls as tool-integrated math wants (``x = 2`` in one
call, ``print(x)`` in the next). Each call returns what the code wrote to stdout and stderr,
interleaved as written, with an exception's traceback and the value of a final expression,
cut to ``max_output_chars`` with a visible marker. A call that runs past ``timeout_s`` is
killed, with everything it started (under bubblewrap or a dedicated uid; the fallback run
without root kills only the process group); an interpreter that dies (a CPU limit, a signal,
``os._exit``) is replaced at the next call, and the model is told its state was lost. Files
in the episode's work dir survive a restart. ``python_tool`` wraps an interpreter as a
``Tool`` for a ``ToolSet``. Close the interpreter at the end of the episode (``close()`` or
``async with``); a forgotten one is killed when garbage-collected or at exit.

Between calls nothing of the episode runs. After each call every other process the code
started is killed (as a forked copy of the interpreter already ends with its cell: like a
script, a call's background work ends with it), and an interpreter left with threads
running is restarted, with a notice. So nothing burns CPU between calls, and nothing can
read, answer or pre-empt the next request.

The process protocol: requests come on the interpreter's stdin (a length line, then JSON);
its stdout and stderr are one pipe, and after a call the driver writes a random marker the
host splits the stream at. Writing the request and waiting for the marker both happen
within the call's ``timeout_s``: an interpreter that stops reading its requests times the
call out, it never blocks it. What a call returns is what the interpreter wrote after its
request was sent and before its marker. The marker is random, made when its call starts
and sent only with it, so no earlier call knows it: with no other process and no thread of
the episode alive between calls, only the code of that call (which can find its own marker)
can end it early. Code of one call can still change what later calls do (that is what a
persistent interpreter is: it can redefine ``print``, or the driver itself), so a call's
output is the episode's own account, never evidence a verifier should trust; verifiers
check files or run their own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import weakref
from dataclasses import dataclass
from typing import Literal

from turnrl.errors import ConfigError
from turnrl.tools.sandbox import Sandbox, SandboxError, SandboxSlot, pids_of_uid
from turnrl.tools.tool import Tool

logger = logging.getLogger(__name__)

CodeStatus = Literal["ok", "timeout", "crashed"]

# Runs inside the sandbox (any Python 3.8+). fd 0 becomes /dev/null (input() gets EOF);
# the requests and the marker use private duplicates of the original pipes.
_DRIVER = r"""
import ast, json, linecache, os, sys, traceback


def _main(ready):
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    pid = os.getpid()
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    os.write(replies, ready.encode())
    cell = 0
    while True:
        header = requests.readline()
        if not header:
            return
        request = json.loads(requests.read(int(header)))
        cell += 1
        _run(request["code"], "<cell %d>" % cell, scope)
        _flush()
        if os.getpid() != pid:  # a fork made by the code ends with its cell, as in a script
            os._exit(0)
        os.write(replies, request["marker"].encode())


def _run(code, name, scope):
    try:
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        tree = ast.parse(code, name, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, name, "exec"), scope)
        if last is not None:
            value = eval(compile(last, name, "eval"), scope)
            if value is not None:
                print(repr(value))
    except BaseException:
        etype, value, tb = sys.exc_info()
        while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell "):
            tb = tb.tb_next  # hide the driver's own frames
        try:
            traceback.print_exception(etype, value, tb)
        except BaseException:
            os.write(2, b"(an exception was raised and could not be printed)\n")


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


_main(sys.argv[1])
"""
_OMITTED_ROOM = 48  # characters kept free for the "[... N characters omitted ...]" line
_NOTICE_ROOM = 400  # a restart notice comes on top of the output limit
_CLEANUP_S = 60.0  # killing a slot's processes and restarting may take this long


def _new_marker() -> str:
    """Ends one call's output; random, so code cannot write the next one in advance."""
    return f"\x1e\x1fturnrl-done-{secrets.token_hex(16)}\x1f"


_MARKER_LEN = len(_new_marker())


class InterpreterReset(Exception):
    """A call that timed out or killed its interpreter: the message tells the model that
    its state is lost. ``python_tool`` raises it, so the call's record is a failure."""


@dataclass(frozen=True)
class CodeResult:
    """The outcome of one call of ``PythonInterpreter.run``."""

    output: str
    """stdout and stderr as written, tracebacks included, cut with a visible marker."""
    status: CodeStatus
    """ok: the code ran to its end (an exception it raised is in ``output``); timeout:
    it ran past ``timeout_s`` and was killed; crashed: the interpreter died during it."""
    notice: str | None = None
    """For the model: why the interpreter was (or will be) restarted and what was lost."""
    truncated: bool = False
    """``output`` was cut to ``max_output_chars``."""

    @property
    def text(self) -> str:
        """The notice (if any), then the output: what the model reads."""
        return self.output if self.notice is None else f"{self.notice}\n{self.output}"


class PythonInterpreter:
    """One episode's persistent Python interpreter inside ``sandbox``.

    ``timeout_s``: wall-clock limit of one call (the sandbox's CPU limit applies to the
    interpreter's whole life). ``max_output_chars``: longer output keeps its beginning and
    end around a marker saying how much was left out. The interpreter starts at the first
    call (a slot's uid and work dir are taken then) and restarts after a timeout or crash.
    ``isolated`` copies the sandbox's flag: False means the rlimit-only fallback.
    Use an interpreter within one event loop.
    """

    def __init__(
        self,
        sandbox: Sandbox,
        *,
        timeout_s: float = 10.0,
        max_output_chars: int = 4000,
        startup_timeout_s: float = 30.0,
    ) -> None:
        if not timeout_s > 0 or not startup_timeout_s > 0:
            raise ConfigError("PythonInterpreter timeouts must be > 0")
        if max_output_chars < 2 * _OMITTED_ROOM:
            raise ConfigError(f"max_output_chars must be >= {2 * _OMITTED_ROOM}")
        self.sandbox = sandbox
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.startup_timeout_s = startup_timeout_s
        self.isolated = sandbox.isolated
        self.num_restarts = 0
        """Interpreters replaced after a timeout or a crash in this episode."""
        self._held = _Held(sandbox)
        self._output: _Output | None = None
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self._interpreter_pid = 0
        """The interpreter's host pid (0: not known, for a shared uid)."""
        self._keep: frozenset[int] = frozenset()
        """Host pids of the interpreter and the sandbox's own processes above it."""
        self._finalizer = weakref.finalize(self, self._held.release_now)

    @property
    def slot(self) -> SandboxSlot | None:
        """The uid and work dir in use (None before the first call and after close)."""
        return self._held.slot

    @property
    def pid(self) -> int | None:
        """The interpreter's host pid, where known (a dedicated uid; None otherwise)."""
        return self._interpreter_pid or None

    async def run(self, code: str) -> CodeResult:
        """Run ``code`` in the interpreter; never raises for anything the code does."""
        async with self._lock:
            if self._closed:
                raise RuntimeError("this PythonInterpreter is closed")
            notice = None
            proc = self._held.proc
            if proc is not None and proc.returncode is not None:  # died between calls
                how = self.sandbox.describe_exit(proc.returncode)
                notice = (
                    f"[Note: the Python interpreter stopped after the last call ({how}) and "
                    "was restarted: variables, imports and definitions from earlier calls "
                    "are lost; files in the work dir are kept.]"
                )
                await self._stop()
                self.num_restarts += 1
            if self._held.proc is None:
                await self._start()
            try:
                outcome = await self._call(code)
            except BaseException:  # cancelled mid-call: the next call must not see this one
                self._held.kill_now()
                raise
            assert self._output is not None
            output, truncated = self._output.result or self._output.take()
            if outcome == "done":
                if await self._quiesce():
                    return CodeResult(output, "ok", notice, truncated)
                await self._stop()
                self.num_restarts += 1
                left = (
                    "[Note: threads the code started were still running when the call "
                    "ended, so the interpreter was restarted: variables, imports and "
                    "definitions from earlier calls are lost; files in the work dir are kept.]"
                )
                return CodeResult(
                    output, "ok", left if notice is None else f"{notice}\n{left}", truncated
                )
            if outcome == "timeout":
                what = f"the code ran past the {self.timeout_s:g} s time limit and was stopped"
            else:
                assert self._held.proc is not None
                assert self._held.proc.returncode is not None
                how = self.sandbox.describe_exit(self._held.proc.returncode)
                what = f"the Python interpreter died: {how}"
            await self._stop()
            self.num_restarts += 1
            notice = (
                f"[{what}. The interpreter restarts at the next call: variables, imports and "
                "definitions from earlier calls are lost; files in the work dir are kept.]"
            )
            return CodeResult(
                output, "timeout" if outcome == "timeout" else "crashed", notice, truncated
            )

    async def close(self) -> None:
        """Kill the interpreter and everything it started; delete the work dir."""
        self._closed = True
        self._held.kill_now()
        async with self._lock:
            await self._stop()
            if self._held.slot is not None:
                slot, self._held.slot = self._held.slot, None
                await asyncio.to_thread(self.sandbox.release, slot)
        self._finalizer.detach()

    async def __aenter__(self) -> PythonInterpreter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _start(self) -> None:
        if self._held.slot is None:
            self._held.slot = await asyncio.to_thread(self.sandbox.acquire)
        slot = self._held.slot
        ready = _new_marker()
        argv = [self.sandbox.python, "-I", "-u", "-c", _DRIVER, ready]
        proc = await asyncio.create_subprocess_exec(
            *self.sandbox.command(slot, argv),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            **self.sandbox.popen_kwargs(slot),
        )
        self._held.proc = proc
        self._output = _Output(self.max_output_chars)
        self._output.expect(ready.encode())
        assert proc.stdout is not None
        self._reader = asyncio.create_task(_pump(proc.stdout, self._output))
        if await self._wait(self.startup_timeout_s) != "done":
            text = self._output.take()[0].strip()
            code = proc.returncode
            await self._stop()
            status = "did not answer" if code is None else self.sandbox.describe_exit(code)
            raise SandboxError(
                f"the sandboxed Python interpreter failed to start ({status}): {text}"
            )
        if slot.dedicated:  # before any code ran: every process of the uid is ours
            found = await asyncio.to_thread(_interpreter_chain, slot.uid, proc.pid, ready)
            self._interpreter_pid, self._keep = found

    async def _quiesce(self) -> bool:
        """After a call: kill every other process of the slot; False if the interpreter
        still runs threads besides its main one (then it must be restarted)."""
        slot = self._held.slot
        if slot is None or not slot.dedicated or not self._interpreter_pid:
            return True
        await asyncio.to_thread(self.sandbox.kill_except, slot, self._keep)
        return _num_threads(self._interpreter_pid) <= 1

    async def _call(self, code: str) -> Literal["done", "exited", "timeout"]:
        proc, output = self._held.proc, self._output
        assert proc is not None
        assert proc.stdin is not None
        assert output is not None
        marker = _new_marker()
        request = json.dumps({"code": code, "marker": marker}).encode()
        output.expect(marker.encode())
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            proc.stdin.write(b"%d\n%s" % (len(request), request))
            # Under the call's limit: an interpreter that stopped reading its requests
            # (code replaced the pipe) would block a large request's write forever.
            await asyncio.wait_for(proc.stdin.drain(), self.timeout_s)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the interpreter is gone: _wait sees it exit
        except asyncio.TimeoutError:
            return "timeout" if proc.returncode is None else "exited"
        left = deadline - asyncio.get_running_loop().time()
        return await self._wait(max(0.0, left))

    async def _wait(self, timeout_s: float) -> Literal["done", "exited", "timeout"]:
        """Until the expected marker arrives, the process exits, or the time is up."""
        proc, output = self._held.proc, self._output
        assert proc is not None
        assert output is not None
        done = asyncio.ensure_future(output.done.wait())
        exited = asyncio.ensure_future(proc.wait())
        try:
            await asyncio.wait(
                {done, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for task in (done, exited):
                task.cancel()
        if output.done.is_set():
            return "done"
        if proc.returncode is None:
            return "timeout"
        with contextlib.suppress(asyncio.TimeoutError):  # what it wrote before dying
            await asyncio.wait_for(output.eof.wait(), 1.0)
        return "done" if output.done.is_set() else "exited"

    async def _stop(self) -> None:
        """Kill the process group and, for a dedicated uid, every process of the uid."""
        proc = self._held.proc
        if proc is None:
            return
        self._held.kill_now()
        slot = self._held.slot
        if slot is not None and slot.dedicated:
            await asyncio.to_thread(self.sandbox.kill_all, slot)
        if proc.stdin is not None:
            proc.stdin.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), 10.0)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        # A process the code left behind (out of the killed group) may still hold the
        # output pipe open: close our end now, not when the transport is collected
        # (asyncio then warns "unclosed transport", which failed a test run at exit).
        transport = getattr(proc, "_transport", None)
        if transport is not None:
            transport.close()
        self._held.proc = None
        self._interpreter_pid, self._keep = 0, frozenset()


def python_tool(interpreter: PythonInterpreter, *, name: str = "python") -> Tool:
    """A tool running code in ``interpreter``: argument ``code``, the output as its result.

    A timeout or a crash is a failed call whose error tells the model its state was lost.
    The interpreter enforces its own time limit; the tool's own, a backstop, adds the
    start-up and clean-up time a call may need on top of it.
    """

    async def run_python(code: str) -> str:
        result = await interpreter.run(code)
        if result.status != "ok":
            raise InterpreterReset(result.text)
        return result.text

    description = (
        "Run Python code in a persistent interpreter and return what it prints (stdout "
        "and stderr; the value of a final expression is shown too). Variables, imports "
        f"and functions persist between calls. Each call may run {interpreter.timeout_s:g} "
        "seconds" + ("; there is no network." if interpreter.isolated else ".")
    )
    run_python.__doc__ = f"{description}\n\nArgs:\n    code: The Python source code to run."
    return Tool.from_function(
        run_python,
        name=name,
        description=description,
        timeout_s=interpreter.timeout_s + interpreter.startup_timeout_s + _CLEANUP_S,
        max_output_chars=interpreter.max_output_chars + _NOTICE_ROOM,
        isolated=interpreter.isolated,
    )


class _Held:
    """What an interpreter holds that must not outlive it: its process and its slot."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.proc: asyncio.subprocess.Process | None = None
        self.slot: SandboxSlot | None = None

    def kill_now(self) -> None:
        """SIGKILL the process group, without waiting. An unreaped child's pid (returncode
        still None) cannot have been reused, so the group is still this process's."""
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def release_now(self) -> None:
        """The safety net for an interpreter never closed (run at garbage collection or exit)."""
        if self.proc is None and self.slot is None:
            return
        logger.warning("a PythonInterpreter was not closed; killing its processes now")
        self.kill_now()
        if self.slot is not None:
            slot, self.slot = self.slot, None
            self.sandbox.release(slot)


class _Output:
    """The interpreter's output stream, split into calls at markers, kept within bounds.

    Bytes go to ``head`` until it is full, then to ``tail``, which keeps only the latest
    bytes; what falls out between them is counted. The last bytes that could begin a
    marker are held back until the next chunk shows whether they do.
    """

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.keep_bytes = 4 * max_chars  # room for max_chars of UTF-8 at each end
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.pending = bytearray()
        self.marker: bytes | None = None
        self.result: tuple[str, bool] | None = None
        self.done = asyncio.Event()
        self.eof = asyncio.Event()

    def expect(self, marker: bytes) -> None:
        """Start a call: its output ends at ``marker`` (output since the last one counts)."""
        self.marker = marker
        self.result = None
        self.done.clear()
        self._scan()

    def feed(self, data: bytes) -> None:
        self.pending += data
        self._scan()

    def take(self) -> tuple[str, bool]:
        """Everything collected so far, cut to ``max_chars``, and whether it was cut."""
        self._add(self.pending)
        self.pending.clear()
        budget = self.max_chars - _OMITTED_ROOM
        keep_head, keep_tail = budget // 2, budget - budget // 2
        if self.dropped == 0:
            text = bytes(self.head + self.tail).decode(errors="replace")
            first, last = text, ""
        else:
            first = self.head.decode(errors="replace")
            last = self.tail.decode(errors="replace")
        self.head, self.tail, dropped, self.dropped = bytearray(), bytearray(), self.dropped, 0
        if dropped == 0 and len(first) <= self.max_chars:
            return first, False
        if dropped == 0:
            first, last = first[:keep_head], first[keep_head:]
        omitted = max(0, len(first) - keep_head) + max(0, len(last) - keep_tail) + dropped
        first, last = first[:keep_head], last[len(last) - min(keep_tail, len(last)) :]
        return f"{first}\n[... {omitted} characters omitted ...]\n{last}", True

    def _scan(self) -> None:
        if self.marker is not None and (i := self.pending.find(self.marker)) >= 0:
            rest = self.pending[i + len(self.marker) :]
            del self.pending[i:]
            self.result = self.take()
            self.pending[:] = rest  # written after the marker: the next call's
            self.marker = None
            self.done.set()
        hold = _MARKER_LEN - 1 if self.marker is not None else 0
        cut = max(0, len(self.pending) - hold)
        self._add(self.pending[:cut])
        del self.pending[:cut]

    def _add(self, data: bytes | bytearray) -> None:
        room = self.keep_bytes - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        if len(self.tail) > self.keep_bytes:
            extra = len(self.tail) - self.keep_bytes
            self.dropped += extra
            del self.tail[:extra]


def _interpreter_chain(uid: int, top: int, token: str) -> tuple[int, frozenset[int]]:
    """The interpreter and it with its ancestors up to ``top``, the process this host
    started ((0, {}) if not found). bubblewrap's processes above it carry the same command
    line (``token`` included): the interpreter is the deepest process that does."""
    needle = token.encode()
    best: tuple[int, frozenset[int]] = (0, frozenset())
    for pid in pids_of_uid(uid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle not in f.read():
                    continue
        except OSError:
            continue
        chain, up = {pid}, pid
        while up != top and up > 1:
            up = _parent(up)
            chain.add(up)
        if up == top and len(chain) > len(best[1]):
            best = (pid, frozenset(chain))
    return best


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _num_threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


async def _pump(stream: asyncio.StreamReader, output: _Output) -> None:
    try:
        while chunk := await stream.read(65536):
            output.feed(chunk)
    finally:
        output.eof.set()
