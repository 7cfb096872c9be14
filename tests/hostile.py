"""The hostile suite: attacks on the sandbox by class, each run for real and judged.

What lives here: ``ATTACKS`` (each a few calls of code an episode could send, and what
"contained" means for it) and ``run_attack``, which runs one through a ``PythonInterpreter``
and returns ``contained``, ``escaped`` or ``not enforceable`` (it escaped, and this machine
lacks the mechanism that stops it: no control groups, say). tests/test_sandbox_hostile.py
runs every attack (as root) and judges it. Test code only: the isolation itself is
``turnrl.tools.sandbox``.

Safety: the attack code runs only after the interpreter has shown it runs as the slot's
dedicated non-root uid (which needs root here); otherwise ``run_attack`` refuses.
After every attack: no process of the slot's uid may be left, its work dir must be gone and
its uid free again, whatever the attack did.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from turnrl.tools.python_tool import CodeResult, PythonInterpreter
from turnrl.tools.sandbox import Sandbox, SandboxSlot, pids_of_uid

Verdict = Literal["contained", "escaped", "not enforceable", "not run"]

# The pipe the interpreter's requests come on: the fd > 2 that is a pipe but not stdout's.
_REQUEST_FD = """
import os
_out = os.readlink('/proc/self/fd/1')
def _links():
    for name in os.listdir('/proc/self/fd'):
        try:
            yield int(name), os.readlink('/proc/self/fd/' + name)
        except OSError:
            pass
request_fd = next(fd for fd, link in _links() if fd > 2 and link.startswith('pipe:') and link != _out)
"""
# Point the driver's request fd at a pipe nobody writes: the driver waits there for ever.
_SILENCE = "_r, _w = os.pipe()\nos.dup2(_r, request_fd)\n"
_FORGE = """
import json
def forge(fd):
    f = os.fdopen(fd, 'rb')
    request = json.loads(f.read(int(f.readline())))
    os.write(1, b'FORGED\\n' + request['marker'].encode())
"""
_LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
_SYSCALL = (
    _LIBC + "def sc(*a):\n    r = libc.syscall(*a)\n    return r, ctypes.get_errno()\n"
    "import platform\nX86 = platform.machine() == 'x86_64'\n"
)


@dataclass(frozen=True)
class Calls:
    """What one attack did: each call's result and wall time, and what was seen between."""

    results: list[CodeResult]
    seconds: list[float]
    between: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Attack:
    """One class of attack: the calls it makes and the test of containment."""

    name: str
    what: str
    calls: tuple[str, ...]
    contained: Callable[[Calls, Sandbox], tuple[bool, str]]
    """(contained?, what was seen) from the calls."""
    needs: str | None = None
    """The mechanism that stops it ("cgroup", "workspace", "seccomp"), if a machine may lack it."""
    timeout_s: float = 5.0
    between: Callable[[SandboxSlot, int], dict[str, float]] | None = None
    """Looked at from the host after the first call (slot, interpreter pid)."""


@dataclass(frozen=True)
class Outcome:
    """The verdict on one attack, in words and as numbers."""

    attack: str
    verdict: Verdict
    detail: str
    seconds: float


def _numbers(text: str, word: str) -> list[int]:
    return [int(n) for n in re.findall(rf"{word} (\d+)", text)]


def _held_within_slot(calls: Calls, sandbox: Sandbox) -> tuple[bool, str]:
    text = "".join(r.output for r in calls.results[:1])
    held = max(_numbers(text, "held"), default=0)
    limit = sandbox.limits.max_slot_memory_mb
    return held <= limit, f"held {held} MB at most (slot limit {limit} MB)"


def _refused(calls: Calls, sandbox: Sandbox) -> tuple[bool, str]:
    text = calls.results[0].output
    allowed = re.findall(r"ALLOWED (\S+)", text)
    refused = re.findall(r"refused (\S+)", text)
    if allowed or not refused:
        return False, f"allowed: {', '.join(allowed) or '-'}; output {text[-300:]!r}"
    return True, f"refused: {', '.join(refused)}"


def _idle_between(calls: Calls, sandbox: Sandbox) -> tuple[bool, str]:
    cpu = calls.between.get("cpu_s", -1.0)
    others = int(calls.between.get("other_processes", -1))
    window = calls.between.get("window_s", 0.0)
    ok = 0 <= cpu < 0.05 and others == 0
    return ok, f"{cpu:.2f} CPU s used in {window:.1f} s between calls, {others} other processes"


def ticks_used(before: dict[int, int], after: dict[int, int]) -> int:
    """CPU ticks used between two readings (pid: ticks) by the processes alive at the
    second: a process that exited in between is not counted, one that started is counted
    whole."""
    return sum(ticks - before.get(pid, 0) for pid, ticks in after.items())


def _cpu_between(slot: SandboxSlot, interpreter: int) -> dict[str, float]:
    """CPU seconds the slot's processes use over half a second after a call: for each
    process alive at the end, its CPU time then less its CPU time at the start (all of it
    if it started since). Per process, since a process that exits in between takes its
    ticks with it: a sum over all processes at each end then reads as negative use (seen
    when the sandbox reaped the burner's last worker inside the window)."""

    def cpu() -> dict[int, int]:
        ticks = {}
        for pid in pids_of_uid(slot.uid):
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime
            except (OSError, ValueError, IndexError):
                continue
        return ticks

    before, t0 = cpu(), time.perf_counter()
    time.sleep(0.5)
    after, window = cpu(), time.perf_counter() - t0
    used = ticks_used(before, after) / os.sysconf("SC_CLK_TCK")
    others = [p for p in pids_of_uid(slot.uid) if p != interpreter]
    # bubblewrap's own two processes above the interpreter are not the code's.
    extra = max(0, len(others) - (2 if len(others) >= 2 else 0))
    return {"cpu_s": used, "window_s": window, "other_processes": float(extra)}


def _forged(calls: Calls, sandbox: Sandbox) -> tuple[bool, str]:
    second = calls.results[1]
    # A call that times out (the forger silenced the interpreter and was killed) is not forged.
    ok = "FORGED" not in second.output
    return ok, f"the next call returned {second.output.strip()[:80]!r} ({second.status})"


def _hang(calls: Calls, sandbox: Sandbox) -> tuple[bool, str]:
    second, third = calls.results[1], calls.results[2]
    took = calls.seconds[1]
    ok = second.status == "timeout" and took < 5.0 + 3.0 and third.status == "ok"
    return (
        ok,
        f"the later call ended as {second.status!r} after {took:.1f} s; the next: {third.status}",
    )


def _disk(calls: Calls, sandbox: Sandbox) -> tuple[bool, str]:
    text = calls.results[0].output
    wrote = max(_numbers(text, "wrote"), default=0)
    limit = sandbox.limits.max_workspace_mb
    stop = re.search(r"stopped: (.*)", text)
    return wrote <= limit, f"wrote {wrote} MB (work dir limit {limit} MB); " + (
        stop.group(1) if stop else "not stopped"
    )


def _deep(calls: Calls, sandbox: Sandbox) -> tuple[bool, str]:
    depth = max(_numbers(calls.results[0].output, "depth"), default=0)
    return depth > 0, f"made a tree {depth} levels deep; cleaned up (checked after close)"


ATTACKS: tuple[Attack, ...] = (
    Attack(
        "hang on a later call",
        "the first call points the interpreter's request pipe at a silent one; the second "
        "sends 300 KB of code, more than a pipe holds",
        (
            _REQUEST_FD + _SILENCE + "print('silenced', request_fd)",
            "x = 1\n#" + "a" * 300_000 + "\nprint('ran')",
            "print('alive')",
        ),
        _hang,
        timeout_s=5.0,
    ),
    Attack(
        "memory across many processes",
        "8 processes hold 100 MB each at once (each under the per-process limit); the "
        "figure is the private memory the live ones hold together, read from /proc (a "
        "process being killed is not counted for the memory it no longer has)",
        (
            "import os, time\nr, w = os.pipe()\nkids = []\n"
            "def private_mb(pid):\n"
            "    keys = ('Private_Clean:', 'Private_Dirty:', 'Swap:')\n"
            "    try:\n"
            "        with open(f'/proc/{pid}/smaps_rollup') as f:\n"
            "            return sum(int(x.split()[1]) for x in f if x.startswith(keys)) / 1024\n"
            "    except ProcessLookupError:\n"
            "        return 0\n"
            "    except OSError:\n"
            "        return 100\n"
            "for i in range(8):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        b = bytearray(b'\\x01') * (100 * 2**20)\n"
            "        os.write(w, b'x')\n"
            "        time.sleep(30)\n"
            "        os._exit(0)\n"
            "    kids.append(pid)\n"
            "    os.read(r, 1)\n"
            "    time.sleep(0.05)\n"
            "    kids = [k for k in kids if os.waitpid(k, os.WNOHANG) == (0, 0)]\n"
            "    print('held', round(sum(private_mb(k) for k in kids)), flush=True)\n",
        ),
        _held_within_slot,
        needs="cgroup",
        timeout_s=20.0,
    ),
    Attack(
        "shared memory and memfd",
        "in-memory files (memfd, 15 MB each, under the file size limit) and /dev/shm, "
        "600 MB in all",
        (
            "import os, mmap\nfds = []\ntotal = 0\n"
            "try:\n"
            "    with open('/dev/shm/x', 'wb') as f:\n"
            "        f.write(b'\\x01' * (15 * 2**20))\n"
            "    total += 15\n"
            "except OSError as exc:\n"
            "    print('shm stopped', exc)\n"
            "for i in range(40):\n"
            "    fd = os.memfd_create('m%d' % i, 0)\n"
            "    os.write(fd, b'\\x01' * (15 * 2**20))\n"
            "    fds.append(fd)\n"
            "    total += 15\n"
            "    print('held', total, flush=True)\n",
        ),
        _held_within_slot,
        needs="cgroup",
        timeout_s=20.0,
    ),
    Attack(
        "disk fill",
        "files of 8 MB written into the work dir until a write fails (1 GB at most)",
        (
            "import os\ntotal = 0\nchunk = b'\\x01' * (8 * 2**20)\n"
            "try:\n"
            "    for i in range(128):\n"
            "        with open('fill%d' % i, 'wb') as f:\n"
            "            f.write(chunk)\n"
            "        total += 8\n"
            "        print('wrote', total, flush=True)\n"
            "except OSError as exc:\n"
            "    print('stopped:', exc)\n",
        ),
        _disk,
        needs="workspace",
        timeout_s=20.0,
    ),
    Attack(
        "deep tree cleanup",
        "a directory tree 5,000 levels deep in the work dir (shutil.rmtree raises on it)",
        (
            "import os\n"
            "for i in range(5000):\n"
            "    os.mkdir('d')\n"
            "    os.chdir('d')\n"
            "open('leaf', 'w').close()\nprint('depth', i + 1)\n",
        ),
        _deep,
        timeout_s=20.0,
    ),
    Attack(
        "vsock and other socket families",
        "socket() of AF_VSOCK (the host's hypervisor channel), netlink, packet, bluetooth",
        (
            "import socket\n"
            "for name, fam, kind in [('vsock', 40, 1), ('netlink', 16, 3), ('packet', 17, 3),"
            " ('bluetooth', 31, 1), ('alg', 38, 5)]:\n"
            "    try:\n"
            "        socket.socket(fam, kind).close()\n"
            "        print('ALLOWED', name)\n"
            "    except PermissionError:\n"
            "        print('refused', name)\n"
            "    except OSError as exc:\n"
            "        print('ALLOWED', name + '(' + str(exc.errno) + ')')\n",
        ),
        _refused,
        needs="seccomp",
    ),
    Attack(
        "nested user namespace",
        "unshare(CLONE_NEWUSER), clone(CLONE_NEWUSER), setns, clone3 (each would give full "
        "capabilities in a new namespace, and with them mounts of unbounded tmpfs)",
        (
            _SYSCALL + "import os\n"
            "UNSHARE, CLONE, SETNS = (272, 56, 308) if X86 else (97, 220, 268)\n"
            "r = sc(UNSHARE, 0x10000000)\n"
            "print('refused unshare' if r == (-1, 1) else 'ALLOWED unshare %r' % (r,))\n"
            "r = sc(CLONE, 0x10000000 | 17, 0, 0, 0, 0)\n"
            "if r[0] == 0:\n    os._exit(0)\n"
            "print('refused clone' if r == (-1, 1) else 'ALLOWED clone %r' % (r,))\n"
            "r = sc(SETNS, os.open('/proc/self/ns/user', os.O_RDONLY), 0)\n"
            "print('refused setns' if r == (-1, 1) else 'ALLOWED setns %r' % (r,))\n"
            "r = sc(435, 0, 0)\n"
            "print('refused clone3' if r[0] == -1 else 'ALLOWED clone3 %r' % (r,))\n",
        ),
        _refused,
        needs="seccomp",
    ),
    Attack(
        "ptrace",
        "PTRACE_ATTACH to a child of its own, and PTRACE_TRACEME",
        (
            _LIBC + "import os, time\n"
            "pid = os.fork()\n"
            "if pid == 0:\n    time.sleep(5)\n    os._exit(0)\n"
            "r = libc.ptrace(16, pid, None, None)\n"
            "print('refused attach' if r == -1 and ctypes.get_errno() == 1 "
            "else 'ALLOWED attach')\n"
            "os.kill(pid, 9)\nos.waitpid(pid, 0)\n"
            "r = libc.ptrace(0, 0, None, None)\n"
            "print('refused traceme' if r == -1 and ctypes.get_errno() == 1 "
            "else 'ALLOWED traceme')\n",
        ),
        _refused,
        needs="seccomp",
    ),
    Attack(
        "io_uring",
        "io_uring_setup, a second syscall path a filter cannot see into",
        (
            _SYSCALL + "params = ctypes.create_string_buffer(120)\n"
            "r = sc(425, 8, params)\n"
            "print('refused io_uring_setup' if r == (-1, 1) else 'ALLOWED io_uring_setup %r' % (r,))\n",
        ),
        _refused,
        needs="seccomp",
    ),
    Attack(
        "keyring",
        "add_key and keyctl on the kernel keyring (shared with the host's uid)",
        (
            _SYSCALL + "ADD_KEY, KEYCTL = (248, 250) if X86 else (217, 219)\n"
            "r = sc(ADD_KEY, b'user', b'turnrl', b'secret', 6, -2)\n"
            "print('refused add_key' if r == (-1, 1) else 'ALLOWED add_key %r' % (r,))\n"
            "r = sc(KEYCTL, 0, -3, 0)\n"
            "print('refused keyctl' if r == (-1, 1) else 'ALLOWED keyctl %r' % (r,))\n",
        ),
        _refused,
        needs="seccomp",
    ),
    Attack(
        "background CPU burner (processes)",
        "forked workers spinning after the call returned",
        (
            "import os\n"
            "for _ in range(2):\n"
            "    if os.fork() == 0:\n"
            "        os.setsid()\n"
            "        while True:\n"
            "            pass\n"
            "print('started')\n",
            "print('next')",
        ),
        _idle_between,
        between=_cpu_between,
    ),
    Attack(
        "background CPU burner (thread)",
        "a thread of the interpreter spinning after the call returned",
        (
            "import threading\n"
            "def spin():\n    while True:\n        pass\n"
            "threading.Thread(target=spin, daemon=True).start()\nprint('started')\n",
            "print('next')",
        ),
        _idle_between,
        between=_cpu_between,
    ),
    Attack(
        "forged result (thread)",
        "a thread takes the interpreter's request pipe and answers the next call itself, "
        "with its marker",
        (
            _REQUEST_FD
            + _FORGE
            + "import threading\nmine = os.dup(request_fd)\n"
            + _SILENCE
            + "threading.Thread(target=forge, args=(mine,), daemon=True).start()\n"
            "print('armed')\n",
            "print('genuine')",
        ),
        _forged,
    ),
    Attack(
        "forged result (process)",
        "a forked child takes the interpreter's request pipe and answers the next call",
        (
            _REQUEST_FD
            + _FORGE
            + "mine = os.dup(request_fd)\n"
            + _SILENCE
            + "if os.fork() == 0:\n    os.setsid()\n    forge(mine)\n    os._exit(0)\n"
            "print('armed')\n",
            "print('genuine')",
        ),
        _forged,
    ),
)


def run_attack(sandbox: Sandbox, attack: Attack) -> Outcome:
    """Run ``attack`` in a fresh interpreter of ``sandbox`` and judge it (blocking)."""
    t0 = time.perf_counter()
    try:
        calls, slot = asyncio.run(_calls(sandbox, attack))
    except _Refused as exc:
        return Outcome(attack.name, "not run", str(exc), 0.0)
    contained, detail = attack.contained(calls, sandbox)
    leaks = _leaks(slot)
    if leaks:
        contained, detail = False, f"{detail}; after close: {leaks}"
    verdict: Verdict = "contained"
    if not contained:
        missing = sandbox.missing.get(attack.needs or "")
        verdict = "not enforceable" if missing else "escaped"
        if missing:
            detail = f"{detail}; not enforced here: {missing}"
    return Outcome(attack.name, verdict, detail, round(time.perf_counter() - t0, 2))


class _Refused(Exception):
    pass


async def _calls(sandbox: Sandbox, attack: Attack) -> tuple[Calls, SandboxSlot]:
    interp = PythonInterpreter(sandbox, timeout_s=attack.timeout_s, max_output_chars=4000)
    try:
        who = await interp.run("import os\nprint(os.getuid(), os.geteuid(), os.getgid())")
        slot = interp.slot
        if (
            slot is None
            or not slot.dedicated
            or slot.uid in (0, os.getuid())
            or who.output.split() != [str(slot.uid)] * 3
        ):
            raise _Refused("hostile code runs only as a dedicated non-root uid (run as root)")
        results, seconds, between = [], [], {}
        for index, code in enumerate(attack.calls):
            t0 = time.perf_counter()
            results.append(await interp.run(code))
            seconds.append(time.perf_counter() - t0)
            if index == 0 and attack.between is not None:
                between = await asyncio.to_thread(attack.between, slot, interp.pid or 0)
    finally:
        await interp.close()
    return Calls(results, seconds, between), slot


def _leaks(slot: SandboxSlot) -> str:
    """What the slot left after close: processes, its work dir, its uid's lock."""
    found = []
    if pids_of_uid(slot.uid):
        found.append(f"{len(pids_of_uid(slot.uid))} processes")
    if os.path.lexists(slot.workdir):
        found.append(f"the work dir {slot.workdir}")
    lock = Path(_lock_path(slot.uid))
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        found.append(f"the lock of uid {slot.uid}")
    finally:
        os.close(fd)
    return ", ".join(found)


def _lock_path(uid: int) -> str:
    from turnrl.tools.sandbox import _lock_dir

    return str(_lock_dir() / f"uid-{uid}.lock")
