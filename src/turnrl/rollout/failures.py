"""Episodes that raised: a bug, not data (docs/design.md, invariant 4's other half).

The model's mistakes (a malformed call, bad arguments, an unknown tool, a tool's error)
are observations the model reads. An exception raised by the environment, a tool factory,
the verifier or the backend is recorded on the trajectory (``error``, with its traceback
in ``info["traceback"]``) and is a failure of the code around the model. Training on
what is left would hide a bug behind a slowly learning run, so ``check_failures`` stops
the run unless the user allowed a share of failures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from turnrl.errors import EpisodeFailures
from turnrl.types import Trajectory

MAX_MESSAGES = 5
"""Distinct error messages a report lists (the rest are counted)."""


def error_counts(trajectories: Sequence[Trajectory]) -> Counter[str]:
    """Each distinct error message of ``trajectories`` with how many episodes ended on it."""
    return Counter(t.error for t in trajectories if t.error is not None)


def failure_report(trajectories: Sequence[Trajectory]) -> str:
    """The failed episodes' distinct messages with their counts, then the first failure's
    traceback."""
    counts = error_counts(trajectories)
    lines = [f"  {n}x {message}" for message, n in counts.most_common(MAX_MESSAGES)]
    if len(counts) > MAX_MESSAGES:
        lines.append(f"  ... and {len(counts) - MAX_MESSAGES} other message(s)")
    first = next((t for t in trajectories if t.error is not None), None)
    if first is not None and first.info.get("traceback"):
        where = f"task {first.task_id}, sample {first.sample_index}"
        lines += [f"the first failure's traceback ({where}):", str(first.info["traceback"])]
    return "\n".join(lines)


def check_failures(trajectories: Sequence[Trajectory], max_error_frac: float, where: str) -> int:
    """Raise ``EpisodeFailures`` when more than ``max_error_frac`` of ``trajectories``
    failed, or every one did; else return how many failed."""
    failed = sum(t.error is not None for t in trajectories)
    total = len(trajectories)
    if failed == 0 or (failed < total and failed <= max_error_frac * total):
        return failed
    allowed = (
        "none is allowed (rollout.max_error_frac = 0)"
        if max_error_frac == 0
        else f"rollout.max_error_frac = {max_error_frac:g}"
    )
    advice = (
        "Nothing is left to train on."
        if failed == total
        else "Fix it, or let a share of episodes fail: --set rollout.max_error_frac=0.05."
    )
    raise EpisodeFailures(
        f"{where}: {failed} of {total} episodes raised an exception and {allowed}. An "
        "exception is a bug in the environment, a tool factory, the verifier or the backend "
        "(the model's own mistakes are observations, never this). "
        f"{advice}\n{failure_report(trajectories)}"
    )
