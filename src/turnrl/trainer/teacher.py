"""The teacher of on-policy distillation (``algorithm.teacher``): which model the path names,
loaded once and frozen, and the check that it reads the student's token ids as the student
does.

What lives elsewhere: the scoring, the learner's (``Learner.teacher_logprobs``: the no-grad,
micro-batched pass that also scores the KL reference); the per-token advantage, a pure
function (``turnrl.algorithms.distillation_advantages``), applied in the train step
(step.py, ``distill``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from turnrl.errors import ConfigError
from turnrl.models import load_model, load_tokenizer
from turnrl.trainer.checkpoint import policy_checkpoint

__all__ = ["check_vocabularies", "load_teacher", "teacher_model_path"]


def teacher_model_path(path: str) -> str | Path:
    """The model ``algorithm.teacher.path`` names: a checkpoint directory's policy, a run
    directory's newest whole checkpoint's (``policy_checkpoint``), else ``path`` itself (a
    model directory, a hub id, a GGUF file, a named model: whatever ``model.path`` takes).
    A run directory with no checkpoint is an error that says so."""
    local = Path(path).expanduser()
    if not local.is_dir():
        return path
    checkpoint = policy_checkpoint(local)
    if checkpoint is not None:
        return checkpoint / "model"
    run_files = ("metrics.jsonl", "checkpoints", "start_model")
    if not (local / "config.json").is_file() and any((local / f).exists() for f in run_files):
        raise ConfigError(
            f"algorithm.teacher.path = {path!r} is a run directory without a checkpoint: "
            "train it for at least one step (checkpoints are written every save_every steps "
            "and at the end), or give a model directory"
        )
    return path


def check_vocabularies(student: Any, teacher: Any, student_name: str, teacher_name: str) -> None:
    """Refuse a teacher whose tokenizer maps any token to another id than the student's, or
    has tokens the student's lacks: it scores the student's token ids, so the two must be
    one vocabulary. The error names both models and what differs."""
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if ours == theirs:
        return
    only_ours = sorted(set(ours) - set(theirs))
    only_theirs = sorted(set(theirs) - set(ours))
    moved = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])

    def some(tokens: list[str]) -> str:
        return f" (e.g. {', '.join(map(repr, tokens[:3]))})" if tokens else ""

    raise ConfigError(
        f"the teacher's tokenizer ({teacher_name}, {len(theirs)} tokens) differs from the "
        f"student's ({student_name}, {len(ours)} tokens): {len(only_ours)} tokens only in "
        f"the student's{some(only_ours)}, {len(only_theirs)} only in the teacher's"
        f"{some(only_theirs)}, {len(moved)} with another id{some(moved)}. On-policy "
        "distillation scores the student's token ids with the teacher, so both must share "
        "one vocabulary: use a teacher of the student's family and tokenizer"
    )


def load_teacher(
    path: str,
    student_tokenizer: Any,
    student_name: str,
    *,
    device: torch.device,
    attention: str = "auto",
) -> Any:
    """The teacher ``path`` names (``teacher_model_path``), its vocabulary checked against
    the student's (``check_vocabularies``), loaded once in float32 on ``device``, in eval
    mode and frozen (no parameter requires a gradient)."""
    where = teacher_model_path(path)
    name = path if str(where) == path else f"{path}, model {where}"
    check_vocabularies(student_tokenizer, load_tokenizer(where), student_name, name)
    teacher: Any = load_model(where, dtype=torch.float32, device=device, attention=attention)
    rows = int(teacher.get_input_embeddings().weight.shape[0])
    if rows < len(student_tokenizer.get_vocab()):
        raise ConfigError(
            f"the teacher ({name}) has {rows} embedding rows, fewer than the "
            f"{len(student_tokenizer.get_vocab())} tokens of the vocabulary it shares with "
            "the student: its checkpoint does not match its tokenizer"
        )
    return teacher.eval().requires_grad_(False)
