"""The asynchronous pipeline's scheduling (trainer/pipeline.py ``PipelinedStepper``), with
the step's phases replaced by scripted ones that take chosen times: which weights sample
each batch, how far ahead the background thread runs, and that the engine is never synced
while it samples. The real loop with ``algorithm.max_staleness`` is tested in
tests/test_async.py."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from turnrl.trainer import pipeline
from turnrl.trainer.step import StepRollouts


@dataclass
class Script:
    """Stand-ins for the step's phases, recording what the pipeline asked of them. The
    learner's model is one weight that each update sets to the new version, so a sync's
    source says which version it holds."""

    rollout_s: float
    update_s: float
    sampled_by: dict[int, int] = field(default_factory=dict)
    """Each batch's step: the engine's version when its rollout started."""
    trained_at: dict[int, int] = field(default_factory=dict)
    """Each batch's step: the learner's version when it was trained on."""
    syncs: list[tuple[int, float, str]] = field(default_factory=list)
    """Each sync: the version given, the weight its source held, the thread that synced."""
    faults: list[str] = field(default_factory=list)
    """What must never happen (a sync while a rollout runs, two rollouts at once)."""
    rolling: int = 0
    most: int = 0
    """The most overlapping rollouts (``rollout_program``) that ran at once."""
    fail_at: tuple[int, ...] = ()
    """The steps whose overlapping rollouts raise."""

    def parts(self, steps: int) -> Any:
        config = SimpleNamespace(
            steps=steps,
            rollout=SimpleNamespace(episode_timeout_s=0.0),
            algorithm=SimpleNamespace(filter=SimpleNamespace(max_rounds=1)),
        )
        model = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(0.0)
        return SimpleNamespace(
            config=config, backend=SimpleNamespace(policy_version=0, run=asyncio.run),
            learner=SimpleNamespace(model=model), workers=None,
        )  # fmt: skip

    def rollout_phase(self, parts: Any, step: int) -> StepRollouts:
        self.rolling += 1
        if self.rolling > 1:
            self.faults.append(f"two rollouts at once, at step {step}")
        self.sampled_by[step] = parts.backend.policy_version
        time.sleep(self.rollout_s)
        self.rolling -= 1
        return StepRollouts([], [], {}, self.rollout_s)

    async def rollout_program(self, parts: Any, step: int) -> StepRollouts:
        """An overlapping batch (``algorithm.overlap_batches``): others may run beside it."""
        self.rolling += 1
        self.most = max(self.most, self.rolling)
        self.sampled_by[step] = parts.backend.policy_version
        await asyncio.sleep(self.rollout_s)
        self.rolling -= 1
        if step in self.fail_at:
            raise RuntimeError(f"the rollout of batch {step} failed")
        return StepRollouts([], [], {}, self.rollout_s)

    def update_phase(self, parts: Any, step: int, c: StepRollouts, version: int, out: Any) -> Any:
        self.trained_at[step] = version
        time.sleep(self.update_s)
        with torch.no_grad():
            parts.learner.model.weight.fill_(float(version + 1))
        return {"step": step + 1, "_tokens": 0}

    def sync_engines(self, parts: Any, version: int | None = None, model: Any = None) -> Any:
        if self.rolling:
            self.faults.append(f"a sync to version {version} while a rollout ran")
        source = parts.learner.model if model is None else model
        assert version is not None
        self.syncs.append((version, source.weight.detach().item(), threading.current_thread().name))
        parts.backend.policy_version = version
        return {"perf/rollout_sync_s": 0.001}

    def staleness(self) -> dict[int, int]:
        return {s: self.trained_at[s] - self.sampled_by[s] for s in self.trained_at}


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> Any:
    def make(rollout_s: float, update_s: float) -> Script:
        script = Script(rollout_s, update_s)
        for name in ("rollout_phase", "rollout_program", "update_phase", "sync_engines"):
            monkeypatch.setattr(pipeline, name, getattr(script, name))
        return script

    return make


def run(script: Script, depth: int, steps: int, eval_after: tuple[int, ...] = ()) -> list[Any]:
    parts = script.parts(steps)
    ahead = pipeline.PipelinedStepper(depth)
    rows = []
    try:
        for step in range(steps):
            rows.append(ahead.step(parts, step, io.StringIO()))
            if step + 1 in eval_after:
                syncs = len(script.syncs)
                synced = ahead.before_eval(parts)
                assert parts.backend.policy_version == step + 1  # the learner's weights
                # its own sync's metrics, if it had to sync, for the step's row (those of
                # the batches it waited for are in theirs)
                own = [x for x in script.syncs[syncs:] if x[2] == "MainThread"]
                assert synced == ({"perf/rollout_sync_s": 0.001} if own else {})
    finally:
        ahead.close()
    return rows


def test_a_slow_learner_lets_the_rollouts_run_k_steps_ahead(scripted: Any) -> None:
    script = scripted(rollout_s=0.0, update_s=0.3)
    run(script, depth=2, steps=6)
    staleness = script.staleness()
    assert staleness == {0: 0, 1: 1, 2: 2, 3: 2, 4: 2, 5: 2}  # the bound, reached
    assert not script.faults


def test_slow_rollouts_take_the_newest_weights_in_the_background(scripted: Any) -> None:
    script = scripted(rollout_s=0.3, update_s=0.0)
    run(script, depth=3, steps=6)
    staleness = script.staleness()
    assert staleness[0] == 0
    assert all(staleness[s] <= 1 for s in range(1, 6)), staleness  # fresh, not k stale
    background = [(v, w) for v, w, thread in script.syncs if thread != "MainThread"]
    assert background, script.syncs  # the engine was busy when the batches were queued
    for version, weight in background:  # the published copy holds the version it claims
        assert weight == version
    assert not script.faults


def test_k1_syncs_between_batches_on_the_loop_s_thread(scripted: Any) -> None:
    script = scripted(rollout_s=0.05, update_s=0.05)
    run(script, depth=1, steps=5)
    assert script.staleness() == {0: 0, 1: 1, 2: 1, 3: 1, 4: 1}
    assert [thread for _, _, thread in script.syncs] == ["MainThread"] * 3
    assert [(v, w) for v, w, _ in script.syncs] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert not script.faults


def test_an_evaluation_waits_for_every_batch_ahead_and_syncs_the_learner_s_weights(
    scripted: Any,
) -> None:
    script = scripted(rollout_s=0.05, update_s=0.0)
    rows = run(script, depth=3, steps=6, eval_after=(2,))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert sorted(script.sampled_by) == list(range(6))  # every batch once, none lost
    assert all(0 <= s <= 3 for s in script.staleness().values())
    assert not script.faults


def test_a_pipeline_is_at_least_one_step_deep() -> None:
    with pytest.raises(ValueError, match="one step deep"):
        pipeline.PipelinedStepper(0)


def test_closing_drops_the_batches_not_started_and_lets_the_running_one_finish(
    scripted: Any,
) -> None:
    script = scripted(rollout_s=0.3, update_s=0.0)
    parts = script.parts(steps=8)
    ahead = pipeline.PipelinedStepper(3)
    ahead.step(parts, 0, io.StringIO())  # batches 1, 2 and 3 queued; 1 is running
    ahead.close()
    assert sorted(script.sampled_by) == [0, 1]  # 2 and 3 never started
    assert script.rolling == 0  # batch 1 was let finish


def test_the_sync_before_an_evaluation_is_timed_in_the_step_s_row(scripted: Any) -> None:
    """Updates slower than rollouts: at the evaluation the engine is behind the learner,
    so the loop's thread syncs it, and the step's row gets that sync's time."""
    script = scripted(rollout_s=0.0, update_s=0.2)
    parts = script.parts(steps=4)
    ahead = pipeline.PipelinedStepper(2)
    try:
        for step in range(2):
            ahead.step(parts, step, io.StringIO())
        assert parts.backend.policy_version < 2  # sampling batches 2 and 3 on older weights
        assert ahead.before_eval(parts) == {"perf/rollout_sync_s": 0.001}
        assert script.syncs[-1] == (2, 2.0, "MainThread")
    finally:
        ahead.close()


def test_overlapping_batches_run_together_and_every_batch_once(scripted: Any) -> None:
    """``overlap_batches``: each batch queued starts at once, beside the one running (the
    engine's mid-batch hook, absent here, would keep its weights fresh)."""
    script = scripted(rollout_s=0.2, update_s=0.0)
    parts = script.parts(steps=6)
    ahead = pipeline.PipelinedStepper(2, partial=True, overlap=True)
    try:
        rows = [ahead.step(parts, step, io.StringIO()) for step in range(6)]
    finally:
        ahead.close()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert sorted(script.sampled_by) == list(range(6))  # every batch once, none lost
    assert script.most == 2  # batches 1 and 2 were queued together and ran together
    assert script.rolling == 0
    assert not script.faults


def test_a_failed_overlapping_batch_stops_the_step_that_waits_for_it(scripted: Any) -> None:
    script = scripted(rollout_s=0.1, update_s=0.0)
    script.fail_at = (2,)
    parts = script.parts(steps=6)
    ahead = pipeline.PipelinedStepper(2, partial=True, overlap=True)

    def steps() -> None:
        for step in range(6):
            ahead.step(parts, step, io.StringIO())

    try:
        with pytest.raises(RuntimeError, match="batch 2 failed"):
            steps()
    finally:
        ahead.close()
    assert {0, 1, 2} <= set(script.sampled_by) <= {0, 1, 2, 3}  # 3, if started, ...
    assert script.rolling == 0  # ... was let finish


def test_overlapping_batches_need_partial_rollouts() -> None:
    with pytest.raises(ValueError, match="partial"):
        pipeline.PipelinedStepper(2, overlap=True)


def test_an_evaluation_that_cannot_get_the_engine_back_names_the_rollout_thread(
    scripted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = scripted(rollout_s=0.0, update_s=0.0)
    monkeypatch.setattr(pipeline, "HAND_BACK_S", 0.1)
    ahead = pipeline.PipelinedStepper(2, partial=True, overlap=True)
    try:
        ahead._pool.submit(time.sleep, 1.0)  # the engine's program, not ending
        with pytest.raises(pipeline.RolloutAheadError, match="hand the engine back"):
            ahead.before_eval(script.parts(steps=2))
    finally:
        ahead.close()
