"""End to end, RL learns the secret-lookup probe: the real trainer (tiny model built and
pretrained here, syntax-only warm-up, rollouts through the hermes tool format, GiGPO, KL)
must learn to call ``lookup`` with the asked key and copy the value it returns.

Smaller than benchmarks/learning_proof.py (3 seeds, 15 minutes each, with controls), so CI
guards the whole loop in a few minutes. The same probe learns with vLLM sampling on two Ray
rollout workers and two FSDP2 learner ranks in tests/test_vllm_learning.py.

Why a second seed: the step at which a seed's run takes off (copying the tool's answer,
then the right key) is not a property of the seed alone but of the float rounding, which
depends on the CPU and the thread count. Measured with these settings: on one 2-core
machine seed 1 reached 0.86 at step 100; on another (AMD EPYC, family 25 model 17,
2026-11-27) seed 1 did not reach 0.8 in 200 steps (0.06-0.17 held-out over its first
120) nor did seed 0 (0.05-0.20), while seed 2 took off there (0.17 at step 70, 0.88 at
step 110), where it was the slow seed on the first machine
(benchmarks/results/learning_proof.md). One seed made the test pass or fail with the
machine, so it tries seed 1, then seed 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import UntilSuccess, first_to_reach
from turnrl.trainer.config import load_config
from turnrl.trainer.loop import train

ATTEMPTS = ((2, 150), (1, 200))
"""(seed, steps), tried in turn (a step budget, not a time budget: the same run everywhere).
Seed 2 reached 0.8 at step 110 on both CPUs it ran on. Seed 1 reached it at step 100 on
one, and not in 200 steps on the other (AMD EPYC, family 25 model 17), where the float
rounding of the same run differs: it goes second, so that `make test` does not pay for it
first there (about 6 minutes)."""


@pytest.mark.learning
def test_rl_learns_the_secret_lookup_probe(tmp_path: Path) -> None:
    """Stops at the first evaluation at or above 0.8. One torch thread: `make test` runs
    it beside the vLLM tests (tests/test_vllm_learning.py), a core each. Each attempt
    takes about 1.7 minutes to build, echo-tune and warm up its model, then about 1.3 s a
    step beside another learning run: seed 1 alone took 6.3 and 7.4 minutes in two fresh
    clones' `make test` on the first machine; on the second, seed 1's 120 steps and then
    seed 2's 110 took 12.6 minutes beside a vLLM learning run."""

    def run(seed: int, steps: int, on_row: UntilSuccess) -> None:
        config = load_config(
            "quickstart",
            [
                f"seed={seed}",  # benchmarks/learning_proof.py covers seeds 0-2
                f"steps={steps}",
                "max_minutes=0",
                "threads=1",  # fixed too: the thread count changes float rounding
                "save_every=1000",
                "eval.every=10",
                "eval.num_tasks=64",
            ],
        )
        train(config, tmp_path / f"seed{seed}", progress=False, on_row=on_row)

    reached = first_to_reach(0.8, ATTEMPTS, run)
    assert reached.curve[0][1] <= 0.2, reached.curve  # after the warm-up: about chance, 1 in 12
    # the tool is called with the right key and its value copied
    assert reached.rows[-1]["rollout/tool_calls_mean"] > 0.9
