"""Resumable checkpoints, written atomically (docs/design.md, invariant 7).

The policy RL starts from is kept in ``start_model`` (the KL reference, loaded again on
resume; with LoRA, the base the adapters sit on). A checkpoint is a directory
``checkpoints/step_NNNNNN`` holding the model and tokenizer (``save_pretrained``, loadable
by the Auto classes; with LoRA only the adapters, in peft's layout), the optimizer state and the trainer
state (step, policy version). It is written under a temporary name and renamed into place,
and ``checkpoints/latest`` is replaced atomically after it, so a run killed at any moment
leaves the previous checkpoint intact. Sampling seeds derive from (seed, step, task,
sample), so step and weights are all a resumed run needs to continue the same run.

Integrity: the last file written into a checkpoint is ``manifest.json``, every other file
with its size and SHA-256 (each file is fsync'd first, the manifest written atomically).
A resume (``latest_checkpoint``) checks the newest checkpoint against it; a damaged one (a
file missing, truncated or changed: a disk error, a half-finished copy of the run) is
reported with what is wrong and the next older one is tried. Checkpoints written before
manifests existed are checked for structure only (``_structure_problems``): the files a
resume loads are there, ``.pt`` files end with their zip directory, and ``.safetensors``
files are as long as their header says.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from turnrl.errors import ConfigError, TurnrlError
from turnrl.models.lora import save_model

MANIFEST = "manifest.json"
"""Each file of a checkpoint with its size and SHA-256, written last."""

logger = logging.getLogger(__name__)


class CheckpointWriteError(TurnrlError):
    """A checkpoint could not be written (a full disk, an I/O error): the run stops, the
    checkpoints before it stay whole, and ``--resume`` continues from the newest."""


class RunWriteError(TurnrlError):
    """The run's files (metrics, trajectories, alarms) could not be written: the disk is
    full. The run stops; its checkpoints stay whole and ``--resume`` continues."""


@dataclass(frozen=True)
class TrainerState:
    """Where a run stands: the next step to run and the policy version."""

    step: int
    policy_version: int


def save_checkpoint(
    run_dir: Path,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    state: TrainerState,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``checkpoints/step_N`` atomically; ``extra`` (e.g. the critic's state) goes to
    ``extra.pt``."""
    root = run_dir / "checkpoints"
    final = root / f"step_{state.step:06d}"
    tmp = root / f".tmp-step_{state.step:06d}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(model, tmp / "model")  # only the adapters of a LoRA model
        tokenizer.save_pretrained(tmp / "model")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if extra is not None:
            torch.save(extra, tmp / "extra.pt")
        (tmp / "state.json").write_text(json.dumps(state.__dict__))
        _write_manifest(tmp)
        if final.exists():  # moved aside first: a half-deleted checkpoint would look whole
            old = root / f".old-{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            shutil.rmtree(old)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_atomic(root / "latest", final.name)
    except Exception as exc:  # torch and safetensors wrap OSError in their own errors
        shutil.rmtree(tmp, ignore_errors=True)  # the space it took, and no half checkpoint
        raise CheckpointWriteError(_write_failure(root, final, exc)) from exc
    return final


def _write_failure(root: Path, final: Path, exc: Exception) -> str:
    """What went wrong writing checkpoint ``final`` into ``root``: the error, the disk's
    free space and mount point, the checkpoint a resume will use."""
    name = final.name
    before = sorted(p.name for p in root.glob("step_*") if p != final) if root.is_dir() else []
    kept = f"{before[-1]}, the one before, is untouched" if before else "there is no earlier one"
    done = "it is whole" if final.is_dir() and not checkpoint_problems(final) else "none of it kept"
    return (
        f"could not write checkpoint {name} in {root}: {type(exc).__name__}: {exc}. "
        f"{disk_report(root)} Of {name}: {done}; {kept}. Free space (or fix the disk), then "
        "continue with --resume."
    )


def disk_report(path: Path) -> str:
    """ "The disk holding it (mounted at M) has F MiB free of T MiB." for ``path``."""
    where = path.resolve()
    while not where.exists():
        where = where.parent
    mount = where
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        usage = shutil.disk_usage(where)
        space = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"
    except OSError:
        space = "free space unknown"
    return f"The disk holding it (mounted at {mount}) has {space}."


def _write_manifest(checkpoint: Path) -> None:
    """Record every file of ``checkpoint`` (size, SHA-256), each fsync'd before the record
    of it is, so a manifest on disk never vouches for data still in the page cache."""
    files = {}
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        files[path.relative_to(checkpoint).as_posix()] = {
            "bytes": path.stat().st_size,
            "sha256": _sha256(path, sync=True),
        }
    _write_atomic(checkpoint / MANIFEST, json.dumps({"files": files}, indent=1) + "\n")
    _fsync_dir(checkpoint)


def save_start_policy(run_dir: Path, model: Any, tokenizer: Any) -> Path:
    """Save the policy RL starts from (after the warm-up) to ``run_dir/start_model``.

    It is the reference policy of the KL term, so a resumed run must use the same one; it is
    also "the warm-up checkpoint" that RL-only experiments start from.
    """
    final = run_dir / "start_model"
    tmp = run_dir / ".tmp-start_model"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def latest_checkpoint(run_dir: Path, warn: Callable[[str], None] = logger.warning) -> Path | None:
    """The newest whole checkpoint of ``run_dir``; None when it has no checkpoint at all.

    Checkpoints are tried newest step first (``checkpoints/latest`` names the newest one a
    run finished writing, but a run killed between renaming a checkpoint into place and
    updating ``latest`` leaves a newer whole one). Each damaged one is passed to ``warn``
    with what is wrong, and the next older one is tried; when none is whole, ``ConfigError``
    lists what was wrong with each."""
    root = run_dir / "checkpoints"
    found = [p for p in root.glob("step_*") if re.fullmatch(r"step_\d+", p.name) and p.is_dir()]
    rejected = []
    for checkpoint in sorted(found, key=lambda p: int(p.name[5:]), reverse=True):
        problems = checkpoint_problems(checkpoint)
        if not problems:
            return checkpoint
        rejected.append(f"{checkpoint.name}: {'; '.join(problems)}")
        warn(f"checkpoint {checkpoint} is damaged ({'; '.join(problems)}); skipping it")
    if rejected:
        raise ConfigError(
            f"no usable checkpoint in {root}, every one is damaged: " + " | ".join(rejected)
        )
    return None


def checkpoint_problems(checkpoint: Path) -> list[str]:
    """What is wrong with ``checkpoint`` (empty when it is whole): each file its manifest
    lists must be there with the recorded size and SHA-256. Without a manifest (written
    before turnrl recorded one) only its structure is checked (``_structure_problems``)."""
    manifest = checkpoint / MANIFEST
    if not manifest.is_file():
        return _structure_problems(checkpoint)
    try:
        files = {
            str(name): (int(record["bytes"]), str(record["sha256"]))
            for name, record in json.loads(manifest.read_text())["files"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError):
        return [f"{MANIFEST} is unreadable"]
    problems = []
    for name, (size, _) in files.items():
        path = checkpoint / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} has {path.stat().st_size} bytes, not {size} (truncated?)")
    if problems:  # hashing the rest would tell nothing more
        return problems
    return [
        f"{name} does not match its SHA-256 (changed after it was written)"
        for name, (_, digest) in files.items()
        if _sha256(checkpoint / name) != digest
    ]


def _structure_problems(checkpoint: Path) -> list[str]:
    """For a checkpoint without a manifest: the files a resume loads are there and none is
    cut short (a zip directory at the end of each ``.pt`` file, as torch.save writes them;
    a ``.safetensors`` file as long as its header says; every shard of a sharded model)."""
    problems = []
    try:
        int(json.loads((checkpoint / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        problems.append("state.json is missing or unreadable")
    model = checkpoint / "model"
    if not any((model / name).is_file() for name in ("config.json", "adapter_config.json")):
        problems.append("model/ has no config.json or adapter_config.json")
    if not (model / "tokenizer_config.json").is_file():
        problems.append("model/tokenizer_config.json is missing")
    weights = [*model.glob("*.safetensors"), *model.glob("*.bin")]
    for index in model.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            problems.append(f"model/{index.name} is unreadable")
            continue
        problems += [f"model/{s} is missing" for s in sorted(shards) if not (model / s).is_file()]
    if not weights:
        problems.append("model/ holds no weights")
    for path in sorted(checkpoint.rglob("*")):
        name = path.relative_to(checkpoint).as_posix()
        if path.suffix == ".pt" and not zipfile.is_zipfile(path):
            problems.append(f"{name} is cut short or not a torch.save file")
        elif path.suffix == ".safetensors" and not _safetensors_whole(path):
            problems.append(f"{name} is shorter or longer than its header says")
    if not (checkpoint / "optimizer.pt").is_file():
        problems.append("optimizer.pt is missing")
    return problems


def _safetensors_whole(path: Path) -> bool:
    """Whether ``path`` is exactly as long as its header says: an 8-byte little-endian
    header length, the JSON header, then the tensors' bytes up to the largest end offset."""
    try:
        with path.open("rb") as f:
            length = int(struct.unpack("<Q", f.read(8))[0])
            header = json.loads(f.read(length))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError):
        return False
    return path.stat().st_size == 8 + length + max(ends, default=0)


def checkpoint_state(checkpoint: Path) -> TrainerState:
    """The trainer state ``checkpoint`` holds (its ``state.json``)."""
    data = json.loads((checkpoint / "state.json").read_text())
    return TrainerState(step=int(data["step"]), policy_version=int(data["policy_version"]))


def load_extra(checkpoint: Path) -> dict[str, Any] | None:
    """What ``save_checkpoint`` stored as ``extra``, or None."""
    path = checkpoint / "extra.pt"
    return torch.load(path, weights_only=True) if path.is_file() else None  # type: ignore[no-any-return]


def load_trainer_state(checkpoint: Path, optimizer: torch.optim.Optimizer) -> TrainerState:
    optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", weights_only=True))
    return checkpoint_state(checkpoint)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: Path, sync: bool = False) -> str:
    """The file's SHA-256 (hex); with ``sync``, fsync'd too (Linux flushes a file's dirty
    pages through any descriptor of it)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def _fsync_dir(directory: Path) -> None:
    """Make renames into ``directory`` durable (where the platform allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def policy_checkpoint(source: Path) -> Path | None:
    """The checkpoint a directory names: ``source`` itself when it is one (it holds
    ``model/``, a manifest or a trainer state; checked against its manifest), else the newest whole checkpoint of the run
    directory ``source`` (``latest_checkpoint``); None when it is neither (a plain model
    directory, or a run without checkpoints). Its policy is ``checkpoint / "model"``."""
    source = Path(source)
    if any((source / name).exists() for name in ("model", MANIFEST, "state.json")):
        problems = checkpoint_problems(source) if (source / MANIFEST).is_file() else []
        if problems:
            raise ConfigError(f"{source} is damaged: {'; '.join(problems)}")
        return source
    return latest_checkpoint(source)  # the newest whole one, checked


def export_model(source: Path, out: Path, step: int | None = None) -> Path:
    """Write the policy of ``source`` to ``out`` as one plain ``save_pretrained`` model (the
    tokenizer beside it), loadable by ``AutoModelForCausalLM`` and by vLLM with no turnrl.

    ``source``: a run directory (its latest checkpoint, or checkpoint ``step``) or a
    checkpoint directory. LoRA adapters are merged into their base. Returns the
    checkpoint's model directory that was exported. Refuses a non-empty ``out``."""
    from turnrl.models.loading import load_model, load_tokenizer

    source = Path(source)
    named = source / "checkpoints" / f"step_{step:06d}" if step is not None else source
    checkpoint = policy_checkpoint(named)
    if checkpoint is None or not (checkpoint / "model").is_dir():
        where = checkpoint if checkpoint is not None else source / "checkpoints" / "latest"
        raise ConfigError(
            f"nothing to export at {where}: give a run directory with checkpoints "
            "(checkpoints/latest), --step N of one of its checkpoints, or a checkpoint "
            "directory (one holding model/)"
        )
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; choose another output directory")
    model = load_model(checkpoint / "model")
    tokenizer = load_tokenizer(checkpoint / "model")
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return checkpoint / "model"
