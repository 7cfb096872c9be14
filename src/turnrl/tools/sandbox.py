"""Where untrusted code runs: bubblewrap isolation under rlimits, or a loud rlimit-only fallback.

What lives here: ``Sandbox`` (the isolation mode, the limits and a machine-wide pool of
dedicated uids), ``SandboxSlot`` (one episode's uid, work dir and control group), and the
command line and process settings that start a program inside. What does not: the
persistent interpreter and the tool the model calls (``turnrl.tools.python_tool``), the
syscall filter's program (``turnrl.tools.seccomp``), the control groups (``turnrl.tools.cgroups``).

Mode ``"bwrap"`` (Debian's bubblewrap) runs the program with every namespace unshared (no
network: only a private loopback; its own pid space; no host processes visible), the system
directories read-only (/usr, a few loader files of /etc; the rest of /etc, /home, /root and
the project are absent), a private size-limited ``/tmp`` and ``/dev/shm``, the episode's work
dir as the only writable host directory (at ``/workspace``), a cleared environment, no
capabilities, a new session (no terminal injection) and a syscall filter (no socket families
but unix and inet, no nested namespaces, ptrace, io_uring or keyring). Mode ``"rlimit"`` runs
it as a plain process with the same limits and nothing else: it can read world-readable
files, write to world-writable directories such as ``/tmp`` and connect to the network,
localhost services included. Constructing a sandbox in that mode logs a warning and sets
``isolated = False``.

In both modes the program runs as a dedicated non-root uid, one per concurrent slot, when
this process is root (never as uid 0): RLIMIT_NPROC counts every process of a uid
machine-wide, other uids cannot signal or read the host's processes, and at the end every
process of the slot's uid can be killed, which finds children that left the process group.
Slots are locked with ``flock`` on files in the temp dir, so separate processes on one
machine never share a uid. Run as an ordinary user, the program runs under that user's uid:
bubblewrap still isolates it, the fallback then isolates nothing at all.

Per slot as a whole, where this process is root and the machine allows it: a control group
(``memory.max`` counting shared memory, memfd and tmpfs pages; ``pids.max``; ``cpu.max``)
and a work dir that is a tmpfs of ``max_workspace_mb`` (it cannot be filled without bound,
and unmounting it deletes any tree, however deep). Where either is missing, the sandbox logs
a warning naming what is not enforced and lists it in ``unenforced`` (``turnrl doctor``
prints it).

The rlimits (address space, CPU seconds, file size, processes, open files, no core dumps) are
set by a few lines of Python run by the sandboxed interpreter itself before it executes the
program: no ``preexec_fn``, which is unsafe in a threaded process. A launcher, run first,
moves itself into the slot's control group, hands bubblewrap the syscall filter and drops
root for the slot's uid.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from turnrl.errors import ConfigError, TurnrlError
from turnrl.tools.cgroups import Cgroups, SlotCgroup, find_cgroups
from turnrl.tools.seccomp import syscall_filter

logger = logging.getLogger(__name__)

SandboxMode = Literal["auto", "bwrap", "rlimit"]

DEFAULT_UIDS = range(2_000_000_000, 2_000_000_064)
"""Dedicated uids (and gids) for sandbox slots: far above any account (Debian's adduser
stops at 59999, systemd's dynamic users at 65519), below 2**31 for old tools' sake."""

KILL_SETTLE_S = 1.0
"""How long ``kill_all`` waits after a SIGKILL for the killed processes to be gone."""

WORKSPACE = "/workspace"
"""Where the episode's work dir appears inside a bubblewrap sandbox."""

_PATH = "/usr/local/bin:/usr/bin:/bin"
# Symlinks on merged-/usr systems (Debian 12), directories elsewhere.
_ROOT_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What the dynamic loader and Python need from /etc. /etc itself stays hidden (no shadow,
# no host configuration); more can be added with ``extra_ro_paths``.
_ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/alternatives",
)
# Run by the sandboxed interpreter before the program: lower every limit (never above a
# hard limit already in place, which an unprivileged process cannot raise), then exec.
_LIMITER = """\
import json, os, resource, sys
for name, value in json.loads(sys.argv[1]).items():
    kind = getattr(resource, name)
    hard = resource.getrlimit(kind)[1]
    soft = value if hard == resource.RLIM_INFINITY else min(value, hard)
    if name == "RLIMIT_CPU" and (hard == resource.RLIM_INFINITY or hard > soft):
        hard = soft + 1  # SIGXCPU at the soft limit, SIGKILL a second later
    else:
        hard = soft
    resource.setrlimit(kind, (soft, hard))
os.execv(sys.argv[2], sys.argv[2:])
"""
# Run first, as this process's user: move into the slot's control group(s) (writing 0 moves
# the writer), give bubblewrap the syscall filter on an inherited in-memory file, drop root
# for the slot's uid, then exec. Nothing the sandboxed program starts can be outside.
_LAUNCHER = """\
import json, os, sys
conf = json.loads(sys.argv[1])
for path in conf["procs"]:
    with open(path, "w") as f:
        f.write("0")
argv = sys.argv[2:]
if conf["seccomp"]:
    fd = os.memfd_create("turnrl-seccomp", 0)
    os.write(fd, bytes.fromhex(conf["seccomp"]))
    os.lseek(fd, 0, os.SEEK_SET)
    argv = [argv[0], "--seccomp", str(fd), *argv[1:]]
if conf["uid"] is not None:
    os.setgroups([])
    os.setresgid(conf["gid"], conf["gid"], conf["gid"])
    os.setresuid(conf["uid"], conf["uid"], conf["uid"])
os.execv(argv[0], argv)
"""
# The whole of a uid's processes can be killed by that uid itself: kill(-1) signals every
# process the caller may signal, except itself and init. Run only for dedicated uids.
_KILL_ALL = "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n"


class SandboxError(TurnrlError, RuntimeError):
    """A sandbox cannot be set up (no free uid, an unusable interpreter or work dir)."""


class SandboxUnavailableError(SandboxError):
    """``mode="bwrap"`` was asked for and bubblewrap cannot run here."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-process resource limits of sandboxed code (rlimits; the tmpfs size for bwrap)."""

    max_memory_mb: int = 1024
    """Address space of each process (RLIMIT_AS): an allocation beyond it fails."""
    max_cpu_s: int = 60
    """CPU seconds of each process over its whole life (RLIMIT_CPU): SIGXCPU ends it."""
    max_file_mb: int = 64
    """Largest file a process may write (RLIMIT_FSIZE): a longer write fails."""
    max_processes: int = 32
    """Processes and threads of the slot's uid (RLIMIT_NPROC): a fork beyond it fails."""
    max_open_files: int = 128
    """Open file descriptors of each process (RLIMIT_NOFILE)."""
    max_tmp_mb: int = 64
    """Size of each of the private /tmp and /dev/shm, tmpfs in memory (bwrap only; the
    fallback has neither)."""
    max_slot_memory_mb: int = 2048
    """Memory of the whole slot, all its processes together, shared memory, memfd and tmpfs
    pages included (cgroup memory.max): past it the kernel's OOM killer ends a process."""
    max_workspace_mb: int = 1024
    """Size of the work dir (a tmpfs, in memory): a write past it fails with ENOSPC."""
    max_cpu_cores: float = 1.0
    """Cores the whole slot may use at once (cgroup cpu.max)."""

    def __post_init__(self) -> None:
        for name in (
            "max_memory_mb",
            "max_cpu_s",
            "max_file_mb",
            "max_processes",
            "max_open_files",
            "max_tmp_mb",
            "max_slot_memory_mb",
            "max_workspace_mb",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"SandboxLimits.{name} must be a positive int, got {value!r}")
        cores = self.max_cpu_cores
        if not isinstance(cores, (int, float)) or isinstance(cores, bool) or not cores > 0:
            raise ConfigError(f"SandboxLimits.max_cpu_cores must be > 0, got {cores!r}")

    def rlimits(self) -> dict[str, int]:
        """Soft limits by ``resource`` constant name; the core dump size is always 0."""
        mb = 1024 * 1024
        return {
            "RLIMIT_AS": self.max_memory_mb * mb,
            "RLIMIT_CPU": self.max_cpu_s,
            "RLIMIT_FSIZE": self.max_file_mb * mb,
            "RLIMIT_NPROC": self.max_processes,
            "RLIMIT_NOFILE": self.max_open_files,
            "RLIMIT_CORE": 0,
        }


@dataclass(eq=False)
class SandboxSlot:
    """One episode's place in a sandbox: the uid its code runs as and its work dir.

    ``dedicated``: the uid belongs to this slot alone (this process is root), so every
    process of the uid is the slot's and ``Sandbox.kill_all`` may kill them all.
    The work dir is the sandboxed code's: treat what it holds as untrusted (symlinks
    included) when reading it from the host.
    """

    uid: int
    gid: int
    workdir: Path
    dedicated: bool
    lock_fd: int | None
    """The open lock file holding the uid (None for a shared uid, and once released)."""
    cgroup: SlotCgroup | None = None
    """The slot's control group(s) (None where the machine gives none)."""
    mounted: bool = False
    """The work dir is a size-limited tmpfs mounted for this slot."""


class Sandbox:
    """How and as whom untrusted programs run. Share one among all episodes of a run.

    ``mode``: ``"bwrap"`` isolates with bubblewrap and raises ``SandboxUnavailableError``
    where it cannot run; ``"rlimit"`` only limits resources and isolates nothing;
    ``"auto"`` takes bubblewrap when it runs and falls back otherwise. The resolved mode is
    ``self.mode``; ``self.isolated`` is False in the fallback (a warning is logged) and
    ``self.fallback_reason`` says why bubblewrap was not used.

    ``python``: the interpreter sandboxed code runs under. Slot uids cannot read /root or a
    private venv, so it must be world-readable, such as Debian's /usr/bin/python3 or a venv
    made from it (a venv outside /usr is bound read-only into the sandbox). ``uids``: the
    dedicated uids, one per concurrent slot, used when this process is root. ``work_root``:
    where the per-episode work dirs are made (default: the temp dir); the slot uid must be
    able to reach it. ``extra_ro_paths``: more host paths shown read-only inside bubblewrap.
    """

    def __init__(
        self,
        mode: SandboxMode = "auto",
        *,
        limits: SandboxLimits | None = None,
        python: str = "/usr/bin/python3",
        uids: Sequence[int] = DEFAULT_UIDS,
        work_root: str | os.PathLike[str] | None = None,
        extra_ro_paths: Sequence[str] = (),
    ) -> None:
        if mode not in ("auto", "bwrap", "rlimit"):
            raise ConfigError(f"sandbox mode must be 'auto', 'bwrap' or 'rlimit', got {mode!r}")
        self.limits = limits or SandboxLimits()
        self.python = python
        self.uids = tuple(uids)
        self.work_root = Path(work_root) if work_root is not None else None
        self.extra_ro_paths = tuple(extra_ro_paths)
        self._root = os.geteuid() == 0
        if self._root:
            _check_uids(self.uids)
        self._check_python()
        self._bwrap = shutil.which("bwrap")
        reason = "rlimit mode was asked for" if mode == "rlimit" else self._bwrap_problem()
        if mode == "bwrap" and reason is not None:
            raise SandboxUnavailableError(
                f"bubblewrap cannot run here: {reason}. Install it (apt-get install "
                "bubblewrap; `make setup` does) or use Sandbox(mode='auto') to fall back "
                "to rlimits without isolation."
            )
        self.mode: Literal["bwrap", "rlimit"] = "bwrap" if reason is None else "rlimit"
        self.isolated = self.mode == "bwrap"
        self.fallback_reason = reason
        if not self.isolated:
            logger.warning(
                "turnrl sandbox does NOT isolate (%s): sandboxed code can read "
                "world-readable files, write world-writable directories such as /tmp and "
                "connect to the network, including services on localhost; only resource "
                "limits apply. Install bubblewrap (apt-get install bubblewrap) to isolate.",
                self.fallback_reason,
            )
            if not self._root:
                logger.warning(
                    "turnrl sandbox fallback runs code under this process's own uid "
                    "(not root, so no dedicated uid): the code can signal this process, "
                    "read its files and environment, and leave processes behind."
                )
        self._cgroups, cgroup_problem = _probe(("cgroups",), find_cgroups)
        workspace_problem = _probe(("workspace",), _tmpfs_problem)[1]
        self._seccomp: bytes | None = None
        seccomp_problem = None
        if self.mode == "bwrap":
            try:
                self._seccomp = syscall_filter()
            except ValueError as exc:
                seccomp_problem = str(exc)
        unenforced = []
        if cgroup_problem is not None:
            unenforced.append(
                f"no control group per slot ({cgroup_problem}): NOT enforced: the slot's "
                "total memory (the address-space limit is per process and multiplies with "
                "the process count; shared memory, memfd and tmpfs pages count against no "
                "limit), the slot's CPU share (cpu.max) and its task count (pids.max; "
                "RLIMIT_NPROC still counts the uid's processes"
                + (")" if self._root else ", but not threads of a shared uid)")
            )
        if workspace_problem is not None:
            unenforced.append(
                f"the work dir is not size-limited ({workspace_problem}): NOT enforced: "
                "its total size (only the per-file size limit and the host's disk bound it)"
            )
        if seccomp_problem is not None:
            unenforced.append(f"no syscall filter ({seccomp_problem})")
        self.missing: dict[str, str] = {
            name: problem
            for name, problem in (
                ("cgroup", cgroup_problem),
                ("workspace", workspace_problem),
                ("seccomp", seccomp_problem if self.mode == "bwrap" else "no bubblewrap"),
            )
            if problem is not None
        }
        """Per mechanism ("cgroup", "workspace", "seccomp"): why it is missing here."""
        self.unenforced: tuple[str, ...] = tuple(unenforced)
        """What this machine cannot enforce, in words (empty: everything is)."""
        for line in self.unenforced:
            logger.warning("turnrl sandbox: %s", line)

    @property
    def cgroup_version(self) -> int | None:
        """The cgroup hierarchy slot limits go through here (1 or 2), or None."""
        return None if self._cgroups is None else self._cgroups.version

    def acquire(self) -> SandboxSlot:
        """A free slot: a uid locked for this slot alone, a fresh, empty work dir (a
        size-limited tmpfs where possible) and the slot's control group where possible."""
        if not self._root:
            uid, gid = os.getuid(), os.getgid()
            return SandboxSlot(uid, gid, self._make_workdir(uid, gid), False, None)
        uid, fd = self._lock_uid()
        slot = SandboxSlot(uid, uid, Path(), True, fd)
        try:
            slot.workdir = self._make_workdir(uid, uid)
            if self._probe_ok("workspace"):
                _mount_tmpfs(slot.workdir, self.limits.max_workspace_mb * 1024 * 1024, uid)
                slot.mounted = True
            if pids_of_uid(uid):  # left behind by a process that died holding the lock
                self.kill_all(slot)
            if self._cgroups is not None:
                slot.cgroup = self._make_cgroup(self._cgroups, uid)
        except BaseException:
            self.release(slot)
            raise
        return slot

    def release(self, slot: SandboxSlot) -> None:
        """Kill what the slot's uid still runs, delete its work dir and control group, free
        its uid. Never raises: whatever the code left, the uid and the work dir come back."""
        try:
            if slot.dedicated:
                self.kill_all(slot)
            if slot.cgroup is not None and not slot.cgroup.remove():
                logger.warning("sandbox control group %s could not be removed", slot.cgroup)
            if slot.mounted:
                slot.mounted = not _unmount(slot.workdir)
            if slot.workdir != Path() and not remove_tree(slot.workdir):
                logger.warning("sandbox work dir %s could not be fully deleted", slot.workdir)
        except Exception:
            logger.exception("cleaning up sandbox slot of uid %d failed", slot.uid)
        finally:
            if slot.lock_fd is not None:
                fd, slot.lock_fd = slot.lock_fd, None
                os.close(fd)  # closing the descriptor drops the flock

    def kill_all(self, slot: SandboxSlot) -> None:
        """SIGKILL every process of a dedicated slot uid (a no-op for a shared uid).

        Blocking (it starts a short process as the uid); from async code run it in a thread.
        """
        if not slot.dedicated:
            return
        for _ in range(3):  # a fork racing one kill leaves a child for the next
            if not pids_of_uid(slot.uid):
                return
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self._kill_as(slot)
            # A killed process is listed until the kernel has run its exit, which on a
            # loaded machine takes a moment: wait for that before killing again or warning.
            deadline = time.monotonic() + KILL_SETTLE_S
            while pids_of_uid(slot.uid) and time.monotonic() < deadline:
                time.sleep(0.01)
        if pids_of_uid(slot.uid):
            logger.warning("processes of sandbox uid %d survive SIGKILL", slot.uid)

    def kill_except(self, slot: SandboxSlot, keep: Set[int]) -> int:
        """SIGKILL every process of a dedicated slot uid but the pids in ``keep``; how many
        were found. For the time between two calls of one interpreter: nothing the code
        started runs on. Blocking; a no-op for a shared uid."""
        if not slot.dedicated:
            return 0
        found: set[int] = set()
        for _ in range(10):  # a fork racing one round leaves a child for the next
            others = [pid for pid in pids_of_uid(slot.uid) if pid not in keep]
            if not others:
                break
            found.update(others)
            for sig in (signal.SIGSTOP, signal.SIGKILL):  # stopped first: no more forks
                for pid in others:
                    _signal_if_uid(pid, slot.uid, sig)
        return len(found)

    def _kill_as(self, slot: SandboxSlot) -> None:
        """kill(-1) run as the slot's uid: every process it may signal."""
        subprocess.run(
            [self.python, "-I", "-S", "-c", _KILL_ALL],
            user=slot.uid,
            group=slot.gid,
            extra_groups=[],
            env={},
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
            check=False,
        )

    def command(self, slot: SandboxSlot, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` (its program under ``self.python`` or in
        the sandbox's read-only system) inside the sandbox, under the limits."""
        rlimits = self.limits.rlimits()
        if not slot.dedicated and self.mode == "rlimit":
            # RLIMIT_NPROC counts all of a shared uid's processes, so leave room for them.
            rlimits["RLIMIT_NPROC"] += len(pids_of_uid(slot.uid))
        inner = [self.python, "-I", "-S", "-c", _LIMITER, json.dumps(rlimits), *argv]
        bwrap = self.mode == "bwrap"
        launch: dict[str, Any] = {
            "procs": [] if slot.cgroup is None else slot.cgroup.procs_files,
            "seccomp": self._seccomp.hex() if bwrap and self._seccomp is not None else None,
            "uid": slot.uid if slot.dedicated else None,
            "gid": slot.gid if slot.dedicated else None,
        }
        launcher = [self.python, "-I", "-S", "-c", _LAUNCHER]
        if self.mode == "rlimit":
            return [*launcher, json.dumps(launch), *inner]
        assert self._bwrap is not None
        mb = 1024 * 1024
        return [
            *launcher,
            json.dumps(launch),
            self._bwrap,
            *self._bwrap_isolation(),
            *("--size", str(self.limits.max_tmp_mb * mb), "--tmpfs", "/tmp"),
            *("--size", str(self.limits.max_tmp_mb * mb), "--tmpfs", "/dev/shm"),
            # After --tmpfs /tmp: binds placed before it would be hidden by it.
            *("--bind", str(slot.workdir), WORKSPACE, "--chdir", WORKSPACE),
            # The root and /dev are unbounded tmpfs bubblewrap made: writes there would
            # fill memory, so only /tmp, /dev/shm and the work dir stay writable.
            *("--remount-ro", "/", "--remount-ro", "/dev"),
            *_setenv(self._inner_env(WORKSPACE, "/tmp")),
            "--",
            *inner,
        ]

    def popen_kwargs(self, slot: SandboxSlot) -> dict[str, Any]:
        """Keyword arguments for ``subprocess.Popen`` / ``asyncio.create_subprocess_exec``
        with ``command(slot, ...)``: a new session (its own process group, killable as
        one), the work dir, a minimal environment (nothing of this process's environment
        passes). The command's launcher switches to the slot's uid itself."""
        kwargs: dict[str, Any] = {"start_new_session": True, "cwd": str(slot.workdir)}
        if self.mode == "bwrap":
            kwargs["env"] = {"PATH": _PATH, "LANG": "C.UTF-8"}  # bwrap's own; --clearenv
        else:
            kwargs["env"] = self._inner_env(str(slot.workdir), str(slot.workdir))
        return kwargs

    def code_workdir(self, slot: SandboxSlot) -> str:
        """The work dir as the sandboxed code sees it."""
        return WORKSPACE if self.mode == "bwrap" else str(slot.workdir)

    def describe_exit(self, returncode: int) -> str:
        """A returncode of a sandboxed process (bwrap reports a signal as 128 + number),
        in words for the model."""
        signum = -returncode if returncode < 0 else None
        if self.mode == "bwrap" and returncode > 128:
            signum = returncode - 128
        if signum is None:
            return f"it exited with status {returncode}"
        if signum == signal.SIGXCPU:
            return f"it used up its CPU time limit ({self.limits.max_cpu_s} s)"
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return f"it was killed by {name}"

    def _check_python(self) -> None:
        path = Path(self.python)
        try:
            mode = path.stat().st_mode
        except OSError as exc:
            raise SandboxError(f"sandbox python {self.python!r} does not exist ({exc})") from exc
        if not path.is_absolute() or not stat.S_ISREG(mode):
            raise SandboxError(f"sandbox python {self.python!r} must be an absolute file path")
        if self._root and not mode & stat.S_IXOTH:
            raise SandboxError(
                f"sandbox python {self.python!r} is not executable by other users; the "
                "sandbox uid needs a world-readable interpreter such as /usr/bin/python3"
            )

    def _bwrap_problem(self) -> str | None:
        """Why bubblewrap cannot run sandboxed Python here, or None (checked by running it
        once per process, as a locked slot uid when root)."""
        if self._bwrap is None:
            return "bwrap is not installed"
        key = (self._bwrap, self.python, self._root)
        if key not in _PROBES:
            argv = [self._bwrap, *self._bwrap_isolation(), "--", self.python, "-I", "-S"]
            uid, lock_fd = self._lock_uid() if self._root else (-1, None)
            try:
                done = subprocess.run(
                    [*argv, "-c", "pass"],
                    user=None if lock_fd is None else uid,
                    group=None if lock_fd is None else uid,
                    extra_groups=None if lock_fd is None else [],
                    env={"PATH": _PATH},
                    cwd="/",
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=30,
                    check=False,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                _PROBES[key] = f"bwrap failed to start ({exc})"
            else:
                err = done.stderr.decode(errors="replace").strip()
                code = done.returncode
                _PROBES[key] = None if code == 0 else f"bwrap exited with {code}: {err}"
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)
        return _PROBES[key]

    def _probe_ok(self, name: str) -> bool:
        return _PROBED.get((name,), (None, "not probed"))[1] is None

    def _make_cgroup(self, cgroups: Cgroups, uid: int) -> SlotCgroup:
        limits = self.limits
        return cgroups.make_slot(
            f"slot-{uid}",
            memory_bytes=limits.max_slot_memory_mb * 1024 * 1024,
            # bubblewrap's own two processes come on top of the code's.
            max_tasks=limits.max_processes + 4,
            cpu_cores=limits.max_cpu_cores,
        )

    def _lock_uid(self) -> tuple[int, int]:
        """A uid of the pool no other slot on the machine holds, and its lock's descriptor."""
        lock_dir = _lock_dir()
        for uid in self.uids:
            fd = os.open(lock_dir / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return uid, fd
        raise SandboxError(
            f"all {len(self.uids)} sandbox uids are in use: close finished interpreters "
            "or pass more uids to Sandbox()"
        )

    def _bwrap_isolation(self) -> list[str]:
        """Namespaces, the read-only system, /proc and /dev: everything but /tmp, the work
        dir and the environment."""
        args = [
            *("--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"),
            *("--hostname", "sandbox", "--ro-bind", "/usr", "/usr"),
        ]
        for path in _ROOT_DIRS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for path in _ETC_FILES:
            args += ["--ro-bind-try", path, path]
        python_root = Path(self.python).parent.parent  # a venv outside /usr
        extra = [*self.extra_ro_paths]
        if not Path(self.python).is_relative_to("/usr"):
            extra.append(str(python_root))
        for path in extra:
            args += ["--ro-bind", path, path]
        return [*args, "--proc", "/proc", "--dev", "/dev"]

    def _inner_env(self, home: str, tmp: str) -> dict[str, str]:
        # One thread per numeric library: limits count threads, and cores are few.
        return {
            "PATH": _PATH,
            "HOME": home,
            "TMPDIR": tmp,
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }

    def _make_workdir(self, uid: int, gid: int) -> Path:
        root = self.work_root or Path(tempfile.gettempdir())
        try:
            path = Path(tempfile.mkdtemp(prefix=f"turnrl-sandbox-{uid}-", dir=root))
            if self._root:
                os.chown(path, uid, gid)
        except OSError as exc:
            raise SandboxError(f"cannot make a sandbox work dir in {root}: {exc}") from exc
        return path


_PROBES: dict[tuple[str, str, bool], str | None] = {}
_PROBED: dict[tuple[str], tuple[Any, str | None]] = {}


def _probe(key: tuple[str], probe: Callable[[], tuple[Any, str | None]]) -> tuple[Any, str | None]:
    """What the machine allows, found once per process: (a result, why not or None)."""
    if key not in _PROBED:
        _PROBED[key] = probe()
    return _PROBED[key]


_LIBC = ctypes.CDLL(None, use_errno=True)
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


def _mount_tmpfs(path: Path, size_bytes: int, uid: int) -> None:
    """Mount a tmpfs of ``size_bytes`` on ``path``, owned by ``uid``, mode 0700."""
    options = f"size={size_bytes},mode=0700,uid={uid},gid={uid}".encode()
    flags = _MS_NOSUID | _MS_NODEV
    if _LIBC.mount(b"tmpfs", os.fsencode(path), b"tmpfs", flags, options) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount tmpfs on {path}: {os.strerror(code)}")


def _unmount(path: Path) -> bool:
    """Detach the mount on ``path`` (its files go with it, however deep the tree)."""
    if _LIBC.umount2(os.fsencode(path), _MNT_DETACH) == 0:
        return True
    code = ctypes.get_errno()
    logger.warning("cannot unmount the sandbox work dir %s: %s", path, os.strerror(code))
    return False


def _tmpfs_problem() -> tuple[None, str | None]:
    """Why a size-limited tmpfs cannot be mounted as a work dir here, or None."""
    if os.geteuid() != 0:
        return None, "this process is not root (mounting a tmpfs needs root)"
    path = Path(tempfile.mkdtemp(prefix="turnrl-tmpfs-probe-"))
    try:
        _mount_tmpfs(path, 1024 * 1024, os.geteuid())
    except OSError as exc:
        return None, str(exc)
    finally:
        if os.path.ismount(path):
            _unmount(path)
        path.rmdir()
    return None, None


def remove_tree(path: Path) -> bool:
    """Delete ``path`` and everything under it, symlinks not followed; True if it is gone.

    ``shutil.rmtree`` recurses once per level and raises ``RecursionError`` on a tree a few
    thousand levels deep, which sandboxed code makes in a second; ``rm -rf`` walks it
    without recursion and is the fallback."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except Exception:  # RecursionError, or an entry it could not delete
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                ["rm", "-rf", "--one-file-system", "--", str(path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=600,
                check=False,
            )
    return not os.path.lexists(path)


def _signal_if_uid(pid: int, uid: int, sig: int) -> None:
    """Send ``sig`` to ``pid`` if it is (still) a process of ``uid``: through a pidfd, so a
    pid reused by another process between the check and the signal is never hit."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        if int(uids[0]) == uid:
            signal.pidfd_send_signal(pidfd, sig)
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    finally:
        os.close(pidfd)


def _check_uids(uids: Sequence[int]) -> None:
    """Slot uids must belong to no account: everything a slot uid runs gets killed."""
    if not uids or min(uids) <= 0:
        raise ConfigError("as root, sandbox uids must be a non-empty list of uids > 0")
    for uid in uids:
        try:
            account = pwd.getpwuid(uid).pw_name
        except KeyError:
            continue
        raise ConfigError(f"sandbox uid {uid} is the account {account!r}; use unused uids")


def _setenv(env: dict[str, str]) -> list[str]:
    args = ["--clearenv"]
    for key, value in env.items():
        args += ["--setenv", key, value]
    return args


def _lock_dir() -> Path:
    """Root's directory of per-uid lock files, shared by every process on the machine."""
    path = Path(tempfile.gettempdir()) / "turnrl-sandbox-uids"
    path.mkdir(mode=0o755, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise SandboxError(
            f"{path} must be a directory owned by this user, not group/world writable"
        )
    return path


def pids_of_uid(uid: int) -> list[int]:
    """Live pids whose real uid is ``uid`` (from /proc; processes in any pid namespace)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", encoding="ascii", errors="replace") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            zombie = fields.get("State", "").split()[:1] == ["Z"]  # dead, awaiting its parent
            if not zombie and int(fields["Uid"].split()[0]) == uid:
                pids.append(int(entry.name))
        except (OSError, ValueError, KeyError, IndexError):
            continue  # gone meanwhile
    return pids
