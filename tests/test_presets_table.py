"""The presets benchmark's table can grow row by row (``--merge``) and labels ablations."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import presets


def row(preset: str, variant: str = "", final: float = 0.5, seed: int = 0) -> dict[str, Any]:
    return {"preset": preset, "variant": variant, "final_success": final, "seed": seed}


def test_an_ablation_is_labelled_with_its_overrides() -> None:
    assert presets.label(row("dapo")) == "dapo"
    assert presets.label(row("dapo", "algorithm.kl_coef=0")) == "dapo (algorithm.kl_coef=0)"
    assert presets.label({"preset": "grpo"}) == "grpo"  # rows written before variants existed


def test_merge_replaces_what_was_re_run_and_keeps_the_rest_in_preset_order() -> None:
    old = [row("gigpo", final=1.0), row("dapo", final=0.1), row("grpo", final=0.9)]
    new = [row("dapo", final=0.8), row("dapo", "algorithm.kl_coef=0", final=0.09)]
    rows = presets.merged(old, new)
    assert [presets.label(r) for r in rows] == [
        "grpo",
        "dapo",
        "dapo (algorithm.kl_coef=0)",
        "gigpo",
    ]
    assert [r["final_success"] for r in rows] == [0.9, 0.8, 0.09, 1.0]


def test_merge_keys_rows_by_seed_too() -> None:
    old = [row("grpo", final=0.9, seed=0), row("grpo", final=0.4, seed=1)]
    new = [row("grpo", final=0.7, seed=1), row("grpo", final=0.6, seed=2)]
    rows = presets.merged(old, new)
    assert [(r["seed"], r["final_success"]) for r in rows] == [(0, 0.9), (1, 0.7), (2, 0.6)]


def test_a_results_file_of_one_seed_is_read_as_rows_of_that_seed() -> None:
    old = {"seed": 1, "budget_minutes": 15, "runs": [{"preset": "grpo", "final_success": 0.9}]}
    new = presets.upgraded(old)
    assert "seed" not in new
    assert new["runs"] == [{"preset": "grpo", "final_success": 0.9, "seed": 1}]


def test_a_run_that_reached_the_bar_and_then_collapsed_did_not_pass() -> None:
    def run(seed: int, final: float, reached: int | None) -> dict[str, Any]:
        return {**row("reinforce_pp", final=final, seed=seed), "best_success": 0.91,
                "minutes_to_80": 11.3 if reached else None, "step_reaching_80": reached}  # fmt: skip

    held, fell, never = run(0, 0.84, 160), run(1, 0.00, 590), run(2, 0.20, None)
    assert [presets.verdict(r) for r in (held, fell, never)] == ["passed", "fell", "not reached"]
    assert presets.verdict(run(3, presets.HOLD, 200)) == "passed"  # the evaluation's noise
    last = presets.summary([held, fell, never]).splitlines()[-1]
    assert last.endswith("| no: seed 1 fell, seed 2 not reached |")
    assert presets.summary([held]).splitlines()[-1].endswith("| yes |")
