"""``AgentProcesses``: an existing agent run in worker processes of its own, reaching the
policy endpoint over real loopback HTTP with the real ``openai`` SDK. Its episodes are
those of the same agent in process; an agent's error, a worker's death and a hang are the
episode's failure (a dead worker is started again for the next episode); 64 concurrent
agents over two workers lose nothing; an agent that cannot be sent is refused at once."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import openai
import pytest

from agent_workers import crashes, dies, hangs, react_agent, whose
from test_agent_endpoint import PROBE, ReadingBackend, exact, oracle, play_agent
from turnrl import AgentProcesses
from turnrl.envs.agent import AgentEnvironment, agent_kind
from turnrl.envs.agent_processes import AgentProcessError
from turnrl.envs.endpoint import PolicyEndpoint
from turnrl.models.loading import stop_token_ids
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams
from turnrl.rollout.groups import GroupSpec, collect_groups, rollout_metrics
from turnrl.types import Task


def test_an_agent_in_a_worker_gives_the_in_process_episode(tokenizer: Any) -> None:
    task = PROBE.task(3)
    with AgentProcesses(react_agent) as agent:
        assert agent_kind(agent) == "base_url"
        traj, endpoint = play_agent(tokenizer, agent, ReadingBackend(tokenizer, oracle), task=task)
    assert traj.error is None, traj.info.get("traceback")
    assert (traj.success, traj.reward, traj.stop_reason) == (True, 1.0, "answered")
    assert endpoint.open_episodes == 0
    twin, _ = play_agent(tokenizer, react_agent, ReadingBackend(tokenizer, oracle), task=task)
    assert traj.samples() == twin.samples()  # the same tokens, trained on the same way

    seen: list[str] = []

    def record(task: Task, answer: str, transcript: list[dict[str, Any]]) -> float:
        seen.append(answer)
        return 0.0

    with AgentProcesses(whose) as agent:
        play_agent(tokenizer, agent, ReadingBackend(tokenizer, oracle), reward=record)
        worker = agent._workers[0]
        assert worker is not None
        assert seen == [str(worker.process.pid)]
    assert seen[0] != str(os.getpid())


def test_failures_are_the_episodes(tokenizer: Any) -> None:
    backend = ReadingBackend(tokenizer, oracle)
    with AgentProcesses(crashes) as agent:
        traj, _ = play_agent(tokenizer, agent, backend)
    assert traj.stop_reason == "error"
    assert "ValueError: the agent's own bug" in (traj.error or "")
    assert "in crashes" in (traj.error or "")  # the worker's traceback

    with AgentProcesses(hangs) as agent:
        start = time.monotonic()
        traj, endpoint = play_agent(tokenizer, agent, backend, limits=EpisodeLimits(timeout_s=1.5))
        assert time.monotonic() - start < 15
        assert "1.5 s deadline" in (traj.error or "")
        assert len(traj.turns) == 1
        assert endpoint.open_episodes == 0

    seen: list[str] = []

    def record(task: Task, answer: str, transcript: list[dict[str, Any]]) -> float:
        seen.append(answer)
        return 0.0

    with AgentProcesses(dies) as agent:
        dead, _ = play_agent(tokenizer, agent, backend, task=PROBE.task(0), reward=record)
        first = agent._workers[0]
        assert first is not None
        alive, _ = play_agent(tokenizer, agent, backend, task=PROBE.task(1), reward=record)
        second = agent._workers[0]
        assert second is not None
        assert second is not first  # started again
    assert dead.stop_reason == "error"
    assert "agent worker 0 died (exit code 3)" in (dead.error or "")
    assert alive.error is None
    assert seen == [str(second.process.pid)]


def test_64_concurrent_agents_over_two_workers_lose_nothing(tokenizer: Any) -> None:
    endpoint = PolicyEndpoint()
    with AgentProcesses(react_agent, processes=2) as agent:
        environment = AgentEnvironment(agent, PROBE.task, exact, endpoint=endpoint, name="p")
        backend = ReadingBackend(tokenizer, oracle)
        spec = GroupSpec(
            group_size=8, limits=EpisodeLimits(max_turns=6, timeout_s=60),
            sampling=SamplingParams(stop_token_ids=stop_token_ids(tokenizer)), seed=0,
        )  # fmt: skip
        tasks = [environment.task(i) for i in range(8)]
        try:
            groups = asyncio.run(
                collect_groups(tasks, environment.make_env, backend, ChatRenderer(tokenizer), spec)
            )
        finally:
            environment.close()
    trajs = [t for g in groups for t in g]
    assert len(trajs) == 64
    assert [t.error for t in trajs] == [None] * 64
    assert sorted((t.task_id, t.sample_index) for t in trajs) == sorted(
        (task.id, i) for task in tasks for i in range(8)
    )
    assert len(backend.requests) == 128  # a call and an answer each, none twice
    assert rollout_metrics(groups)["rollout/success_mean"] == 1.0
    assert endpoint.open_episodes == 0


def test_what_cannot_be_sent_is_refused_at_once() -> None:
    async def nested(task: Task, client: openai.AsyncOpenAI) -> str:
        return ""

    with pytest.raises(AgentProcessError, match="must pickle"):
        AgentProcesses(nested)
    with pytest.raises(ValueError, match="processes"):
        AgentProcesses(whose, processes=0)
