"""What the agent frameworks' tests share (tests/test_langgraph.py, test_pydantic_ai.py,
test_smolagents.py, test_dspy.py): their example loaded, a batch of its episodes played
against a policy double, and the example trained a few steps as a user runs it. Imports
no framework: each test file skips where its framework is not installed."""

from __future__ import annotations

import asyncio
import json
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import SMALL_RUN
from test_agent_endpoint import ReadingBackend
from turnrl.envs.agent import AgentEnvironment
from turnrl.models.loading import stop_token_ids
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams
from turnrl.rollout.groups import GroupSpec, collect_groups, rollout_metrics
from turnrl.types import Task, Trajectory

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(name: str) -> dict[str, Any]:
    """The globals of examples/<name>.py (its ``agent``, ``reward`` and ``PROBE``)."""
    return runpy.run_path(str(EXAMPLES / f"{name}.py"))


def task_with_key_other_than(probe: Any, key: str) -> Task:
    return next(t for t in map(probe.task, range(100)) if t.metadata["key"] != key)


def check_one_token_exact_sample(
    tokenizer: Any, traj: Trajectory, backend: ReadingBackend, endpoint: Any, task: Task,
    framework: str,
) -> None:  # fmt: skip
    """A solved episode of two model calls, the second extending the first: one sample,
    token-exact, the tool's schema in the first prompt and its reply in the second."""
    assert traj.error is None, traj.info.get("traceback")
    assert (traj.success, traj.reward, traj.stop_reason) == (True, 1.0, "answered")
    assert [(c.name, c.ok) for c in traj.tool_calls] == [("lookup", True)]
    assert (len(traj.turns), traj.context_rewrites) == (2, 0)
    [sample] = traj.samples()  # the second request extends the first: one sample
    assert list(sample.input_ids) == [*backend.requests[-1].prompt_ids, *traj.turns[-1].completion_ids]  # fmt: skip
    sampled = [i for turn in traj.turns for i in turn.completion_ids]
    assert [i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m] == sampled
    prompt = tokenizer.decode(list(backend.requests[0].prompt_ids))
    assert '"name": "lookup"' in prompt, framework  # its tool schema, rendered by the template
    second = tokenizer.decode(list(backend.requests[1].prompt_ids))
    assert task.answer in second  # the tool ran: its reply reached the policy
    assert endpoint.open_episodes == 0


def play_a_batch(
    tokenizer: Any,
    example: dict[str, Any],
    policy: Callable[[str], str],
    *,
    tasks: int = 6,
    max_context_tokens: int = 1024,
) -> tuple[list[Trajectory], dict[str, float], list[Task]]:
    """Groups of two episodes of the example's agent on its first ``tasks`` tasks, as a
    training step collects them (four turns at most): the trajectories, the step's rollout
    metrics, the tasks."""
    environment = AgentEnvironment(example["agent"], example["PROBE"].task, example["reward"])
    spec = GroupSpec(
        group_size=2,
        limits=EpisodeLimits(max_turns=4, max_context_tokens=max_context_tokens, timeout_s=60),
        sampling=SamplingParams(stop_token_ids=stop_token_ids(tokenizer)),
        seed=0,
    )
    batch = [environment.task(i) for i in range(tasks)]
    try:
        groups = asyncio.run(
            collect_groups(
                batch, environment.make_env, ReadingBackend(tokenizer, policy),
                ChatRenderer(tokenizer), spec,
            )
        )  # fmt: skip
    finally:
        environment.close()
    return [t for g in groups for t in g], rollout_metrics(groups), batch


def train_the_example(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str
) -> list[dict[str, Any]]:
    """Run examples/<name>.py as ``python examples/<name>.py <SMALL_RUN> <overrides>`` in
    ``tmp_path`` (in this process: torch and the framework are imported once); return the
    rows of its trained steps, after checking that there are two and that no episode
    failed."""
    monkeypatch.chdir(tmp_path)
    path = str(EXAMPLES / f"{name}.py")
    monkeypatch.setattr(sys, "argv", [path, *SMALL_RUN, *overrides])
    runpy.run_path(path, run_name="__main__")
    (metrics,) = tmp_path.glob("runs/*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    trained = [r for r in rows if "loss/policy" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(r["rollout/errors"] == 0 for r in trained)
    return trained
