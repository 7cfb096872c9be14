"""An existing agent, trained through the policy endpoint (turnrl.envs.agent, .endpoint).

Real `openai` clients over real HTTP on loopback; the policy side is either the real torch
sampler on the tiny model or a test double of the backend seam that answers from the
prompt's text (so agents reach their tools and answers on purpose). Checked: token-exact
samples (equal to the ToolEnv path's for the same sampled texts), rewritten histories
split and counted, 64 concurrent agents with nothing lost, failures recorded, HTTP errors.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest

from agent_workers import LOOKUP, react_agent
from turnrl.backends.torch_backend import TorchBackend
from turnrl.envs import SecretLookup
from turnrl.envs.agent import AgentEnv, AgentEnvironment, agent_kind
from turnrl.envs.endpoint import PolicyEndpoint
from turnrl.formats import get_format
from turnrl.models.loading import stop_token_ids
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, run_episode
from turnrl.rollout.groups import GroupSpec, collect_groups, rollout_metrics
from turnrl.types import Completion, GenerationRequest, Task, ToolCall, Trajectory

PROBE = SecretLookup()
HERMES = get_format("hermes")


class ReadingBackend:
    """A backend double: replies with ``policy(prompt text)`` then the end token, through
    the real tokenizer, for every request (batched or not)."""

    def __init__(self, tokenizer: Any, policy: Callable[[str], str], delay_s: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.policy = policy
        self.delay_s = delay_s
        self.end = stop_token_ids(tokenizer)[0]
        self.policy_version = 0
        self.pad_id = self.end
        self.requests: list[GenerationRequest] = []

    def submit(self, requests: Sequence[GenerationRequest], quiet: Any = None) -> None:
        return None

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        await asyncio.sleep(self.delay_s)
        out = []
        for r in requests:
            self.requests.append(r)
            text = self.policy(self.tokenizer.decode(list(r.prompt_ids)))
            ids = (*self.tokenizer.encode(text, add_special_tokens=False), self.end)
            out.append(Completion(ids, tuple(-0.5 for _ in ids), "stop", policy_version=0))
        return out

    def run(self, program: Any) -> Any:
        return asyncio.run(program)

    def sync(self, model: Any) -> None:
        self.policy_version += 1


def oracle(prompt: str) -> str:
    """Calls lookup for the asked key, then answers the tool's reply."""
    replies = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", prompt, re.S)
    if replies:
        return replies[-1]
    key = re.findall(r"What is the value of (\w+)\?", prompt)[-1]
    return HERMES.render_call(ToolCall("lookup", {"key": key}))


def exact(task: Task, answer: str, transcript: list[dict[str, Any]]) -> float:
    return float(str(answer).strip() == task.answer)


def play_agent(
    tokenizer: Any,
    agent: Any,
    backend: Any,
    *,
    task: Task | None = None,
    limits: EpisodeLimits | None = None,
    reward: Any = exact,
) -> tuple[Trajectory, PolicyEndpoint]:
    endpoint = PolicyEndpoint()
    env = AgentEnv(agent, reward, endpoint, HERMES)

    async def go() -> Trajectory:
        async def generate(request: GenerationRequest) -> Completion:
            return (await backend.generate([request]))[0]

        return await run_episode(
            env,
            task or PROBE.task(0),
            generate,
            ChatRenderer(tokenizer),
            limits=limits or EpisodeLimits(max_turns=6),
            sampling=SamplingParams(stop_token_ids=stop_token_ids(tokenizer)),
            seed=0,
        )

    try:
        return asyncio.run(go()), endpoint
    finally:
        endpoint.close()


def test_the_agent_path_trains_on_the_same_tokens_as_the_tool_env_path(tokenizer: Any) -> None:
    task = PROBE.task(3)
    traj, endpoint = play_agent(
        tokenizer, react_agent, ReadingBackend(tokenizer, oracle), task=task
    )
    assert traj.error is None, traj.info.get("traceback")
    assert (traj.success, traj.reward, traj.stop_reason) == (True, 1.0, "answered")
    assert [c.name for c in traj.tool_calls] == ["lookup"]
    assert traj.tool_calls[0].ok
    assert endpoint.open_episodes == 0
    # The same policy texts in the probe's own ToolEnv give the very same training sample.
    native = ReadingBackend(tokenizer, oracle)

    async def generate(request: GenerationRequest) -> Completion:
        return (await native.generate([request]))[0]

    env = PROBE.make_env()
    twin = asyncio.run(
        run_episode(
            env, task, generate, ChatRenderer(tokenizer), limits=EpisodeLimits(max_turns=6),
            sampling=SamplingParams(stop_token_ids=stop_token_ids(tokenizer)), seed=0,
        )
    )  # fmt: skip
    assert twin.success
    assert traj.samples() == twin.samples()


def test_sampled_tokens_are_trained_on_exactly_with_the_real_sampler(
    tokenizer: Any, model: Any
) -> None:
    """The tiny model writes what it writes; whatever the agent makes of it, the sample's
    masked positions hold exactly the sampled ids and the rest is the rendered agent side."""
    seen: list[str] = []

    async def chatty(task: Task, client: openai.AsyncOpenAI) -> str:
        messages: list[Any] = [dict(m) for m in task.prompt]
        for k in range(3):
            reply = await client.chat.completions.create(
                model="p", messages=messages, tools=[LOOKUP], logprobs=True, stop=["a", "e", " "]
            )  # stop strings (honoured) end the random model's turns early
            message = reply.choices[0].message
            seen.append(message.content or "")
            assert reply.choices[0].logprobs is not None
            messages += [
                message.model_dump(exclude_none=True),
                {"role": "user", "content": f"go {k}"},
            ]
        return "done"

    backend = TorchBackend(model, tokenizer)
    traj, _ = play_agent(
        tokenizer, chatty, backend, limits=EpisodeLimits(max_turns=4, max_tokens_per_turn=24)
    )
    assert traj.error is None, traj.info.get("traceback")
    assert (traj.stop_reason, len(traj.turns)) == ("answered", 3)
    assert traj.context_rewrites == 0
    assert len(traj.samples()) == 1
    [sample] = traj.samples()
    sampled = [i for turn in traj.turns for i in turn.completion_ids]
    assert [i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m] == sampled
    lps = [lp for turn in traj.turns for lp in turn.completion_logprobs]
    assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if m] == lps
    text = tokenizer.decode(list(sample.input_ids))
    assert "go 0" in text
    assert "go 1" in text


def test_a_summarising_agent_splits_samples_and_never_retokenizes(tokenizer: Any) -> None:
    """Every two turns the agent replaces its history by a summary: each rewrite starts a
    new sample, counted, whose prompt is the agent's new messages rendered afresh."""

    def policy(prompt: str) -> str:
        return f"note {prompt.count('<|im_start|>')}"

    async def summariser(task: Task, client: openai.AsyncOpenAI) -> str:
        messages: list[Any] = [dict(m) for m in task.prompt]
        for k in range(5):
            reply = await client.chat.completions.create(model="p", messages=messages)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            messages.append({"role": "user", "content": f"continue {k}"})
            if k % 2 == 1:
                messages = [dict(task.prompt[0]), {"role": "user", "content": f"summary of {k}"}]
        return "x"

    backend = ReadingBackend(tokenizer, policy)
    traj, _ = play_agent(tokenizer, summariser, backend, limits=EpisodeLimits(max_turns=8))
    assert traj.error is None, traj.info.get("traceback")
    assert len(traj.turns) == 5
    assert traj.context_rewrites == 2
    samples = traj.samples()
    assert len(samples) == 3
    assert [t.new_sample for t in traj.turns] == [False, False, True, False, True]
    renderer = ChatRenderer(tokenizer)
    at = 0
    for sample, n_turns in zip(samples, (2, 2, 1), strict=True):
        turns = traj.turns[at : at + n_turns]
        at += n_turns
        sampled = [i for t in turns for i in t.completion_ids]
        assert [i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m] == sampled
        # each sample is exactly what the backend was asked for, then what it sampled
        last = backend.requests[traj.turns.index(turns[-1])]
        assert list(sample.input_ids) == [*last.prompt_ids, *turns[-1].completion_ids]
    # the rewritten context is the agent's messages rendered as a fresh prompt
    third = backend.requests[2]
    summary = [dict(PROBE.task(0).prompt[0]), {"role": "user", "content": "summary of 1"}]
    assert list(third.prompt_ids) == list(renderer.prompt(summary))


def test_an_agent_that_edits_a_tool_call_is_a_rewrite(tokenizer: Any) -> None:
    async def editor(task: Task, client: openai.AsyncOpenAI) -> str:
        messages: list[Any] = [dict(m) for m in task.prompt]
        reply = await client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP])
        message = reply.choices[0].message.model_dump(exclude_none=True)
        message["tool_calls"][0]["function"]["arguments"] = json.dumps({"key": "edited"})
        messages += [
            message,
            {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "?"},
        ]
        reply = await client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP])
        return reply.choices[0].message.content or ""

    traj, _ = play_agent(tokenizer, editor, ReadingBackend(tokenizer, oracle))
    assert traj.error is None, traj.info.get("traceback")
    assert traj.context_rewrites == 1
    assert len(traj.samples()) == 2
    # the edited call is rendered from the agent's message, not the policy's sampled text
    assert '"edited"' in tokenizer.decode(list(traj.samples()[1].input_ids))


def test_64_concurrent_agents_lose_nothing(tokenizer: Any) -> None:
    endpoint = PolicyEndpoint()
    environment = AgentEnvironment(
        react_agent, PROBE.task, exact, endpoint=endpoint, name="probe-agent"
    )
    backend = ReadingBackend(tokenizer, oracle)
    spec = GroupSpec(
        group_size=8,
        limits=EpisodeLimits(max_turns=6, timeout_s=60),
        sampling=SamplingParams(stop_token_ids=stop_token_ids(tokenizer)),
        seed=0,
    )
    tasks = [environment.task(i) for i in range(8)]
    start = time.monotonic()
    try:
        groups = asyncio.run(
            collect_groups(tasks, environment.make_env, backend, ChatRenderer(tokenizer), spec)
        )
    finally:
        environment.close()
    took = time.monotonic() - start
    trajs = [t for g in groups for t in g]
    assert len(trajs) == 64
    assert [t.error for t in trajs] == [None] * 64
    assert all(t.success for t in trajs)
    assert sorted((t.task_id, t.sample_index) for t in trajs) == sorted(
        (task.id, i) for task in tasks for i in range(8)
    )
    assert len(backend.requests) == 128  # a call and an answer each, none twice
    assert endpoint.open_episodes == 0
    metrics = rollout_metrics(groups)
    assert metrics["rollout/success_mean"] == 1.0
    assert metrics["rollout/tool_calls_mean"] == 1.0
    assert metrics["rollout/context_rewrites"] == 0.0
    assert took < 60, took


def test_failures_are_recorded_with_the_agents_traceback(tokenizer: Any) -> None:
    backend = ReadingBackend(tokenizer, oracle)

    async def crashes(task: Task, client: openai.AsyncOpenAI) -> str:
        await client.chat.completions.create(model="p", messages=list(task.prompt))
        raise ValueError("the agent's own bug")

    traj, _ = play_agent(tokenizer, crashes, backend)
    assert traj.error == "ValueError: the agent's own bug"
    assert "crashes" in traj.info["traceback"]

    async def silent(task: Task, client: openai.AsyncOpenAI) -> str:
        return "guess"

    traj, _ = play_agent(tokenizer, silent, backend)
    assert traj.stop_reason == "error"
    assert "without ever calling the policy endpoint" in (traj.error or "")

    async def hangs(task: Task, client: openai.AsyncOpenAI) -> str:
        await client.chat.completions.create(model="p", messages=list(task.prompt))
        await asyncio.sleep(3600)
        return ""

    start = time.monotonic()
    traj, endpoint = play_agent(tokenizer, hangs, backend, limits=EpisodeLimits(timeout_s=1.5))
    assert time.monotonic() - start < 15
    assert traj.stop_reason == "error"
    assert "1.5 s deadline" in (traj.error or "")
    assert "agent" in (traj.error or "")
    assert len(traj.turns) == 1  # what it sampled before the hang is kept
    assert endpoint.open_episodes == 0


def test_a_truncated_episode_refuses_the_agents_next_call(tokenizer: Any) -> None:
    refused: list[str] = []

    async def loops(task: Task, client: openai.AsyncOpenAI) -> str:
        messages: list[Any] = [dict(m) for m in task.prompt]
        try:
            for k in range(10):
                reply = await client.chat.completions.create(model="p", messages=messages)
                messages += [reply.choices[0].message, {"role": "user", "content": f"more {k}"}]
        except openai.APIStatusError as exc:
            refused.append(f"{exc.status_code}: {exc.message}")
            raise
        return ""

    traj, _ = play_agent(
        tokenizer,
        loops,
        ReadingBackend(tokenizer, lambda p: "hmm"),
        limits=EpisodeLimits(max_turns=3),
    )
    assert (traj.stop_reason, traj.truncated, traj.error) == ("max_turns", True, None)
    assert len(refused) == 1
    assert refused[0].startswith("409")
    assert "over" in refused[0]


def test_sync_agents_and_agents_in_another_process(tokenizer: Any, tmp_path: Path) -> None:
    def sync_agent(task: Task, client: openai.OpenAI) -> str:
        messages: list[Any] = [dict(m) for m in task.prompt]
        reply = client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP])
        call = reply.choices[0].message.tool_calls[0]
        messages += [reply.choices[0].message, {"role": "tool", "tool_call_id": call.id,
                     "content": task.metadata["table"][json.loads(call.function.arguments)["key"]]}]  # fmt: skip
        return (
            client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP])
            .choices[0]
            .message.content
            or ""
        )

    assert agent_kind(sync_agent) == "sync_client"
    traj, _ = play_agent(tokenizer, sync_agent, ReadingBackend(tokenizer, oracle))
    assert traj.error is None, traj.error
    assert traj.success

    script = tmp_path / "agent.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, sys, openai
        base_url, table, question = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
        client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0)
        tools = [json.loads({json.dumps(LOOKUP)!r})]
        messages = [{{"role": "user", "content": question}}]
        while True:
            m = client.chat.completions.create(model="p", messages=messages, tools=tools).choices[0].message
            if not m.tool_calls:
                print(m.content)
                break
            messages.append(m.model_dump(exclude_none=True))
            for c in m.tool_calls:
                key = json.loads(c.function.arguments)["key"]
                messages.append({{"role": "tool", "tool_call_id": c.id, "content": table[key]}})
    """)
    )

    def in_a_process(task: Task, *, base_url: str, api_key: str) -> str:
        out = subprocess.run(
            [sys.executable, str(script), base_url, json.dumps(dict(task.metadata["table"])),
             str(task.prompt[0]["content"])],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if out.returncode:
            raise RuntimeError(out.stderr[-2000:])
        return out.stdout.strip()

    assert agent_kind(in_a_process) == "base_url"
    traj, _ = play_agent(tokenizer, in_a_process, ReadingBackend(tokenizer, oracle))
    assert traj.error is None, traj.error
    assert traj.success


def test_http_errors_are_openai_shaped(tokenizer: Any) -> None:
    import httpx

    endpoint = PolicyEndpoint(api_key="secret")
    try:
        base = endpoint.address
        auth = {"Authorization": "Bearer secret"}
        r = httpx.post(
            f"{base}/episodes/nope/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}]},
            headers=auth,
        )
        assert r.status_code == 404
        assert "no episode 'nope'" in r.json()["error"]["message"]
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": []}, headers=auth)
        assert r.status_code == 400
        assert "messages" in r.json()["error"]["message"]
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={"messages": [{"role": "user"}], "n": 2},
            headers=auth,
        )
        assert r.status_code == 400
        assert "n must be 1" in r.json()["error"]["message"]
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user"}]})
        assert r.status_code == 401
        r = httpx.get(f"{base}/v1/models", headers=auth)
        assert r.json()["data"][0]["id"] == "turnrl-policy"
    finally:
        endpoint.close()


def test_two_calls_at_once_in_one_episode_are_refused(tokenizer: Any) -> None:
    statuses: list[int] = []

    async def forks(task: Task, client: openai.AsyncOpenAI) -> str:
        calls = [
            client.chat.completions.create(model="p", messages=list(task.prompt)) for _ in range(2)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        statuses.extend(getattr(r, "status_code", 200) for r in results)
        return "x"

    # the policy takes 3 s, so the second request arrives while the first is in flight
    traj, _ = play_agent(tokenizer, forks, ReadingBackend(tokenizer, lambda p: "a", delay_s=3.0))
    assert sorted(statuses) == [200, 409]
    assert traj.error is None


def test_bad_agents_and_rewards_fail_early(tokenizer: Any) -> None:
    with pytest.raises(TypeError, match="agent\\(task, client\\)"):
        AgentEnvironment(lambda task: "x", [PROBE.task(0)], exact)
    with pytest.raises(TypeError, match="reward must be a function"):
        AgentEnvironment(react_agent, [PROBE.task(0)], 1.0)  # type: ignore[arg-type]
    environment = AgentEnvironment(react_agent, ["plain text task", {"q": 1}], exact)
    task = environment.task(1)
    assert task.metadata["agent_task"] == {"q": 1}
    environment.close()


def test_train_takes_an_agent_with_its_tasks_and_reward(tmp_path: Path) -> None:
    import turnrl
    from conftest import SMALL_RUN

    probe = SecretLookup(num_keys=2, key_pool=2, num_values=12)
    result = turnrl.train(
        "grpo", agent=react_agent, tasks=probe.task, reward=exact, out=tmp_path / "ok",
        overrides=SMALL_RUN, progress=False,
    )  # fmt: skip
    trained = [r for r in result.rows if "loss/policy" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(r["rollout/errors"] == 0 for r in trained)
    assert all(r["rollout/turns_mean"] >= 1 for r in trained)

    async def buggy(task: Task, client: openai.AsyncOpenAI) -> str:
        await client.chat.completions.create(model="p", messages=list(task.prompt))
        return task.metadata["no such key"]  # the agent's own bug

    with pytest.raises(turnrl.EpisodeFailures, match="KeyError") as failed:
        turnrl.train(
            "grpo", agent=buggy, tasks=probe.task, reward=exact, out=tmp_path / "bug",
            overrides=SMALL_RUN, progress=False,
        )  # fmt: skip
    assert "buggy" in str(failed.value)  # the user's traceback, naming their function
    with pytest.raises(turnrl.ConfigError, match="not both"):
        turnrl.train(env=probe, agent=react_agent, tasks=probe.task, reward=exact)


def test_thousands_of_agents_wait_their_turn(tokenizer: Any) -> None:
    """As in the warm-up (thousands of demonstrations at once): at most max_concurrent
    agents run at a time, the rest wait, and none is lost or fails to connect."""
    running = [0, 0]  # now, most

    async def counted(task: Task, client: openai.AsyncOpenAI) -> str:
        running[0] += 1
        running[1] = max(running)
        try:
            return await react_agent(task, client)
        finally:
            running[0] -= 1

    environment = AgentEnvironment(counted, PROBE.task, exact, max_concurrent=32)
    spec = GroupSpec(
        group_size=4,
        limits=EpisodeLimits(max_turns=6, timeout_s=120),
        sampling=SamplingParams(stop_token_ids=stop_token_ids(tokenizer)),
        seed=0,
    )
    tasks = [environment.task(i) for i in range(128)]
    try:
        groups = asyncio.run(
            collect_groups(
                tasks, environment.make_env, ReadingBackend(tokenizer, oracle),
                ChatRenderer(tokenizer), spec,
            )
        )  # fmt: skip
    finally:
        environment.close()
    trajs = [t for g in groups for t in g]
    assert len(trajs) == 512
    assert [t.error for t in trajs] == [None] * 512
    assert all(t.success for t in trajs)
    assert 1 < running[1] <= 32  # bounded, and concurrent
