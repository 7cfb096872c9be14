"""Carry vLLM to the lent GPU machine, which has none and cannot reach a package index.

That machine (the device tool's nvidia kinds; see dev/gpu_vllm_checks.sh) runs
Python 3.12 with torch 2.11.0+cu130 and takes at most 64 MiB of files a call, where vLLM's
CUDA wheel alone is 290 MiB. So the set of dev/vllm-gpu.txt is packed here and
sent in parts, one part a call, calls back to back while the machine stays warm:

- ``pack`` (here): installs dev/vllm-gpu.txt for CPython 3.12 on x86-64 into a
  folder, leaves out the parts of vLLM that a dense model on a Hopper GPU does not load
  (``STRIP``), packs the folder as one .tar.xz and splits it into parts of at most
  ``--part-mib`` MiB, each in a folder of its own under ``--out`` (.carry/vllm-1, ...),
  each with a manifest of every part's SHA-256. It prints the calls to make.
- ``receive`` (there, standard library only): copies the parts the call carried into a
  folder git ignores (``--parts``: the device tool keeps ignored files between the calls
  of a warm machine, where a carried path is replaced by the next call's), checks
  their SHA-256, and once every part is there, unpacks them into ``--site``. Exits 0 when
  the site is ready, 3 while parts are missing (it names them), 4 at once where the
  machine's Python or torch is not the one the parts are built for.
- ``check-imports`` (here): imports, with an interpreter given by ``--python`` and the
  packed site first on its path, the modules a colocated engine loads (``MODULES``) and
  turnrl's own needs (``OWN``); vLLM's CUDA kernels are replaced by an empty module,
  since they need a GPU driver to load. A missing package fails it.

    python3 dev/vllm_carry.py pack
    python3 dev/vllm_carry.py check-imports --python /path/to/python3.12
    python3 dev/vllm_carry.py receive          # on the lent machine, every call
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "dev" / "vllm-gpu.txt"
PLATFORMS = [
    "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
]  # fmt: skip
"""The wheel tags pip may take: the lent machine is x86-64 with a recent glibc."""
STRIP = [
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/vllm-rs",
    "vllm/third_party/deep_gemm",
    "vllm/third_party/fmha_sm100",
]
"""Left out of the site (relative paths), 430 MB of 940: FlashAttention 2's kernels (on a
Hopper GPU vLLM runs FlashAttention 3, whose kernels stay, and its import of FA2 is
optional), the Rust front end (off unless ``VLLM_RUST_FRONTEND_PATH`` asks for it),
DeepGEMM (FP8 matrix products) and the SM100 (Blackwell) attention sources. Each must exist
when packing, so that a new vLLM version that moves one is noticed."""
MODULES = [
    "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core",
    "vllm.platforms.cuda", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.executor.uniproc_executor", "vllm.v1.sample.sampler",
    "vllm.v1.sample.ops.topk_topp_sampler", "vllm.v1.structured_output", "vllm.lora.request",
    "vllm.model_executor.model_loader.default_loader", "vllm.model_executor.models.qwen2",
    "vllm.model_executor.models.qwen3", "vllm.model_executor.models.llama",
    "vllm.model_executor.models.mistral",
]  # fmt: skip
"""What a colocated engine on CUDA imports: the offline ``LLM``, the engine and its
in-process executor, the GPU worker and model runner, two attention backends, the
sampler, structured outputs, LoRA requests, the loader and four model families."""
OWN = ["ray", "tensorboardX", "bm25s"]
"""turnrl's own needs that the lent machine's image lacks."""
PYTHON = (3, 12)
TORCH = "2.11.0"
"""The lent machine's Python and torch, which the packed site is built for: vLLM's kernels
are compiled against this torch, and the site's extensions for this Python."""
RECEIVE = "python3 dev/vllm_carry.py receive"
ARCHIVE = "vllm-gpu.tar.xz"
MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- pack


def build_site(site: Path, requirements: Path = REQUIREMENTS) -> None:
    """``requirements`` installed for CPython 3.12 on x86-64 into ``site``, less ``STRIP``."""
    if site.exists():
        shutil.rmtree(site)
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
         "--only-binary=:all:", "--python-version", ".".join(map(str, PYTHON)),
         "--implementation", "cp", *platforms, "--target", str(site), "-r", str(requirements)],
        check=True,
    )  # fmt: skip
    for relative in STRIP:
        path = site / relative
        if not path.exists():
            raise SystemExit(f"vllm_carry: {relative} is not in the site: update STRIP")
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def split(archive: Path, out: Path, part_bytes: int) -> list[Path]:
    """``archive`` cut into parts of at most ``part_bytes``, part k in ``out``/vllm-k/,
    each folder with the manifest (every part's name and SHA-256, the whole's SHA-256)."""
    for old in out.glob("vllm-*"):
        shutil.rmtree(old)
    parts: list[Path] = []
    with archive.open("rb") as f:
        while block := f.read(part_bytes):
            k = len(parts) + 1
            path = out / f"vllm-{k}" / f"{ARCHIVE}.{k}"
            path.parent.mkdir(parents=True)
            path.write_bytes(block)
            parts.append(path)
    manifest = {
        "archive": ARCHIVE,
        "sha256": sha256(archive),
        "parts": [{"name": p.name, "sha256": sha256(p), "bytes": p.stat().st_size} for p in parts],
    }
    for path in parts:
        (path.parent / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return parts


def pack(args: argparse.Namespace) -> None:
    site = args.work / "site"
    build_site(site)
    archive = args.work / ARCHIVE
    with archive.open("wb") as f:
        tar = subprocess.Popen(["tar", "-C", str(site), "-cf", "-", "."], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-9", "-T0", "-c"], stdin=tar.stdout, stdout=f, check=True)
        if tar.wait() != 0:
            raise SystemExit("vllm_carry: tar failed")
    parts = split(archive, args.out, args.part_mib << 20)
    size = sum(p.stat().st_size for p in parts) / 2**20
    print(f"{archive}: {size:.1f} MiB in {len(parts)} parts under {args.out}")
    print("Calls, back to back (the lent machine stays warm 30 s after each):")
    for k, part in enumerate(parts, 1):
        carry = [os.path.relpath(part.parent, ROOT)]
        last = k == len(parts)
        command = "bash dev/gpu_vllm_checks.sh" if last else RECEIVE
        print(f"  {k}. carry {carry}: {command}")
    for k, checks in enumerate(("learn", "async"), len(parts) + 1):
        print(f"  {k}. nothing carried: CHECKS={checks} bash dev/gpu_vllm_checks.sh")


# --------------------------------------------------------------------------- receive


def missing_parts(parts_dir: Path) -> list[str]:
    """The parts the manifest names that are not in ``parts_dir`` with their SHA-256."""
    manifest = json.loads((parts_dir / MANIFEST).read_text())
    return [
        part["name"]
        for part in manifest["parts"]
        if not (parts_dir / part["name"]).is_file()
        or sha256(parts_dir / part["name"]) != part["sha256"]
    ]


class Chained:
    """The parts read one after another as one stream (no joined copy on disk)."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.files: Iterator[IO[bytes]] = (p.open("rb") for p in paths)
        self.current: IO[bytes] | None = next(self.files, None)

    def read(self, size: int = -1) -> bytes:
        out = b""
        while self.current is not None and (size < 0 or len(out) < size):
            block = self.current.read(-1 if size < 0 else size - len(out))
            if block:
                out += block
                continue
            self.current.close()
            self.current = next(self.files, None)
        return out


def machine_problem(python: tuple[int, int], torch: str | None) -> str | None:
    """Why the packed site cannot run under ``python`` and ``torch`` (versions), if so."""
    if python != PYTHON or torch is None or torch.split("+")[0] != TORCH:
        have = f"Python {'.'.join(map(str, python))}, torch {torch or 'not installed'}"
        return (
            f"the parts are built for Python {'.'.join(map(str, PYTHON))} and torch {TORCH} "
            f"(vLLM's kernels are compiled against it); this machine has {have}: pack a vLLM "
            "that pins this torch (dev/vllm-gpu.txt says how the list was made)"
        )
    return None


def installed_torch() -> str | None:
    """torch's version from its metadata, without importing it (seconds on a GPU machine)."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def receive(args: argparse.Namespace, machine: tuple[Any, str | None] | None = None) -> int:
    """See the module's docstring; ``machine``: (Python, torch) versions, this one's by
    default."""
    python, torch = machine or (sys.version_info[:2], installed_torch())
    problem = machine_problem(tuple(python), torch)
    if problem:  # before any part is kept: the calls left are better spent elsewhere
        print(f"vllm_carry: {problem}")
        return 4
    args.parts.mkdir(parents=True, exist_ok=True)
    for folder in sorted(args.carry.glob("vllm-*")):
        for path in folder.iterdir():
            shutil.copy2(path, args.parts / path.name)
    if not (args.parts / MANIFEST).is_file():
        print(f"vllm_carry: no part has arrived ({args.carry}/vllm-*/ is empty)")
        return 3
    missing = missing_parts(args.parts)
    if missing:
        print(f"vllm_carry: waiting for {', '.join(missing)} (parts kept in {args.parts})")
        return 3
    done = args.site / ".unpacked"
    manifest = json.loads((args.parts / MANIFEST).read_text())
    if done.is_file() and done.read_text() == manifest["sha256"]:
        print(f"vllm_carry: {args.site} is ready")
        return 0
    if args.site.exists():
        shutil.rmtree(args.site)
    args.site.mkdir(parents=True)
    stream: Any = Chained([args.parts / part["name"] for part in manifest["parts"]])
    with tarfile.open(fileobj=stream, mode="r|xz") as tar:
        tar.extractall(args.site, filter="data")
    done.write_text(manifest["sha256"])
    print(f"vllm_carry: unpacked {len(manifest['parts'])} parts into {args.site}")
    return 0


# --------------------------------------------------------------------------- check-imports

PROBE = """
import importlib, sys, types
sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
import torch, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}, Python {sys.version.split()[0]}")
print("\\n".join(failed) or f"all {len(sys.argv) - 1} modules imported")
sys.exit(1 if failed else 0)
"""


def check_imports(args: argparse.Namespace) -> int:
    environment = {**os.environ, "PYTHONPATH": str(args.work / "site")}
    environment.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    probe = [args.python, "-c", PROBE, *MODULES, *OWN]
    done = subprocess.run(probe, env=environment, check=False)
    return done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["pack", "receive", "check-imports"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/vllm-carry"),
                        help="pack: where the site and the archive are made")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / ".carry",
                        help="pack: where the parts go (git ignores it)")  # fmt: skip
    parser.add_argument(
        "--part-mib", type=int, default=56,
        help="pack: the largest part (a call also carries the repository)",
    )  # fmt: skip
    parser.add_argument("--carry", type=Path, default=ROOT / ".carry",
                        help="receive: where the call put its part")  # fmt: skip
    parser.add_argument(
        "--parts", type=Path, default=ROOT / ".carry-received",
        help="receive: where parts are kept between calls (an ignored folder of the repository, "
        "which the device tool keeps while the machine stays warm)",
    )  # fmt: skip
    parser.add_argument("--site", type=Path, default=Path("/tmp/vllm-site"),
                        help="receive: where the packages are unpacked")  # fmt: skip
    parser.add_argument("--python", default="python3.12",
                        help="check-imports: a Python 3.12 with torch 2.11")  # fmt: skip
    args = parser.parse_args()
    if args.action == "pack":
        pack(args)
    elif args.action == "receive":
        sys.exit(receive(args))
    else:
        sys.exit(check_imports(args))


if __name__ == "__main__":
    main()
