"""dev/vllm_carry.py's parts protocol: an archive split here, the parts arriving
one call at a time there, unpacked only once all have come whole."""

from __future__ import annotations

import argparse
import importlib.util
import random
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "dev" / "vllm_carry.py"
spec = importlib.util.spec_from_file_location("vllm_carry", SCRIPT)
assert spec is not None
assert spec.loader is not None
carry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(carry)


def source_tree(root: Path) -> dict[str, bytes]:
    """A small package tree, with a file larger than a part."""
    files = {
        "pkg/__init__.py": b"VERSION = 1\n",
        "pkg/kernel.so": random.Random(0).randbytes(5000),  # incompressible: several parts
        "pkg-1.0.dist-info/METADATA": b"Name: pkg\n",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def archive_of(site: Path, path: Path) -> None:
    with tarfile.open(path, "w:xz") as tar:
        tar.add(site, arcname=".")


def receive(tmp: Path) -> tuple[int, argparse.Namespace]:
    args = argparse.Namespace(
        carry=tmp / "repo" / ".carry", parts=tmp / "repo" / ".carry-received", site=tmp / "site"
    )
    return carry.receive(args, machine=(carry.PYTHON, carry.TORCH + "+cu130")), args


def test_parts_arrive_one_call_at_a_time_and_unpack_when_all_have(tmp_path: Path) -> None:
    files = source_tree(tmp_path / "src")
    archive = tmp_path / carry.ARCHIVE
    archive_of(tmp_path / "src", archive)
    made = tmp_path / "made"
    parts = carry.split(archive, made, part_bytes=1024)
    assert len(parts) == -(-archive.stat().st_size // 1024) >= 3
    assert b"".join(p.read_bytes() for p in parts) == archive.read_bytes()
    assert all(p.stat().st_size <= 1024 for p in parts)

    status, args = receive(tmp_path)
    assert status == 3  # nothing carried yet
    for k, part in enumerate(parts, 1):
        # Each call carries one part's folder; the one before it is replaced, as the device
        # tool replaces a carried path, so only what `receive` kept counts.
        shutil.rmtree(args.carry, ignore_errors=True)
        shutil.copytree(part.parent, args.carry / part.parent.name)
        status, _ = receive(tmp_path)
        assert status == (0 if k == len(parts) else 3)
    assert {
        str(p.relative_to(args.site)): p.read_bytes()
        for p in args.site.rglob("*")
        if p.is_file() and p.name != ".unpacked"
    } == files
    assert receive(tmp_path)[0] == 0  # a later call finds the site ready


def test_a_damaged_part_is_waited_for_not_unpacked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source_tree(tmp_path / "src")
    archive = tmp_path / carry.ARCHIVE
    archive_of(tmp_path / "src", archive)
    parts = carry.split(archive, tmp_path / "made", part_bytes=1024)
    args = receive(tmp_path)[1]
    for part in parts:
        shutil.copytree(part.parent, args.carry / part.parent.name)
    damaged = args.carry / parts[1].parent.name / parts[1].name
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    assert receive(tmp_path)[0] == 3
    assert f"waiting for {parts[1].name}" in capsys.readouterr().out
    assert not args.site.exists()


def test_the_chained_stream_reads_across_part_boundaries(tmp_path: Path) -> None:
    paths = []
    for k, data in enumerate([b"abc", b"", b"defgh", b"i"]):
        paths.append(tmp_path / str(k))
        paths[-1].write_bytes(data)
    stream = carry.Chained(paths)
    assert [stream.read(2), stream.read(4), stream.read(-1), stream.read(5)] == [
        b"ab", b"cdef", b"ghi", b""
    ]  # fmt: skip


def test_the_script_runs_on_the_standard_library_alone() -> None:
    """``receive`` runs on the lent machine's Python, where nothing can be installed."""
    probe = (
        "import sys, runpy\n"
        "sys.argv = ['vllm_carry', '--help']\n"
        f"try:\n    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code == 0\n"
        "third = [m for m in sys.modules if m.split('.')[0] in ('turnrl', 'torch', 'numpy')]\n"
        "assert not third, third\n"
    )
    done = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "{pack,receive,check-imports}" in done.stdout


def test_a_machine_the_parts_are_not_built_for_is_refused_before_any_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A changed image (another torch or Python) stops the first call, not the last."""
    assert carry.machine_problem(carry.PYTHON, carry.TORCH + "+cu130") is None
    for python, torch in [
        ((3, 11), carry.TORCH),
        (carry.PYTHON, "2.13.0+cu130"),
        (carry.PYTHON, None),
    ]:
        assert "the parts are built for Python 3.12 and torch 2.11.0" in str(
            carry.machine_problem(python, torch)
        )
    args = argparse.Namespace(
        carry=tmp_path / ".carry", parts=tmp_path / ".carry-received", site=tmp_path / "site"
    )
    (args.carry / "vllm-1").mkdir(parents=True)
    assert carry.receive(args, machine=((3, 12), "2.14.0")) == 4
    assert "this machine has Python 3.12, torch 2.14.0" in capsys.readouterr().out
    assert not args.parts.exists()
