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


def test_doctor_lists_what_the_sandbox_cannot_enforce(monkeypatch: pytest.MonkeyPatch) -> None:
    from turnrl.tools import sandbox

    monkeypatch.setitem(sandbox._PROBED, ("cgroups",), (None, "no delegation here"))
    monkeypatch.setitem(sandbox._PROBED, ("workspace",), (None, "no mounts here"))
    lines = doctor._sandbox_lines()
    assert "NOT enforced" in lines[0] or "does NOT isolate" in lines[0]
    assert any("no control group per slot (no delegation here)" in line for line in lines)
    assert any("slot's total memory" in line for line in lines)
    assert any("work dir is not size-limited (no mounts here)" in line for line in lines)
