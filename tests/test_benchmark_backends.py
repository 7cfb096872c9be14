"""benchmarks/backends.py runs end to end in its ``--smoke`` mode (a real vLLM engine on
tiny settings, in a subprocess of this interpreter) and writes what a full run writes: the
three samplers on both cases, with turnrl's vLLM path and raw vLLM sampling the same
tokens; the weight-sync rows; the GPU section skipped on a CPU; and nothing lands in
benchmarks/results or benchmarks/runs.

It needs vLLM, so it lives here rather than in tests/test_benchmarks.py (which runs every
other script under the main virtualenv) and runs in .venv-vllm with the other tests marked
vllm; it skips where vLLM is not installed."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make setup-vllm)")

from test_benchmarks import BENCHMARKS, ROOT, files_under, finite_numbers

pytestmark = pytest.mark.vllm
TIMEOUT_S = 300
"""The smoke run takes about 30 s on 2 cores (two engines start); room for a busy machine."""


def test_smoke_run_writes_its_results(tmp_path: Path) -> None:
    before = files_under(BENCHMARKS / "results", BENCHMARKS / "runs")
    out = tmp_path / "backends"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "backends.py"), "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"--smoke: writing to {tmp_path}" in proc.stdout
    data = json.loads(out.with_suffix(".json").read_text())
    assert finite_numbers(data) == []
    table = out.with_suffix(".md").read_text()
    assert table.startswith("# ")
    assert re.search(r"^\|---", table, re.MULTILINE), "no table"

    single, multi = data["tiny"]["single"], data["tiny"]["multi"]
    for row in (single, multi):
        samplers = row["samplers"]
        assert set(samplers) == {"turnrl-vllm", "raw-vllm", "raw-vllm-ids", "torch"}
        raw = samplers["raw-vllm"]
        for name, s in samplers.items():
            assert len(s["wall_s_runs"]) == data["repeats"] == 1
            assert s["wall_s"] > 0
            assert s["sampled_tokens"] > 0
            ratios = [a / b for a, b in zip(s["wall_s_runs"], raw["wall_s_runs"], strict=True)]
            assert s["over_raw"] == pytest.approx(statistics.median(ratios))
            if name != "torch":  # the same requests and seeds on the same engine
                assert s["same_tokens_as_raw"], name
                assert s["sampled_tokens"] == raw["sampled_tokens"]
                assert 0 < s["in_engine_steps_s"] <= s["wall_s"]  # the engine's share
        assert row["ratio_turnrl_over_raw"] == samplers["turnrl-vllm"]["over_raw"]
    # 2 tasks x 2 samples; no stop tokens in the single-turn case: every request samples
    # exactly --single-tokens tokens, whichever sampler
    assert single["requests"] == multi["episodes"] == 4
    for s in single["samplers"].values():
        assert s["sampled_tokens"] == 4 * data["single_tokens"]
    assert multi["engine_calls"] >= 1
    assert multi["requests"] >= multi["episodes"]

    sync = data["sync"]
    assert [r["model"] for r in sync] == ["tiny", "~10x"]
    assert sync[0]["parameters_over_tiny"] == 1.0
    assert sync[1]["parameters_over_tiny"] > 8
    assert all(r["load_weights_s"] > 0 for r in sync)
    if not torch.cuda.is_available():
        assert data["gpu"] == {"skipped": "no CUDA device"}
    assert files_under(BENCHMARKS / "results", BENCHMARKS / "runs") == before
