"""MCP tools against a real MCP server (tests/mcp_server.py, written with the ``mcp`` SDK),
over stdio and streamable HTTP: listing, calls from episodes (scripted model, real
tokenizer and chat template), and every failure turned into an observation."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from turnrl.backends.scripted import ScriptedBackend
from turnrl.envs.tool_env import ToolEnv
from turnrl.errors import ConfigError
from turnrl.formats import get_format
from turnrl.models.loading import stop_token_ids
from turnrl.rewards import exact_match
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, run_episode
from turnrl.tools.mcp_client import McpError, McpServer
from turnrl.types import Completion, GenerationRequest, Task, ToolCall, Trajectory

SERVER = str(Path(__file__).with_name("mcp_server.py"))
HERMES = get_format("hermes")
TASK = Task(id="t", prompt=({"role": "user", "content": "What is 2 + 3?"},), answer="5")


def start_http_server() -> tuple[subprocess.Popen[bytes], str]:
    """Start the test server on a free port; return it and its URL once it accepts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, SERVER, "http", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"http://127.0.0.1:{port}/mcp"
        if proc.poll() is not None:
            raise RuntimeError(f"the test MCP server exited with {proc.returncode}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the test MCP server did not open its port in 30 s")


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    proc, url = start_http_server()
    yield url
    proc.kill()
    proc.wait()


def stdio(**kwargs: Any) -> McpServer:
    return McpServer([sys.executable, SERVER, "stdio"], **kwargs)


@pytest.fixture(params=["stdio", "http"])
def server(request: pytest.FixtureRequest) -> McpServer:
    if request.param == "stdio":
        return stdio(timeout_s=5)
    return McpServer(request.getfixturevalue("http_url"), timeout_s=5)


def call(name: str, **arguments: Any) -> str:
    return HERMES.render_call(ToolCall(name, arguments))


def play(tokenizer: Any, env: ToolEnv, texts: list[str], max_turns: int = 6) -> Trajectory:
    stops = stop_token_ids(tokenizer)
    backend = ScriptedBackend(tokenizer, texts, end_token_id=stops[0])

    async def generate(request: GenerationRequest) -> Completion:
        return (await backend.generate([request]))[0]

    return asyncio.run(
        run_episode(
            env, TASK, generate, ChatRenderer(tokenizer),
            limits=EpisodeLimits(max_turns=max_turns),
            sampling=SamplingParams(stop_token_ids=stops), seed=0,
        )
    )  # fmt: skip


def mcp_env(server: McpServer) -> ToolEnv:
    return ToolEnv(server.toolset, lambda task, answer: exact_match(answer, "5"), format=HERMES)


def observations(traj: Trajectory) -> list[str]:
    return [str(m["content"]) for m in traj.messages if m["role"] == "tool"]


def test_lists_the_servers_tools_with_their_schemas() -> None:
    async def main() -> list[Any]:
        session = await stdio(prefix="calc_").connect()
        try:
            return [(t.name, t.parameters) for t in session.tools]
        finally:
            await session.close()

    tools = dict(asyncio.run(main()))
    assert set(tools) == {
        f"calc_{n}" for n in ("add", "echo", "fail", "slow", "big", "count", "die")
    }
    add = tools["calc_add"]
    assert add["required"] == ["a", "b"]
    assert add["properties"]["a"]["type"] == "integer"


def test_an_episode_calls_the_servers_tools(tokenizer: Any, server: McpServer) -> None:
    traj = play(tokenizer, mcp_env(server), [call("add", a=2, b=3), "5"])
    assert traj.error is None, traj.error
    assert traj.stop_reason == "answered"
    assert traj.reward == 1.0
    assert observations(traj) == ["5"]
    (record,) = traj.tool_calls
    assert (record.name, record.arguments, record.ok) == ("add", {"a": 2, "b": 3}, True)
    # the model was shown the server's tools through the chat template
    assert '"name": "add"' in tokenizer.decode(traj.samples()[0].input_ids)


def test_each_stdio_episode_gets_a_fresh_server(tokenizer: Any) -> None:
    # count() keeps state in the server process: a new session per episode starts at 1.
    env_server = stdio()
    for _ in range(2):
        traj = play(tokenizer, mcp_env(env_server), [call("count"), call("count"), "5"])
        assert observations(traj) == ["1", "2"]


def test_tool_failures_are_observations(tokenizer: Any, server: McpServer) -> None:
    # fewer tools, so that the tool list and five turns fit the tiny model's context
    limited = McpServer(
        server.target, timeout_s=1.0, max_output_chars=50, include=["add", "fail", "slow", "big"]
    )
    texts = [
        call("fail", message="no such city"),  # the tool reports an error
        call("add", a="two", b=3),  # fails validation: never sent
        call("slow", seconds=10),  # per-call timeout
        call("big", chars=500),  # output cut with a visible marker
        call("nope"),  # not a tool of the server
        "5",
    ]
    traj = play(tokenizer, mcp_env(limited), texts)
    assert traj.error is None, traj.error
    fail, bad_args, slow, big, unknown = observations(traj)
    assert fail.startswith("Error:")
    assert "no such city" in fail
    assert "argument 'a' must be an integer" in bad_args
    assert "timed out after 1s" in slow
    assert big == "x" * 50 + "\n...[truncated 450 chars]"
    assert "unknown tool 'nope'; available tools: add, fail, slow, big" in unknown
    assert [r.ok for r in traj.tool_calls] == [False, False, False, True, False]
    assert (traj.stop_reason, traj.reward) == ("answered", 1.0)  # it went on to its answer


def test_stdio_server_death_is_an_observation_and_later_calls_fail_fast(tokenizer: Any) -> None:
    traj = play(tokenizer, mcp_env(stdio()), [call("die"), call("add", a=2, b=3), "5"])
    assert traj.error is None, traj.error
    died, after = observations(traj)
    assert "is gone" in died
    assert "dying on request" in died  # the server's last words on stderr
    assert "is gone" in after
    assert traj.tool_calls[1].latency_s < 1.0
    assert traj.stop_reason == "answered"


def test_http_server_death_is_an_observation(tokenizer: Any) -> None:
    proc, url = start_http_server()
    try:
        traj = play(tokenizer, mcp_env(McpServer(url, timeout_s=5)), [call("die"), "5"])
    finally:
        proc.kill()
        proc.wait()
    assert traj.error is None, traj.error
    (died,) = observations(traj)
    assert died.startswith("Error:")
    assert "is gone" in died


def test_a_server_that_cannot_start_is_a_failed_episode_not_a_crash(tokenizer: Any) -> None:
    broken = McpServer(
        [sys.executable, "-c", "import sys; print('no', file=sys.stderr); sys.exit(2)"]
    )
    traj = play(tokenizer, mcp_env(broken), ["5"])
    assert traj.stop_reason == "error"
    assert str(traj.error).startswith("McpError:")
    with pytest.raises(McpError, match=r"ConnectError|connect"):
        asyncio.run(McpServer("http://127.0.0.1:9/mcp", connect_timeout_s=5).connect())


def test_bad_targets_and_unknown_tools_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="http"):
        McpServer("localhost:8000")
    with pytest.raises(ConfigError, match="list of strings"):
        McpServer([])
    with pytest.raises(McpError, match=r"\['missing'\] not offered"):
        asyncio.run(stdio(include=["add", "missing"]).connect())
