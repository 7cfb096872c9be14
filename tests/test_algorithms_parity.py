"""turnrl's 2026 masks and losses against verl's own functions: every stored case of
benchmarks/data/verl_reference_2026.json (produced by verl 0.9.1's functions) within 1e-6
(benchmarks/parity_2026.py, which writes the table, says how each is compared)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import parity_2026

CASES = json.loads(parity_2026.REFERENCE.read_text())["cases"]


def test_every_function_of_the_reference_is_compared() -> None:
    assert {c["function"] for c in CASES} == set(parity_2026.TURNRL)
    assert set(parity_2026.TURNRL) == set(parity_2026.CONVENTIONS) == set(parity_2026.VERL)


@pytest.mark.parametrize("case", CASES, ids=[f"{c['function']}-{i}" for i, c in enumerate(CASES)])
def test_turnrl_matches_verl(case: dict[str, object]) -> None:
    diffs = parity_2026.compare(case)  # type: ignore[arg-type]
    assert diffs
    assert max(diffs.values()) <= parity_2026.TOLERANCE, diffs
