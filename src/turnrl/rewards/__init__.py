"""Rewards: plain functions that score a final answer, no torch.

A verifier returns a ``Verdict``: the scalar reward, whether the task counts as solved, and
the named components the reward was built from (each one is logged separately).
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
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


_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT_RE = re.compile(r"[^\w\s]")


def normalize_qa(text: str) -> str:
    """SQuAD's answer normalisation (as Search-R1 scores): NFKC, lower case, punctuation
    and the articles a/an/the removed, whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = _ARTICLES_RE.sub(" ", _PUNCT_RE.sub(" ", text))
    return " ".join(text.split())


def qa_exact_match(answer: str, golds: str | Sequence[str]) -> bool:
    """Whether the normalised answer equals one normalised gold answer (the whole answer:
    a list of candidates or the gold inside a sentence does not match)."""
    golds = [golds] if isinstance(golds, str) else golds
    norm = normalize_qa(answer)
    return bool(norm) and any(norm == normalize_qa(g) for g in golds)


def qa_f1(answer: str, golds: str | Sequence[str]) -> float:
    """The best token F1 between the normalised answer and a normalised gold answer."""
    golds = [golds] if isinstance(golds, str) else golds
    predicted = normalize_qa(answer).split()
    best = 0.0
    for gold in golds:
        truth = normalize_qa(gold).split()
        common = sum((Counter(predicted) & Counter(truth)).values())
        if common:
            precision, recall = common / len(predicted), common / len(truth)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def qa_verdict(answer: str, golds: str | Sequence[str]) -> Verdict:
    """Reward = exact match (after ``normalize_qa``); token F1 logged beside it."""
    em = qa_exact_match(answer, golds)
    return Verdict(float(em), em, {"exact_match": float(em), "f1": qa_f1(answer, golds)})
