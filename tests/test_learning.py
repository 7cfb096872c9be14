"""End to end, RL learns the secret-lookup probe: the real trainer (tiny model built and
pretrained here, syntax-only warm-up, rollouts through the hermes tool format, GiGPO, KL)
must learn to call ``lookup`` with the asked key and copy the value it returns.

One seed with a smaller budget than benchmarks/learning_proof.py (3 seeds, 15 minutes
each, with controls), so CI guards the whole loop in a few minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Reached, UntilSuccess
from turnrl.trainer.config import load_config
from turnrl.trainer.loop import train


@pytest.mark.learning
def test_rl_learns_the_secret_lookup_probe(tmp_path: Path) -> None:
    """Stops at the first evaluation at or above 0.8. Measured on the 2-core machine:
    0.125 at step 0, 0.16 at step 100, 0.47 at 120, 0.69 at 130, 0.86 at 140 (5.7 minutes
    in all, 2 minutes of it building, echo-tuning and warming up the model)."""
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
    run = UntilSuccess(0.8)
    with pytest.raises(Reached):
        train(config, tmp_path / "run", progress=False, on_row=run)
    assert run.curve[0][1] <= 0.2, run.curve  # after the warm-up: about chance, 1 in 12
    # the tool is called with the right key and its value copied
    assert run.rows[-1]["rollout/tool_calls_mean"] > 0.9


@pytest.mark.learning
def test_the_probe_learns_on_two_rollout_workers_and_two_learner_ranks(tmp_path: Path) -> None:
    """The same quick-start, its episodes on 2 Ray rollout workers and its update on 2
    FSDP2 learner ranks (gloo), one torch thread each: held-out success reaches 0.8. The run
    stops at the first evaluation that does: step 80 (0.92), 4.6 minutes in all, when
    measured on the 2-core machine beside other work; seed 2 took 320 steps (0.88)."""
    pytest.importorskip("ray")
    from turnrl.api import train as train_anywhere

    config = load_config(
        "quickstart",
        [
            "seed=1", "steps=400", "max_minutes=0", "threads=1",
            "save_every=1000", "eval.every=10", "eval.num_tasks=64",
            "cluster.rollout_workers=2", "cluster.learner_ranks=2",
        ],
    )  # fmt: skip
    run = UntilSuccess(0.8)
    with pytest.raises(Reached):
        train_anywhere(config, out=tmp_path / "run", progress=False, on_row=run)
    assert run.curve[0][1] <= 0.2, run.curve  # it started from about chance
