"""Rewards: plain functions that score a final answer, no torch.

A verifier returns a ``Verdict``: the scalar reward, whether the task counts as solved, and
the named components the reward was built from (each one is logged separately).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Verdict:
    """A verifier's judgement of one answer."""

    reward: float
    success: bool
    components: dict[str, float] = field(default_factory=dict)


def normalize_answer(text: str) -> str:
    """Lower-case, NFKC, strip punctuation at the ends and collapse whitespace."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = re.sub(r"\s+", " ", text).strip()
    return text.strip(" .,;:!?\"'`")


def exact_match(answer: str, gold: str) -> Verdict:
    """1.0 when the normalised answer equals the normalised gold string, else 0.0.

    The whole answer must match: a gold string buried in a longer answer scores 0, so
    listing many candidates is not rewarded.
    """
    ok = normalize_answer(answer) == normalize_answer(gold)
    return Verdict(reward=float(ok), success=ok, components={"correct": float(ok)})
