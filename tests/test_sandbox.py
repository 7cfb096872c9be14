"""The code sandbox: hostile code against bubblewrap (zero escapes) and against the
rlimit-only fallback, whose escapes are strict expected failures (so this file is the
checked record of what the fallback does not stop); then the persistent interpreter.

Safety: hostile code runs only after the sandbox has shown, in the same interpreter, that
it runs as a dedicated non-root uid (which needs this test process to be root). Such a uid
can signal no process but its own, so "kill the parent" and ``kill -9 -1`` cannot reach
pytest, make or anyone else's processes even if the isolation were broken; the fallback's
expected escapes touch only things the test made for the purpose (a loopback server, a
scratch directory, a file it wrote) and are removed afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from turnrl.errors import ConfigError
from turnrl.tools import (
    CodeResult,
    PythonInterpreter,
    Sandbox,
    SandboxLimits,
    SandboxUnavailableError,
    ToolSet,
    python_tool,
)
from turnrl.tools.sandbox import SandboxSlot
from turnrl.types import ToolCall

LIMITS = SandboxLimits(
    max_memory_mb=256,
    max_cpu_s=1,
    max_file_mb=16,
    max_processes=16,
    max_open_files=64,
    max_tmp_mb=16,
)
TIMEOUT_S = 2.0
PROJECT_FILE = Path(__file__).resolve().parents[1] / "pyproject.toml"
ROOT = os.geteuid() == 0

needs_root = pytest.mark.skipif(
    not ROOT,
    reason="hostile code runs only under a dedicated non-root uid, and switching to one "
    "needs root (CI runs as root)",
)


def _world_readable(path: Path) -> bool:
    """Whether any uid can read ``path``: every parent world-searchable, the file readable."""
    parents_ok = all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)
    return parents_ok and bool(path.stat().st_mode & stat.S_IROTH)


def modes(rlimit_escape: str | None = None, *, rlimit_escapes_if: bool = True) -> Any:
    """Run a case on both sandboxes. bwrap must stop it; the fallback too, unless
    ``rlimit_escape`` names the hole (then the case must fail there: strict xfail)."""
    rlimit: Any = "rlimit"
    if rlimit_escape is not None:
        mark = pytest.mark.xfail(rlimit_escapes_if, reason=rlimit_escape, strict=True)
        rlimit = pytest.param("rlimit", marks=mark)
    return pytest.mark.parametrize("mode", ["bwrap", rlimit])


@pytest.fixture(scope="module")
def sandboxes() -> dict[str, Sandbox]:
    found = {"rlimit": Sandbox("rlimit", limits=LIMITS)}
    with contextlib.suppress(SandboxUnavailableError):
        found["bwrap"] = Sandbox("bwrap", limits=LIMITS)
    return found


def skip_without_bwrap(sandboxes: dict[str, Sandbox]) -> None:
    if "bwrap" not in sandboxes:
        try:
            Sandbox("bwrap", limits=LIMITS)
        except SandboxUnavailableError as exc:
            pytest.skip(str(exc))


@pytest.fixture
def sandbox(sandboxes: dict[str, Sandbox], mode: str) -> Sandbox:
    if mode == "bwrap":
        skip_without_bwrap(sandboxes)
    return sandboxes[mode]


@pytest.fixture
def any_sandbox(sandboxes: dict[str, Sandbox]) -> Sandbox:
    """The best sandbox here, for tests of the interpreter rather than of isolation."""
    return sandboxes.get("bwrap", sandboxes["rlimit"])


def pids_of_uid(uid: int) -> list[int]:
    """Live processes of ``uid`` on the host (the test's own scan of /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields["State"].split()[0] != "Z" and int(fields["Uid"].split()[0]) == uid:
            found.append(int(entry.name))
    return found


def cmdlines() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                continue
    return found


@dataclass
class Hostile:
    result: CodeResult
    after: CodeResult
    slot: SandboxSlot


async def checked_slot(interp: PythonInterpreter) -> SandboxSlot:
    """The interpreter's slot, once its code has shown it runs as the slot's dedicated,
    non-root uid: hostile code runs only after this."""
    who = await interp.run("import os\nprint(os.getuid(), os.geteuid(), os.getgid())")
    slot = interp.slot
    assert slot is not None
    assert slot.dedicated
    assert slot.uid not in (0, os.getuid())
    assert who.output.split() == [str(slot.uid)] * 3, "refusing to run hostile code"
    return slot


def hostile(
    sandbox: Sandbox,
    code: str,
    *,
    timeout_s: float = TIMEOUT_S,
    inspect: Callable[[SandboxSlot], None] | None = None,
) -> Hostile:
    """Run ``code`` after checking the uid, then a harmless call, then close; check that
    nothing of the slot's uid survives and its work dir is gone."""

    async def go() -> Hostile:
        interp = PythonInterpreter(sandbox, timeout_s=timeout_s, max_output_chars=2000)
        try:
            slot = await checked_slot(interp)
            result = await interp.run(code)
            if inspect is not None:
                inspect(slot)
            after = await interp.run("print('alive')")
        finally:
            await interp.close()
        return Hostile(result, after, slot)

    outcome = asyncio.run(go())
    assert pids_of_uid(outcome.slot.uid) == []
    assert not outcome.slot.workdir.exists()
    assert outcome.after.status == "ok"
    assert outcome.after.output.endswith("alive\n")
    return outcome


# --- hostile code ---------------------------------------------------------------------


@needs_root
@modes()
def test_memory_bomb_fails_at_the_address_space_limit(sandbox: Sandbox) -> None:
    code = (
        "blocks = []\n"
        "try:\n"
        "    while True:\n"
        "        blocks.append(bytearray(16 * 2**20))\n"
        "except MemoryError:\n"
        "    print('MemoryError after', 16 * len(blocks), 'MB')\n"
    )
    out = hostile(sandbox, code).result
    assert out.status == "ok"
    assert "MemoryError after" in out.output
    assert int(out.output.split()[2]) <= LIMITS.max_memory_mb


@needs_root
@modes()
def test_cpu_loop_is_killed_by_the_cpu_limit(sandbox: Sandbox) -> None:
    start = time.monotonic()
    # A generous wall limit: the CPU limit (1 s) must be what ends it, on a busy machine too.
    out = hostile(sandbox, "while True:\n    pass\n", timeout_s=8.0).result
    assert out.status == "crashed"
    assert "CPU time limit" in out.text
    assert time.monotonic() - start < 8.0


@needs_root
@modes()
def test_sleep_forever_times_out_and_the_state_is_lost(sandbox: Sandbox) -> None:
    async def go() -> list[CodeResult]:
        async with PythonInterpreter(sandbox, timeout_s=1.0) as interp:
            return [
                await interp.run("x = 1"),
                await interp.run("import time\ntime.sleep(10**6)"),
                await interp.run("x"),
            ]

    start = time.monotonic()
    _, slept, after = asyncio.run(go())
    assert time.monotonic() - start < 4.0
    assert slept.status == "timeout"
    assert "the 1 s time limit" in slept.text
    assert "variables, imports and definitions from earlier calls are lost" in slept.text
    assert "NameError" in after.output


@needs_root
@modes()
def test_fork_bomb_stops_at_the_process_limit(sandbox: Sandbox) -> None:
    peak = 0

    async def go() -> CodeResult:
        nonlocal peak
        async with PythonInterpreter(sandbox, timeout_s=TIMEOUT_S) as interp:
            uid = (await checked_slot(interp)).uid
            bomb = "import os, time\ntry:\n    while True:\n        os.fork()\nexcept OSError:\n    time.sleep(0.3)\n    print('refused')\n"
            call = asyncio.ensure_future(interp.run(bomb))
            while not call.done():  # count the uid's processes while everyone waits at the peak
                peak = max(peak, len(pids_of_uid(uid)))
                await asyncio.sleep(0.05)
            result = await call
        assert pids_of_uid(uid) == []
        return result

    out = asyncio.run(go())
    assert "refused" in out.output
    # The interpreter and its forks, plus bubblewrap's own process outside the namespace.
    assert 2 <= peak <= LIMITS.max_processes + 1


@needs_root
@modes()
def test_one_gigabyte_file_stops_at_the_file_size_limit(sandbox: Sandbox) -> None:
    sizes: list[int] = []
    code = (
        "chunk = b'\\0' * 2**20\n"
        "with open('big.bin', 'wb') as f:\n"
        "    for _ in range(1024):\n"
        "        f.write(chunk)\n"
    )
    out = hostile(
        sandbox, code, inspect=lambda slot: sizes.append((slot.workdir / "big.bin").stat().st_size)
    ).result
    assert "File too large" in out.output
    assert sizes[0] <= LIMITS.max_file_mb * 2**20


@needs_root
@modes("the fallback writes to the host's /tmp and /dev/shm, bounded only by disk and memory")
def test_in_memory_filesystems_are_bounded(sandbox: Sandbox) -> None:
    name = f"turnrl-fill-{secrets.token_hex(8)}"
    dirs = ["/tmp", "/dev/shm", "/", "/dev"]
    code = (
        "import os\n"
        "chunk = b'\\0' * 2**20\n"
        f"for top in {dirs!r}:\n"
        "    written = 0\n"
        "    try:\n"
        f"        os.mkdir(os.path.join(top, {name!r}))\n"
        "        for i in range(3 * 16):  # three times the limit: a harmless escape\n"
        f"            with open(os.path.join(top, {name!r}, str(i)), 'wb') as f:\n"
        "                f.write(chunk)\n"
        "            written += 1\n"
        "    except OSError as exc:\n"
        "        print(top, type(exc).__name__)\n"
        "    print(top, written, 'MB')\n"
    )
    try:
        out = hostile(sandbox, code).result
        written = {
            line.split()[0]: int(line.split()[1])
            for line in out.output.splitlines()
            if line.endswith(" MB")
        }
        assert written["/"] == written["/dev"] == 0
        assert written["/tmp"] <= LIMITS.max_tmp_mb
        assert written["/dev/shm"] <= LIMITS.max_tmp_mb
    finally:
        for top in ("/tmp", "/dev/shm"):
            shutil.rmtree(Path(top) / name, ignore_errors=True)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A world-writable directory in the host's temp dir (like /tmp itself)."""
    path = Path(tempfile.mkdtemp(prefix="turnrl-test-scratch-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@needs_root
@modes("the fallback has no private /tmp: code writes any world-writable host directory")
def test_writes_outside_the_work_dir_do_not_reach_the_host(sandbox: Sandbox, scratch: Path) -> None:
    name = f"turnrl-escape-{secrets.token_hex(8)}"
    targets = [
        scratch / name,
        Path(tempfile.gettempdir()) / name,
        PROJECT_FILE.parent / name,
        Path("/etc") / name,
        Path("/usr") / name,
    ]
    code = (
        f"for path in {[str(t) for t in targets]!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('escaped')\n"
        "        print('wrote', path)\n"
        "    except OSError as exc:\n"
        "        print('refused', path, type(exc).__name__)\n"
    )
    try:
        out = hostile(sandbox, code).result
        assert [t for t in targets if t.exists()] == []  # on the host
        assert f"refused {scratch / name}" in out.output
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


@needs_root
@modes(
    "the fallback reads every world-readable file, the project tree included",
    rlimit_escapes_if=_world_readable(PROJECT_FILE),
)
def test_the_project_tree_is_not_readable(sandbox: Sandbox) -> None:
    secret = PROJECT_FILE.read_text()[:40]
    code = f"print(open({str(PROJECT_FILE)!r}).read())"
    out = hostile(sandbox, code).result
    assert secret not in out.output
    assert "Error" in out.output


@needs_root
@modes()
def test_etc_shadow_is_not_readable(sandbox: Sandbox) -> None:
    out = hostile(sandbox, "print(open('/etc/shadow').read())").result
    assert "root:" not in out.output
    assert "PermissionError" in out.output or "FileNotFoundError" in out.output


@needs_root
@modes()
def test_the_parent_environment_is_not_visible(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = secrets.token_hex(16)
    monkeypatch.setenv("TURNRL_TEST_SECRET", token)
    code = (
        "import os\n"
        "print(dict(os.environ))\n"
        "for pid in sorted({os.getppid(), 1, *[int(p) for p in os.listdir('/proc') if p.isdigit()]}):\n"
        "    try:\n"
        "        print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as exc:\n"
        "        print(pid, type(exc).__name__)\n"
    )
    out = hostile(sandbox, code).result
    assert out.status == "ok"
    assert token not in out.output
    assert "TURNRL_TEST_SECRET" not in out.output


@needs_root
@modes("the fallback shares the host's network: code reaches services on localhost")
def test_a_loopback_server_sees_no_connection(sandbox: Sandbox) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n"
            "    print('connected')\n"
            "except OSError as exc:\n"
            "    print('refused', type(exc).__name__)\n"
        )
        out = hostile(sandbox, code).result
        server.settimeout(0.2)  # a completed handshake waits in the accept queue
        try:
            connection, _ = server.accept()
        except TimeoutError:
            connected = False
        else:
            connection.close()
            connected = True
    assert not connected
    assert "refused" in out.output


@needs_root
@modes()
def test_killing_the_parent_and_everything_harms_no_host_process(sandbox: Sandbox) -> None:
    victim = subprocess.Popen(["sleep", "60"])  # a sacrificial host process (root's)
    try:
        code = (
            "import os, signal\n"
            f"for pid in ({victim.pid}, os.getppid()):\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "        print('killed', pid)\n"
            "    except OSError as exc:\n"
            "        print('refused', pid, type(exc).__name__)\n"
            "try:\n"
            "    os.kill(-1, signal.SIGKILL)\n"
            "except OSError as exc:\n"
            "    print('kill -1:', type(exc).__name__)\n"
        )
        out = hostile(sandbox, code).result  # then checks the interpreter still answers
        assert victim.poll() is None
        assert f"refused {victim.pid}" in out.output
        # The parent is pytest for the fallback (refused: another uid). Inside bubblewrap
        # it is the namespace's init, which the kernel shields from its own namespace's
        # SIGKILL: "killed 1" is reported, and nothing dies.
        assert f"refused {os.getpid()}" in out.output or "killed 1\n" in out.output
    finally:
        victim.kill()
        victim.wait()


@needs_root
@modes()
def test_background_children_do_not_survive_their_call(sandbox: Sandbox) -> None:
    tag = str(900 + secrets.randbelow(99))
    code = (
        "import os, subprocess, time\n"
        f"subprocess.Popen(['sleep', '{tag}'], start_new_session=True)\n"
        "if os.fork() == 0:  # a double-forked daemon in its own session\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(1000)\n"
        "    os._exit(0)\n"
        "time.sleep(0.2)\n"
        "print('spawned', len(os.listdir('/proc')))\n"
    )
    seen: list[int] = []
    sleeping: list[bool] = []

    def count(slot: SandboxSlot) -> None:
        seen.append(len(pids_of_uid(slot.uid)))
        sleeping.append(any(c.strip() == f"sleep {tag}" for c in cmdlines()))

    # A long timeout: on a loaded machine the code's start can take seconds.
    outcome = hostile(sandbox, code, timeout_s=30.0, inspect=count)  # and: nothing survives
    assert (outcome.result.status, outcome.result.notice) == ("ok", None)
    assert outcome.result.output.startswith("spawned")
    # Killed when the call ended: only the interpreter (under bubblewrap: and bubblewrap's
    # two processes above it) is left between calls.
    assert sleeping == [False]
    assert seen == [3 if sandbox.mode == "bwrap" else 1]
    assert not any(c.strip() == f"sleep {tag}" for c in cmdlines())


# --- the sandbox object ---------------------------------------------------------------


def test_missing_bwrap_raises_in_bwrap_mode_and_falls_back_loudly_in_auto(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(SandboxUnavailableError, match="bwrap is not installed"):
        Sandbox("bwrap")
    with caplog.at_level(logging.WARNING, logger="turnrl.tools.sandbox"):
        fallback = Sandbox("auto")
    assert fallback.mode == "rlimit"
    assert not fallback.isolated
    assert fallback.fallback_reason == "bwrap is not installed"
    assert "does NOT isolate" in caplog.text
    with pytest.raises(ConfigError):
        Sandbox("docker")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        SandboxLimits(max_memory_mb=0)


def test_bwrap_sandbox_is_flagged_isolated(sandboxes: dict[str, Sandbox]) -> None:
    skip_without_bwrap(sandboxes)
    assert sandboxes["bwrap"].isolated
    assert sandboxes["bwrap"].fallback_reason is None
    assert not sandboxes["rlimit"].isolated


# --- the persistent interpreter -------------------------------------------------------


def test_state_persists_across_calls(any_sandbox: Sandbox) -> None:
    async def go() -> list[CodeResult]:
        async with PythonInterpreter(any_sandbox, timeout_s=5) as interp:
            return [
                await interp.run(code)
                for code in (
                    "x = 2",
                    "print(x)",
                    "def square(n):\n    return n * n\n",
                    "import math\nsquare(x) + math.floor(0.5)",
                    "square(None)",
                    "print('out'); import sys; print('err', file=sys.stderr)",
                    "open('notes.txt', 'w').write('kept')",
                    "open('notes.txt').read()",
                )
            ]

    results = asyncio.run(go())
    assert [r.status for r in results] == ["ok"] * len(results)
    assert results[0].output == ""
    assert results[1].output == "2\n"
    assert results[3].output == "4\n"  # the value of a final expression is shown
    assert 'File "<cell 3>", line 2, in square' in results[4].output
    assert results[4].output.endswith(
        "TypeError: unsupported operand type(s) for *: 'NoneType' and 'NoneType'\n"
    )
    assert results[5].output == "out\nerr\n"
    assert results[7].output == "'kept'\n"


def test_a_crash_restarts_with_a_notice(any_sandbox: Sandbox) -> None:
    async def go() -> list[CodeResult]:
        async with PythonInterpreter(any_sandbox, timeout_s=5) as interp:
            crashed = await interp.run("x = 1\nimport os\nos._exit(7)")
            later = await interp.run(  # SIGALRM's default action ends the process
                "import signal\nsignal.setitimer(signal.ITIMER_REAL, 0.05)"
            )
            await asyncio.sleep(0.3)  # it dies between calls
            again = await interp.run("print('x' in globals())")
            assert interp.num_restarts == 2
            return [crashed, later, again]

    crashed, later, again = asyncio.run(go())
    assert crashed.status == "crashed"
    assert "exited with status 7" in crashed.text
    assert later.status == "ok"
    assert again.status == "ok"
    assert again.notice is not None
    assert "stopped after the last call" in again.notice
    assert again.output == "False\n"


def test_output_is_truncated_with_a_visible_marker(any_sandbox: Sandbox) -> None:
    async def go() -> list[CodeResult]:
        async with PythonInterpreter(any_sandbox, max_output_chars=200) as interp:
            return [
                await interp.run("print('a' * 100 + 'b' * 1000 + 'c' * 100)"),
                await interp.run("for _ in range(50_000):\n    print('y' * 99)\nprint('end')"),
                await interp.run("print('short')"),
            ]

    cut, flood, short = asyncio.run(go())
    assert cut.truncated
    assert len(cut.output) <= 200
    # 200 characters, less room for the marker line, split between the two ends.
    assert cut.output.startswith("a" * 76 + "\n[... 1049 characters omitted ...]\n")
    assert cut.output.endswith("\n" + "c" * 75 + "\n")  # 76 + 1049 + 76 = 1201
    assert flood.truncated
    assert len(flood.output) <= 200
    assert flood.output.endswith("end\n")  # the end is kept: where tracebacks are
    assert "[... 49" in flood.output
    assert short.output == "short\n"
    assert not short.truncated


def test_a_call_does_not_block_the_event_loop(any_sandbox: Sandbox) -> None:
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    async def go() -> CodeResult:
        async with PythonInterpreter(any_sandbox) as interp:
            await interp.run("pass")
            ticker = asyncio.ensure_future(tick())
            result = await interp.run("import time\ntime.sleep(0.3)\nprint('slept')")
            ticker.cancel()
            return result

    assert asyncio.run(go()).output == "slept\n"
    assert ticks >= 5  # 15 if the loop were never blocked


@needs_root
def test_concurrent_episodes_get_their_own_uid_and_work_dir(any_sandbox: Sandbox) -> None:
    async def go() -> list[tuple[str, SandboxSlot, Path]]:
        a = PythonInterpreter(any_sandbox)
        b = PythonInterpreter(any_sandbox)
        try:
            code = "import os, time\nopen('mine', 'w').write(str(os.getuid()))\ntime.sleep(0.3)\nsorted(os.listdir('.')), os.getuid()"
            results = await asyncio.gather(a.run(code), b.run(code))
            assert a.slot is not None
            assert b.slot is not None
            return [
                (r.output, slot, slot.workdir)
                for r, slot in zip(results, (a.slot, b.slot), strict=True)
            ]
        finally:
            await asyncio.gather(a.close(), b.close())

    (out_a, slot_a, dir_a), (out_b, slot_b, dir_b) = asyncio.run(go())
    assert slot_a.uid != slot_b.uid
    assert dir_a != dir_b
    assert out_a == f"(['mine'], {slot_a.uid})\n"
    assert out_b == f"(['mine'], {slot_b.uid})\n"
    assert not dir_a.exists()
    assert not dir_b.exists()


def test_python_tool_in_a_toolset(any_sandbox: Sandbox) -> None:
    async def go() -> list[Any]:
        async with PythonInterpreter(any_sandbox, timeout_s=0.5) as interp:
            tools = ToolSet([python_tool(interp)])
            return [
                await tools.run(ToolCall("python", {"code": "y = 6 * 7"})),
                await tools.run(ToolCall("python", {"code": "print(y)"})),
                await tools.run(ToolCall("python", {"code": "import time\ntime.sleep(60)"})),
                await tools.run(ToolCall("python", {"code": 42})),
            ]

    (_, first), (ok, ok_record), (slow, slow_record), (bad, _) = asyncio.run(go())
    assert first.ok
    assert ok.content == "42\n"
    assert ok_record.ok
    assert not slow.ok
    assert not slow_record.ok
    assert slow.error is not None
    assert "time limit" in slow.error
    assert "lost" in slow.error
    assert not bad.ok
    assert "must be a string" in (bad.error or "")
    schema = python_tool(PythonInterpreter(any_sandbox)).schema()["function"]
    assert schema["name"] == "python"
    assert schema["parameters"]["required"] == ["code"]


def test_an_unclosed_interpreter_is_killed_when_collected(
    any_sandbox: Sandbox, caplog: pytest.LogCaptureFixture
) -> None:
    async def go() -> SandboxSlot:
        interp = PythonInterpreter(any_sandbox)
        await interp.run("pass")
        assert interp.slot is not None
        return interp.slot

    with caplog.at_level(logging.WARNING, logger="turnrl.tools.python_tool"):
        slot = asyncio.run(go())
        gc.collect()
    assert "was not closed" in caplog.text
    assert not slot.workdir.exists()
    if slot.dedicated:
        assert pids_of_uid(slot.uid) == []


def test_run_after_close_raises(any_sandbox: Sandbox) -> None:
    async def go() -> None:
        interp = PythonInterpreter(any_sandbox)
        await interp.close()
        await interp.close()  # twice is fine
        with pytest.raises(RuntimeError, match="closed"):
            await interp.run("pass")

    asyncio.run(go())
