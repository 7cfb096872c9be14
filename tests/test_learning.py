"""End to end, RL learns the secret-lookup probe: the real trainer (tiny model built and
pretrained here, syntax-only warm-up, rollouts through the hermes tool format, GiGPO, KL)
must learn to call ``lookup`` with the asked key and copy the value it returns.

One seed with a smaller budget than benchmarks/learning_proof.py (3 seeds, 15 minutes
each, with controls), so CI guards the whole loop in a few minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from turnrl.trainer.config import load_config
from turnrl.trainer.loop import train


@pytest.mark.learning
def test_rl_learns_the_secret_lookup_probe(tmp_path: Path) -> None:
    config = load_config(
        "quickstart",
        [
            "seed=2",  # the demo's seed; benchmarks/learning_proof.py covers seeds 0-2
            "steps=150",
            "max_minutes=0",  # a step budget, not a time budget: the same run everywhere
            "threads=2",  # fixed too: the thread count changes float rounding
            "save_every=1000",
            "eval.every=10",
            "eval.num_tasks=64",
        ],
    )
    rows = train(config, tmp_path / "run", progress=False).rows
    curve = [(r["step"], r["eval/success_mean"]) for r in rows if "eval/success_mean" in r]
    start, best = curve[0][1], max(v for _, v in curve)
    assert start <= 0.2, curve  # after the warm-up: about chance, 1 in 12
    assert best >= 0.6, curve  # the tool is called with the right key and its value copied
    assert rows[-1]["rollout/tool_calls_mean"] > 0.9
