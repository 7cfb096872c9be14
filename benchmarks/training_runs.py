"""What the training benchmarks share: running trainings side by side in worker
processes, reading a run's held-out success curve, writing JSON + markdown results, and
the overrides that make a training run of seconds (their ``--smoke`` mode)."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TINY_RUN = [  # --smoke: a 32-wide 1-layer model, 2 steps of 2 x 2 episodes, 4 eval tasks
    "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
    "model.tiny.vocab_size=512", "model.tiny.echo_steps=2", "warmup.steps=2",
    "warmup.batch_size=4",
    "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_tokens_per_turn=24",
    "steps=2", "eval.every=1", "eval.num_tasks=4",
]  # fmt: skip

Curve = list[tuple[int, float, float]]
"""(step, seconds of RL so far, held-out success) at every evaluation."""


def eval_curve(rows: Sequence[dict[str, Any]]) -> Curve:
    return [
        (int(r["step"]), float(r.get("perf/elapsed_s", 0.0)), float(r["eval/success_mean"]))
        for r in rows
        if "eval/success_mean" in r
    ]


def first_reaching(curve: Curve, level: float) -> tuple[int, float] | None:
    """The first (step, seconds) whose held-out success is at least ``level``."""
    return next(((s, t) for s, t, v in curve if v >= level), None)


def threads_per_job(jobs: int) -> int:
    """Torch threads for each of ``jobs`` runs sharing this machine (0: torch's default)."""
    return max(1, multiprocessing.cpu_count() // jobs) if jobs > 1 else 0


def run_side_by_side(
    fn: Callable[..., dict[str, Any]],
    calls: Sequence[tuple[Any, ...]],
    jobs: int,
    on_result: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    """``fn(*args)`` for every ``args`` of ``calls``, ``jobs`` at a time in fresh worker
    processes (spawned, so no torch state is shared); results in call order, each passed to
    ``on_result`` as it becomes available in that order. A worker ends within a second of
    this process's death (killed, not only interrupted): a benchmark stopped by hand leaves
    no 15-minute training running behind it."""
    results: list[dict[str, Any]] = []
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=context, initializer=exit_with_parent, initargs=(os.getpid(),)
    ) as pool:
        futures = [pool.submit(fn, *args) for args in calls]
        for future in futures:
            results.append(future.result())
            on_result(results[-1])
    return results


def exit_with_parent(parent: int, every: float = 0.5) -> None:
    """In a worker process: a daemon thread ends the process once ``parent`` is no longer
    its parent (it died and the worker was re-parented)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def write_results(
    out: Path, meta: dict[str, Any], results: list[dict[str, Any]], markdown: list[str]
) -> None:
    """``out``.json (meta + every run) and ``out``.md (the given lines)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**meta, "runs": results}, indent=2))
    out.with_suffix(".md").write_text("\n".join(markdown) + "\n")


def curve_lines(results: list[dict[str, Any]], key: str) -> list[str]:
    """One markdown bullet per run: its held-out success at every evaluation."""
    return [
        f"- {r[key]} (step:held-out success): "
        + ", ".join(f"{s}:{v:.2f}" for s, _, v in r["curve"])
        for r in results
    ]
