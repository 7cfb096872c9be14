"""The syscall filter of the bubblewrap sandbox, as a classic-BPF program (pure; no libseccomp).

What lives here: ``syscall_filter()``, the bytes bubblewrap's ``--seccomp FD`` loads (an
array of ``struct sock_filter``, native byte order), and the table of what it denies. What
does not: starting bubblewrap (``turnrl.tools.sandbox``).

Why: bubblewrap's namespaces leave kernel surface that a sandboxed uid can still reach. The
filter denies, with EPERM: sockets of families other than unix, IPv4 and IPv6 (vsock, netlink,
packet, bluetooth, ... reach past the network namespace or into the kernel); nested
namespaces (``unshare``, ``setns``, ``clone`` with a namespace flag), which would give full
capabilities inside and with them mounts of unbounded tmpfs; ``ptrace``; ``io_uring`` (a
second syscall path the filter cannot see into); and the kernel keyring. ``clone3`` passes
its flags in memory a filter cannot read, so it fails with ENOSYS and libc falls back to
``clone``, whose flags are checked. A call from another architecture's ABI (i386 on x86_64,
or x32 numbers) kills the process: the syscall numbers above would not mean the same there.

A filter program reads ``struct seccomp_data``: ``nr`` (u32) at 0, ``arch`` (u32) at 4, the
instruction pointer at 8, then six u64 ``args`` from 16 (on little-endian machines an
argument's low 32 bits are at 16 + 8 i). See seccomp(2) and linux/filter.h.
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass

# Classic-BPF opcodes (linux/bpf_common.h).
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x05 | 0x40 | 0x00  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06 | 0x00  # BPF_RET | BPF_K

# Filter results (linux/seccomp.h).
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

_NR, _ARCH, _ARG0_LO = 0, 4, 16

ALLOWED_SOCKET_FAMILIES = {1: "AF_UNIX", 2: "AF_INET", 10: "AF_INET6"}

# clone(2) flags that make a new namespace. CLONE_NEWTIME (0x80) is left out: in clone()'s
# flags that bit belongs to the exit signal, and only clone3 and unshare take it.
CLONE_NAMESPACE_FLAGS = (
    0x00020000  # CLONE_NEWNS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
)

DENIED = (
    "unshare",
    "setns",
    "ptrace",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
)
"""Syscalls refused outright with EPERM (socket, socketpair and clone are checked by their
arguments; clone3 gets ENOSYS)."""


@dataclass(frozen=True)
class Abi:
    """One architecture's audit id and syscall numbers (from the kernel's syscall tables)."""

    audit_arch: int
    numbers: dict[str, int]
    x32_bit: int | None = None
    """Numbers at or above this belong to another ABI sharing ``audit_arch`` (x86's x32)."""


_COMMON_NEW = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}
ABIS = {
    "x86_64": Abi(
        0xC000003E,  # AUDIT_ARCH_X86_64
        {
            "socket": 41,
            "socketpair": 53,
            "clone": 56,
            "ptrace": 101,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "unshare": 272,
            "setns": 308,
            "clone3": 435,
            **_COMMON_NEW,
        },
        x32_bit=0x40000000,
    ),
    "aarch64": Abi(
        0xC00000B7,  # AUDIT_ARCH_AARCH64
        {
            "unshare": 97,
            "ptrace": 117,
            "socket": 198,
            "socketpair": 199,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "clone": 220,
            "setns": 268,
            "clone3": 435,
            **_COMMON_NEW,
        },
    ),
}


def syscall_filter(machine: str | None = None) -> bytes:
    """The compiled filter for ``machine`` (default: this one's ``platform.machine()``).

    Raises ``ValueError`` for an architecture without a table here.
    """
    name = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine or "", machine)
    name = name or platform.machine()
    if name not in ABIS:
        raise ValueError(f"no syscall table for architecture {name!r}")
    return _assemble(_program(ABIS[name]))


Insn = tuple[int, "int | str", "int | str", int]
"""(code, jump-if-true, jump-if-false, k); a jump names a label or is a relative offset."""


def _program(abi: Abi) -> list[Insn | str]:
    """The filter as instructions and labels (a ``str`` entry marks a label)."""
    nr = abi.numbers
    eperm = RET_ERRNO | errno.EPERM
    prog: list[Insn | str] = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 1, 0, abi.audit_arch),
        (_RET_K, 0, 0, RET_KILL_PROCESS),
        (_LD_W_ABS, 0, 0, _NR),
    ]
    if abi.x32_bit is not None:
        prog += [(_JGE_K, 0, 1, abi.x32_bit), (_RET_K, 0, 0, RET_KILL_PROCESS)]
    prog += [
        (_JEQ_K, "socket", 0, nr["socket"]),
        (_JEQ_K, "socket", 0, nr["socketpair"]),
        (_JEQ_K, "clone", 0, nr["clone"]),
        (_JEQ_K, "enosys", 0, nr["clone3"]),
    ]
    prog += [(_JEQ_K, "eperm", 0, nr[name]) for name in DENIED]
    prog += [
        (_RET_K, 0, 0, RET_ALLOW),
        "socket",
        (_LD_W_ABS, 0, 0, _ARG0_LO),  # the address family
        *[(_JEQ_K, "allow", 0, family) for family in ALLOWED_SOCKET_FAMILIES],
        (_RET_K, 0, 0, eperm),
        "clone",
        (_LD_W_ABS, 0, 0, _ARG0_LO),  # the flags (first argument on x86_64 and aarch64)
        (_JSET_K, "eperm", 0, CLONE_NAMESPACE_FLAGS),
        "allow",
        (_RET_K, 0, 0, RET_ALLOW),
        "eperm",
        (_RET_K, 0, 0, eperm),
        "enosys",
        (_RET_K, 0, 0, RET_ERRNO | errno.ENOSYS),
    ]
    return prog


def _assemble(prog: list[Insn | str]) -> bytes:
    """Resolve labels to forward offsets and pack each ``struct sock_filter`` (u16 code,
    u8 jt, u8 jf, u32 k)."""
    labels: dict[str, int] = {}
    insns: list[Insn] = []
    for item in prog:
        if isinstance(item, str):
            labels[item] = len(insns)
        else:
            insns.append(item)
    out = bytearray()
    for index, (code, jt, jf, k) in enumerate(insns):
        offsets = []
        for jump in (jt, jf):
            offset = labels[jump] - index - 1 if isinstance(jump, str) else jump
            if not 0 <= offset <= 255:
                raise ValueError(f"jump out of range at instruction {index}")
            offsets.append(offset)
        out += struct.pack("=HBBI", code, offsets[0], offsets[1], k)
    return bytes(out)
