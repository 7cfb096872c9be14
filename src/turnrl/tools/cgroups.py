"""A control group per sandbox slot: the slot's memory, process count and CPU share as a whole.

What lives here: ``find_cgroups()`` (which cgroup hierarchy this machine lets us use, or
why none) and ``Cgroups.make_slot`` / ``SlotCgroup.remove``. What does not: putting a
process into the group (the sandbox's launcher writes its own pid into ``procs_files``
before it drops root and starts the sandboxed program, so nothing it starts is outside).

Why: rlimits are per process. A 256 MB address-space limit allows 256 MB per process, and
shared memory, memfd files and tmpfs pages count against none. A cgroup's memory limit
counts every page of the group (anonymous, shared memory, tmpfs and page cache), its pids
limit counts every task, its CPU quota caps the group's share of the cores.

Where: a ``turnrl-sandbox`` group under the cgroup this process runs in (so the sandboxes
stay inside whatever limits the machine set for this process), one ``slot-<uid>`` group
per slot. cgroup v2 is used when its unified hierarchy offers the memory, pids and cpu
controllers here; otherwise the v1 hierarchies of those controllers (hybrid hosts mount
them separately, as on the machines this project was built on). Only root can use either
(the slot's uid must not be able to change its own limits). Under v2 a cgroup holding
processes cannot give controllers to its children, so a process sitting in a non-root v2
group needs a delegated, empty group: pass its path as ``TURNRL_CGROUP_ROOT``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

CONTROLLERS = ("memory", "pids", "cpu")
GROUP = "turnrl-sandbox"
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class SlotCgroup:
    """The group (v2) or groups (v1, one per controller) of one slot."""

    dirs: tuple[Path, ...]

    @property
    def procs_files(self) -> list[str]:
        """Where a process writes ``0`` to move itself into the slot's group(s)."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def remove(self) -> bool:
        """Delete the group(s) once their processes are gone; False if one is left."""
        ok = True
        for path in self.dirs:
            for _ in range(50):  # a killed process leaves its group a moment later
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        ok = False
                        break
                    time.sleep(0.02)
            else:
                ok = False
        return ok


@dataclass(frozen=True)
class Cgroups:
    """A usable hierarchy: ``version`` 1 or 2 and the parent dir of the slot groups for
    each controller (all the same dir under v2)."""

    version: int
    parents: dict[str, Path]

    def make_slot(
        self, name: str, *, memory_bytes: int, max_tasks: int, cpu_cores: float
    ) -> SlotCgroup:
        """Create (or reuse a stale) group ``name`` with the given limits."""
        quota = max(1000, int(cpu_cores * CPU_PERIOD_US))
        if self.version == 2:
            path = self.parents["memory"] / name
            path.mkdir(exist_ok=True)
            _write(path / "memory.max", memory_bytes)
            _write(path / "memory.swap.max", 0, optional=True)
            _write(path / "pids.max", max_tasks)
            _write(path / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            return SlotCgroup((path,))
        dirs = {c: self.parents[c] / name for c in CONTROLLERS}
        for path in dirs.values():
            path.mkdir(exist_ok=True)
        memory = dirs["memory"]
        # memsw (memory + swap) must stay >= the memory limit: lower it second when it is
        # being lowered, first when raised; writing it last after the right order is safe.
        _write(memory / "memory.memsw.limit_in_bytes", -1, optional=True)
        _write(memory / "memory.limit_in_bytes", memory_bytes)
        _write(memory / "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
        _write(dirs["pids"] / "pids.max", max_tasks)
        _write(dirs["cpu"] / "cpu.cfs_period_us", CPU_PERIOD_US)
        _write(dirs["cpu"] / "cpu.cfs_quota_us", quota)
        return SlotCgroup(tuple(dirs.values()))


def find_cgroups() -> tuple[Cgroups | None, str | None]:
    """The hierarchy slot groups can be made in, or None and why not (creates the
    ``turnrl-sandbox`` parent group(s) as a side effect)."""
    if os.geteuid() != 0:
        return None, "this process is not root (slot limits need root to set)"
    mounts = _cgroup_mounts()
    own = _own_cgroups()
    problems = []
    if "" in mounts and "" in own:
        found, problem = _v2(mounts[""], own[""])
        if found is not None:
            return found, None
        problems.append(f"cgroup v2: {problem}")
    else:
        problems.append("cgroup v2: no unified hierarchy mounted")
    found, problem = _v1(mounts, own)
    if found is not None:
        return found, None
    problems.append(f"cgroup v1: {problem}")
    return None, "; ".join(problems)


def _v2(mount: Path, own: str) -> tuple[Cgroups | None, str | None]:
    override = os.environ.get("TURNRL_CGROUP_ROOT")
    base = Path(override) if override else mount / own.lstrip("/")
    try:
        offered = (base / "cgroup.controllers").read_text().split()
    except OSError as exc:
        return None, f"cannot read {base}/cgroup.controllers ({exc.strerror})"
    missing = [c for c in CONTROLLERS if c not in offered]
    if missing:
        return None, f"{base} offers no {', '.join(missing)} controller"
    enable = " ".join(f"+{c}" for c in CONTROLLERS)
    try:
        _write(base / "cgroup.subtree_control", enable)
        group = base / GROUP
        group.mkdir(exist_ok=True)
        _write(group / "cgroup.subtree_control", enable)
    except OSError as exc:
        hint = " (it holds processes: set TURNRL_CGROUP_ROOT to a delegated empty group)"
        return None, f"cannot delegate from {base}: {exc.strerror}" + (
            hint if exc.errno == errno.EBUSY else ""
        )
    return Cgroups(2, dict.fromkeys(CONTROLLERS, group)), None


def _v1(mounts: dict[str, Path], own: dict[str, str]) -> tuple[Cgroups | None, str | None]:
    parents = {}
    for controller in CONTROLLERS:
        if controller not in mounts or controller not in own:
            return None, f"no {controller} hierarchy mounted"
        group = mounts[controller] / own[controller].lstrip("/") / GROUP
        try:
            group.mkdir(exist_ok=True)
        except OSError as exc:
            return None, f"cannot create {group} ({exc.strerror})"
        parents[controller] = group
    return Cgroups(1, parents), None


def _cgroup_mounts() -> dict[str, Path]:
    """Mount points by controller ("" for the v2 unified hierarchy), from mountinfo."""
    found: dict[str, Path] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            sep = fields.index("-")
            fstype, options = fields[sep + 1], fields[sep + 3].split(",")
            point = Path(fields[4].replace("\\040", " "))
            if fstype == "cgroup2":
                found.setdefault("", point)
            elif fstype == "cgroup":
                for controller in CONTROLLERS:
                    if controller in options:
                        found.setdefault(controller, point)
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path by controller ("" for v2), from /proc/self/cgroup."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                found[controller] = path
    return found


def _write(path: Path, value: object, *, optional: bool = False) -> None:
    """Write a control file; an ``optional`` one (swap accounting may be off) may fail."""
    try:
        path.write_text(str(value))
    except OSError:
        if not optional:
            raise
