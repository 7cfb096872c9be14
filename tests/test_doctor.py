"""`turnrl doctor`: the facts it prints and a self-check that fails loudly."""

from __future__ import annotations

import pytest

from turnrl import doctor
from turnrl.cli import main


def test_doctor_reports_facts_and_passes_its_self_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for expected in ("python", "torch", "cpu cores", "sandbox", "extra mcp", "extra lora",
                     "precision", "bf16-mixed", "attention", "checkpointing", "self-check:"):  # fmt: skip
        assert expected in out
    assert "ok   rl run: 2 learner steps, checkpoint written" in out
    assert "ok   sandbox call" in out
    assert "FAIL" not in out


def test_a_failing_check_is_named_and_sets_the_exit_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken() -> str:
        raise RuntimeError("index is broken")

    monkeypatch.setattr(doctor, "_check_search", broken)
    monkeypatch.setattr(doctor, "_check_training", lambda: "skipped")
    assert main(["doctor"]) == 1
    assert "FAIL bm25 search: RuntimeError: index is broken" in capsys.readouterr().out
