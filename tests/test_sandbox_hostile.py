"""The hostile suite (tests/hostile.py) inside the real bubblewrap sandbox: each class
of attack is run and must be contained. Where this machine lacks the mechanism that stops
one (no cgroup delegation, no tmpfs mounts), the case is an expected failure naming what is
missing. Also: the pieces the suite rests on (the syscall filter's program, the deep-tree
deletion, the python tool's deadline).

Safety as in test_sandbox.py: ``run_attack`` runs attack code only after the interpreter has
shown it runs as a dedicated non-root uid (which needs this test process to be root).
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from hostile import ATTACKS, Attack, run_attack, ticks_used
from turnrl.tools import PythonInterpreter, Sandbox, SandboxLimits, SandboxUnavailableError
from turnrl.tools import python_tool as make_python_tool
from turnrl.tools import sandbox as sandbox_module
from turnrl.tools.sandbox import remove_tree
from turnrl.tools.seccomp import ABIS, RET_ALLOW, RET_KILL_PROCESS, syscall_filter

# After each attack the slot's uid must be free of processes and of its lock, a check of
# machine-wide state: a sandbox of another test process may take the uid meanwhile (seen
# under pytest-xdist), so `make test` runs this file alone, after the parallel suite.
pytestmark = pytest.mark.serial

LIMITS = SandboxLimits(
    max_memory_mb=256,
    max_cpu_s=5,
    max_file_mb=16,
    max_processes=16,
    max_open_files=64,
    max_tmp_mb=16,
    max_slot_memory_mb=192,
    max_workspace_mb=64,
)

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="hostile code runs only under a dedicated non-root uid (root)"
)


@pytest.fixture(scope="module")
def bwrap() -> Sandbox:
    try:
        return Sandbox("bwrap", limits=LIMITS)
    except SandboxUnavailableError as exc:
        pytest.skip(str(exc))


@needs_root
@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack_is_contained(bwrap: Sandbox, attack: Attack) -> None:
    outcome = run_attack(bwrap, attack)
    if outcome.verdict == "not enforceable":
        pytest.xfail(f"this machine cannot enforce it: {outcome.detail}")
    assert outcome.verdict == "contained", outcome.detail
    assert outcome.seconds < 30


@contextlib.contextmanager
def without_cgroups() -> Iterator[None]:
    key = ("cgroups",)
    saved = sandbox_module._PROBED.get(key)
    sandbox_module._PROBED[key] = (None, "disabled by the test")
    try:
        yield
    finally:
        if saved is None:
            sandbox_module._PROBED.pop(key, None)
        else:
            sandbox_module._PROBED[key] = saved


@needs_root
def test_without_a_cgroup_the_memory_attack_escapes_and_is_named(
    bwrap: Sandbox, caplog: pytest.LogCaptureFixture
) -> None:
    """The memory attack is real: with the cgroup switched off it gets past the slot limit,
    and the sandbox says loudly what it does not enforce."""
    if "cgroup" in bwrap.missing:
        pytest.skip(f"no cgroups here anyway: {bwrap.missing['cgroup']}")
    with without_cgroups():
        plain = Sandbox("bwrap", limits=LIMITS)
    assert "no control group per slot (disabled by the test)" in caplog.text
    assert any("slot's total memory" in line for line in plain.unenforced)
    attack = next(a for a in ATTACKS if a.name == "memory across many processes")
    outcome = run_attack(plain, attack)
    assert outcome.verdict == "not enforceable", outcome.detail
    assert "disabled by the test" in outcome.detail


def test_the_filter_program_is_well_formed_for_each_architecture() -> None:
    for machine, abi in ABIS.items():
        program = syscall_filter(machine)
        assert len(program) % 8 == 0
        assert len(program) // 8 < 64
        insns = list(struct.iter_unpack("=HBBI", program))
        assert insns[0] == (0x20, 0, 0, 4)  # load the audit arch first
        assert insns[1][3] == abi.audit_arch
        assert insns[2] == (0x06, 0, 0, RET_KILL_PROCESS)  # another ABI: killed
        assert any(i == (0x06, 0, 0, RET_ALLOW) for i in insns)
    with pytest.raises(ValueError, match="no syscall table"):
        syscall_filter("mips")


def test_a_tree_too_deep_for_rmtree_is_deleted(tmp_path: Path) -> None:
    root = tmp_path / "deep"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY)
    for _ in range(3000):  # shutil.rmtree recurses once per level: RecursionError
        os.mkdir("d", dir_fd=fd)
        deeper = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = deeper
    os.close(fd)
    assert remove_tree(root)
    assert not root.exists()


def test_the_python_tool_has_a_deadline_of_its_own() -> None:
    sandbox = Sandbox("rlimit", limits=LIMITS)
    interp = PythonInterpreter(sandbox, timeout_s=3, startup_timeout_s=5)
    tool = make_python_tool(interp)
    assert tool.timeout_s is not None
    assert 3 + 5 < tool.timeout_s <= 3 + 5 + 60


def test_cpu_use_between_calls_counts_the_processes_still_alive() -> None:
    """A worker reaped between the two readings takes its ticks with it: summing each
    reading whole read -0.01 CPU s, which the burner attack's verdict took for an escape
    (a fresh-clone `make test`, 2026-11-27). Per process, it is what the survivors used."""
    before = {10: 500, 11: 300, 12: 7}
    assert ticks_used(before, {10: 500}) == 0  # 11 and 12 exited
    assert ticks_used(before, {10: 540, 13: 20}) == 60  # 13 started since
    assert ticks_used(before, {}) == 0
