"""The Responses API and streaming on the policy endpoint (turnrl.envs.openai_api).

Real ``openai`` clients over loopback HTTP against the real endpoint; the policy is the
backend double of tests/test_agent_endpoint.py (replies chosen from the prompt) or the
real torch sampler on the tiny model. Checked: an agent on the Responses API (sending
output items back, or continuing by ``previous_response_id``) and agents that stream
train on exactly the tokens of the same agent on chat completions; what is streamed is
what the trajectory holds; what the endpoint cannot serve is refused with 400, saying why.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from agent_workers import LOOKUP, react_agent
from test_agent_endpoint import PROBE, ReadingBackend, oracle, play_agent
from turnrl.backends.torch_backend import TorchBackend
from turnrl.rollout.episode import EpisodeLimits
from turnrl.types import Task

TOOL = {"type": "function", "name": "lookup", **{
    k: LOOKUP["function"][k] for k in ("description", "parameters")}}  # fmt: skip
"""The probe's lookup tool in the Responses API's form."""


def _lookup(task: Task, name: str, arguments: str) -> str:
    key = json.loads(arguments).get("key")
    return str(task.metadata["table"].get(key, f"Error: no key {key!r}"))


async def responses_agent(task: Task, client: openai.AsyncOpenAI) -> str:
    """``react_agent`` on the Responses API, keeping the history itself: each response's
    output items go back as input, with a ``function_call_output`` per call."""
    items: list[Any] = [{"role": m["role"], "content": m["content"]} for m in task.prompt]
    for _ in range(4):
        response = await client.responses.create(model="policy", input=items, tools=[TOOL])
        calls = [o for o in response.output if o.type == "function_call"]
        if not calls:
            return response.output_text
        items += [o.model_dump(exclude_none=True) for o in response.output]
        items += [
            {"type": "function_call_output", "call_id": c.call_id,
             "output": _lookup(task, c.name, c.arguments)}
            for c in calls
        ]  # fmt: skip
    return ""


async def chained_agent(task: Task, client: openai.AsyncOpenAI) -> str:
    """The same agent, letting the endpoint keep the history: each request sends only the
    tool results, after ``previous_response_id``."""
    items: list[Any] = [{"role": m["role"], "content": m["content"]} for m in task.prompt]
    previous = None
    for _ in range(4):
        response = await client.responses.create(
            model="policy", input=items, tools=[TOOL],
            **({"previous_response_id": previous} if previous else {}),
        )  # fmt: skip
        calls = [o for o in response.output if o.type == "function_call"]
        if not calls:
            return response.output_text
        previous = response.id
        items = [
            {"type": "function_call_output", "call_id": c.call_id,
             "output": _lookup(task, c.name, c.arguments)}
            for c in calls
        ]  # fmt: skip
    return ""


async def streaming_chat_agent(task: Task, client: openai.AsyncOpenAI) -> str:
    """``react_agent`` with ``stream=True``: the reply assembled from its chunks."""
    messages: list[Any] = [dict(m) for m in task.prompt]
    for _ in range(4):
        stream = await client.chat.completions.create(
            model="policy", messages=messages, tools=[LOOKUP], stream=True
        )
        content, calls = "", {}
        async for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for c in delta.tool_calls or ():
                calls[c.index] = c
        if not calls:
            return content
        messages.append({"role": "assistant", "content": content or None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name,
             "arguments": c.function.arguments}} for c in calls.values()]})  # fmt: skip
        for c in calls.values():
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": _lookup(task, c.function.name, c.function.arguments)})  # fmt: skip
    return ""


async def streaming_responses_agent(task: Task, client: openai.AsyncOpenAI) -> str:
    """``responses_agent`` with ``stream=True``: the response of the completed event, its
    text also assembled from the deltas."""
    items: list[Any] = [{"role": m["role"], "content": m["content"]} for m in task.prompt]
    for _ in range(4):
        stream = await client.responses.create(
            model="policy", input=items, tools=[TOOL], stream=True
        )
        text, response = "", None
        async for event in stream:
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type == "response.completed":
                response = event.response
        assert response is not None
        assert text == response.output_text
        calls = [o for o in response.output if o.type == "function_call"]
        if not calls:
            return text
        items += [o.model_dump(exclude_none=True) for o in response.output]
        items += [
            {"type": "function_call_output", "call_id": c.call_id,
             "output": _lookup(task, c.name, c.arguments)}
            for c in calls
        ]  # fmt: skip
    return ""


@pytest.mark.parametrize(
    "agent", [responses_agent, chained_agent, streaming_chat_agent, streaming_responses_agent]
)
def test_every_api_trains_on_the_tokens_of_chat_completions(tokenizer: Any, agent: Any) -> None:
    task = PROBE.task(5)
    traj, endpoint = play_agent(tokenizer, agent, ReadingBackend(tokenizer, oracle), task=task)
    assert traj.error is None, traj.info.get("traceback")
    assert (traj.success, traj.reward, traj.stop_reason) == (True, 1.0, "answered")
    assert [(c.name, c.ok) for c in traj.tool_calls] == [("lookup", True)]
    assert traj.context_rewrites == 0
    assert endpoint.open_episodes == 0
    twin, _ = play_agent(tokenizer, react_agent, ReadingBackend(tokenizer, oracle), task=task)
    assert twin.success
    assert traj.samples() == twin.samples()


async def streams_both(task: Task, client: openai.AsyncOpenAI) -> list[Any]:
    """A chat completion then a response, both streamed with log-probs; returns what each
    stream carried: (text, token ids as vLLM names them, ``token_id:<id>``, log-probs)."""
    streamed: list[Any] = []
    messages: list[Any] = [dict(m) for m in task.prompt]
    stream = await client.chat.completions.create(
        model="p",
        messages=messages,
        logprobs=True,
        stream=True,
        stop=["a", "e", " "],
        stream_options={"include_usage": True},
    )  # fmt: skip  (stop strings, honoured, end the random model's turn early)
    text, ids, lps, usage = "", [], [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            for lp in (chunk.choices[0].logprobs and chunk.choices[0].logprobs.content) or ():
                ids.append(int(lp.token.removeprefix("token_id:")))
                lps.append(lp.logprob)
    assert usage is not None
    assert usage.completion_tokens == len(ids)
    streamed.append((text, ids, lps))
    if task.id.endswith("-1"):
        return streamed
    items: list[Any] = [
        *({"role": m["role"], "content": m["content"]} for m in messages),
        {"role": "assistant", "content": text},
        {"role": "user", "content": "go on"},
    ]
    events = await client.responses.create(
        model="p", input=items, include=["message.output_text.logprobs"], stream=True
    )
    text, ids, lps = "", [], []
    async for event in events:
        if event.type == "response.output_text.delta":
            text += event.delta
            ids += [int(lp.token.removeprefix("token_id:")) for lp in event.logprobs]
            lps += [lp.logprob for lp in event.logprobs]
    streamed.append((text, ids, lps))
    return streamed


@pytest.mark.parametrize("sampler", ["the tiny model", "a double writing non-ASCII text"])
def test_what_is_streamed_is_what_was_sampled(tokenizer: Any, model: Any, sampler: str) -> None:
    """The streamed events of both APIs carry the turn's text and its tokens exactly as
    the trajectory holds them, and the training sample is those tokens. The tiny model
    writes what it writes (its turn ended by stop strings; a Responses request has none,
    so it plays the chat turn only); the double writes accents and symbols."""
    carried: list[Any] = []

    def reward(task: Task, answer: list[Any], transcript: list[dict[str, Any]]) -> float:
        carried.extend(answer)
        return 0.0

    if sampler == "the tiny model":
        backend: Any = TorchBackend(model, tokenizer)
        task = PROBE.task(1)
    else:
        backend = ReadingBackend(tokenizer, lambda prompt: f"naïve café ✓ {prompt.count('go on')}")
        task = PROBE.task(2)
    traj, _ = play_agent(
        tokenizer, streams_both, backend, task=task, reward=reward,
        limits=EpisodeLimits(max_turns=4, max_tokens_per_turn=24),
    )  # fmt: skip
    assert traj.error is None, traj.info.get("traceback")
    assert traj.context_rewrites == 0
    assert len(carried) == len(traj.turns) == (1 if sampler == "the tiny model" else 2)
    for turn, (text, ids, lps) in zip(traj.turns, carried, strict=True):
        assert text == turn.text
        assert ids == list(turn.completion_ids)
        assert lps == list(turn.completion_logprobs)
    [sample] = traj.samples()
    sampled = [i for turn in traj.turns for i in turn.completion_ids]
    assert [i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m] == sampled


def test_instructions_and_a_changed_history_through_the_responses_api(tokenizer: Any) -> None:
    """``instructions`` are the system message of every request (not carried over by
    ``previous_response_id``, as in OpenAI's API); a request whose history differs from the
    conversation the endpoint answered starts a new sample, as through chat completions."""
    prompts: list[str] = []

    def policy(prompt: str) -> str:
        prompts.append(prompt)
        return f"reply {len(prompts)}"

    async def agent(task: Task, client: openai.AsyncOpenAI) -> str:
        first = await client.responses.create(model="p", instructions="Be brief.", input="hi")
        second = await client.responses.create(
            model="p", instructions="Be brief.", input="and?", previous_response_id=first.id
        )
        assert second.previous_response_id == first.id
        rewritten = await client.responses.create(
            model="p", instructions="Be brief.", input=[{"role": "user", "content": "summary"}]
        )
        return rewritten.output_text

    traj, _ = play_agent(tokenizer, agent, ReadingBackend(tokenizer, policy))
    assert traj.error is None, traj.info.get("traceback")
    assert (len(traj.turns), traj.context_rewrites) == (3, 1)
    assert "Be brief." in prompts[0]
    assert prompts[1].startswith(prompts[0])  # continued: the first turn's prompt, extended
    assert "reply 1" in prompts[1]
    assert "and?" in prompts[1]
    assert "reply" not in prompts[2]  # the rewrite is its own messages, afresh
    assert [m["role"] for m in traj.messages] == ["system", "user", "assistant"]


def test_what_the_responses_endpoint_cannot_serve_is_refused_saying_why(tokenizer: Any) -> None:
    statuses: list[tuple[int, str]] = []
    bad = [
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        {"input": "hi", "tools": [{"type": "web_search"}]},
        {"input": [{"type": "reasoning", "summary": []}]},
        {"input": "hi", "previous_response_id": "resp_elsewhere"},
        {"input": "hi", "conversation": "conv_1"},
        {"input": []},
    ]

    async def agent(task: Task, client: openai.AsyncOpenAI) -> str:
        for body in bad:
            try:
                await client.responses.create(model="p", **body)
            except openai.BadRequestError as exc:
                statuses.append((exc.status_code, str(exc.message)))
        reply = await client.responses.create(model="p", input="fine")
        return reply.output_text

    traj, endpoint = play_agent(tokenizer, agent, ReadingBackend(tokenizer, lambda p: "ok"))
    assert traj.error is None, traj.info.get("traceback")
    assert [s for s, _ in statuses] == [400] * len(bad)
    for needle, (_, message) in zip(
        ["'input_image'", "'web_search'", "'reasoning'", "resp_elsewhere", "conversation", "input"],
        statuses, strict=True,
    ):  # fmt: skip
        assert needle in message, message
    try:  # and over HTTP without an episode: OpenAI-shaped errors, as for chat completions
        r = httpx.post(f"{endpoint.address}/episodes/nope/v1/responses", json={"input": "x"})
        assert r.status_code == 404
        assert "no episode 'nope'" in r.json()["error"]["message"]
    finally:
        endpoint.close()
