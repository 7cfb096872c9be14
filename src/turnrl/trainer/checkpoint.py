"""Resumable checkpoints, written atomically (DESIGN.md invariant 7).

The policy RL starts from is kept in ``start_model`` (the KL reference, loaded again on
resume; with LoRA, the base the adapters sit on). A checkpoint is a directory
``checkpoints/step_NNNNNN`` holding the model and tokenizer (``save_pretrained``, loadable
by the Auto classes; with LoRA only the adapters, in peft's layout), the optimizer state and the trainer
state (step, policy version). It is written under a temporary name and renamed into place,
and ``checkpoints/latest`` is replaced atomically after it, so a run killed at any moment
leaves the previous checkpoint intact. Sampling seeds derive from (seed, step, task,
sample), so step and weights are all a resumed run needs to continue the same run.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from turnrl.errors import ConfigError
from turnrl.models.lora import save_model


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
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.step:06d}"
    tmp = root / f".tmp-step_{state.step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tmp / "model")  # only the adapters of a LoRA model
    tokenizer.save_pretrained(tmp / "model")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if extra is not None:
        torch.save(extra, tmp / "extra.pt")
    (tmp / "state.json").write_text(json.dumps(state.__dict__))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(root / "latest", final.name)
    return final


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


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def load_extra(checkpoint: Path) -> dict[str, Any] | None:
    """What ``save_checkpoint`` stored as ``extra``, or None."""
    path = checkpoint / "extra.pt"
    return torch.load(path, weights_only=True) if path.is_file() else None  # type: ignore[no-any-return]


def load_trainer_state(checkpoint: Path, optimizer: torch.optim.Optimizer) -> TrainerState:
    optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", weights_only=True))
    data = json.loads((checkpoint / "state.json").read_text())
    return TrainerState(step=int(data["step"]), policy_version=int(data["policy_version"]))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def export_model(source: Path, out: Path, step: int | None = None) -> Path:
    """Write the policy of ``source`` to ``out`` as one plain ``save_pretrained`` model (the
    tokenizer beside it), loadable by ``AutoModelForCausalLM`` and by vLLM with no turnrl.

    ``source``: a run directory (its latest checkpoint, or checkpoint ``step``) or a
    checkpoint directory. LoRA adapters are merged into their base. Returns the
    checkpoint's model directory that was exported. Refuses a non-empty ``out``."""
    from turnrl.models.loading import load_model, load_tokenizer

    source = Path(source)
    if step is not None:
        checkpoint: Path | None = source / "checkpoints" / f"step_{step:06d}"
    elif (source / "model").is_dir():
        checkpoint = source
    else:
        checkpoint = latest_checkpoint(source)
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
