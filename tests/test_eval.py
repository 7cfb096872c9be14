"""`turnrl eval` against a real OpenAI-compatible server (`turnrl serve` on the tiny model,
started by the test as its own process) and against a local checkpoint: the numbers, the
saved episodes, and resuming an interrupted evaluation without redoing finished episodes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from turnrl.errors import ConfigError
from turnrl.evaluation import EvalConfig, evaluate, summarize
from turnrl.evaluation.runner import summary_lines

ENV = {"num_keys": 2, "key_pool": 2}


def turnrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "turnrl.cli", *args]


@pytest.fixture(scope="module")
def endpoint(tiny_model_dir: Path) -> Iterator[str]:
    proc = subprocess.Popen(
        turnrl("serve", str(tiny_model_dir), "--port", "0"),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    url = None
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"turnrl serve exited with {proc.returncode}")
        if found := re.search(r"at (http://\S+/v1)", line):
            url = found[1]
    assert url is not None, "turnrl serve did not start"
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    proc.stdout.close()


def rows(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]


def test_the_server_speaks_the_openai_api(endpoint: str) -> None:
    with urllib.request.urlopen(f"{endpoint}/models") as r:
        models = json.loads(r.read())
    assert models["data"][0]["id"] == "model"
    body = {"messages": [{"role": "user", "content": "What is the value of alpha?"}],
            "max_tokens": 8, "seed": 3}  # fmt: skip
    request = urllib.request.Request(f"{endpoint}/chat/completions", json.dumps(body).encode())
    with urllib.request.urlopen(request) as r:
        reply = json.loads(r.read())
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert 1 <= reply["usage"]["completion_tokens"] <= 8
    with urllib.request.urlopen(request) as r:  # the same seed samples the same text
        assert json.loads(r.read())["choices"] == reply["choices"]
    bad = urllib.request.Request(f"{endpoint}/chat/completions", b'{"messages": []}')
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(bad)
    assert caught.value.code == 400
    assert "non-empty list" in caught.value.read().decode()


def test_eval_against_the_endpoint(endpoint: str, tmp_path: Path) -> None:
    config = EvalConfig("secret_lookup", ENV, n=4, k=2, max_turns=3, max_tokens_per_turn=24)
    summary = evaluate(config, tmp_path, endpoint=endpoint, progress=False)
    episodes = rows(tmp_path)
    assert len(episodes) == 8
    assert {(r["task_id"], r["sample"]) for r in episodes} == {
        (f"test-{i}", s) for i in range(4) for s in range(2)
    }
    assert summary == {**summarize(episodes, 2), "card": summary["card"], "source": endpoint}
    assert summary["episodes"] == 8
    assert summary["errors"] == 0
    assert any("lookup(key" in line for line in summary["card"])
    first = episodes[0]["messages"]
    assert isinstance(first, list)
    assert first[0]["role"] == "user"
    assert first[1]["role"] == "assistant"
    assert json.loads((tmp_path / "summary.json").read_text())["episodes"] == 8


def test_an_interrupted_eval_resumes_without_redoing_episodes(
    endpoint: str, tmp_path: Path
) -> None:
    args = ["eval", "--env", "secret_lookup", "--set", "num_keys=2", "--set", "key_pool=2",
            "--endpoint", endpoint, "--n", "24", "--k", "1", "--concurrency", "1",
            "--max-tokens", "24", "--out", str(tmp_path), "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(turnrl(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    path = tmp_path / "episodes.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= 3:
            proc.kill()  # interrupted mid-evaluation
            break
        time.sleep(0.02)
    proc.wait()
    before = path.read_text().splitlines()
    assert 3 <= len(before) < 24, "the run was not interrupted midway; make it longer"
    with path.open("a") as f:
        f.write('{"task_id": "test-9", "sam')  # a torn last line, as a crash leaves it
    done = subprocess.run(turnrl(*args), capture_output=True, text=True, check=True)
    assert "| 24 |" in done.stdout
    after = path.read_text().splitlines()
    assert after[: len(before)] == before  # finished episodes kept as they were
    keys = [(r["task_id"], r["sample"]) for r in map(json.loads, after)]
    assert len(keys) == len(set(keys)) == 24  # every episode once: none redone


def test_eval_of_a_local_checkpoint_and_a_settings_guard(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = EvalConfig("secret_lookup", ENV, n=3, k=2, max_tokens_per_turn=24)
    summary = evaluate(config, tmp_path, model_path=tiny_model_dir, progress=False)
    episodes = rows(tmp_path)
    assert len(episodes) == 6
    assert all(r["completion_tokens"] > 0 for r in episodes)
    again = evaluate(config, tmp_path, model_path=tiny_model_dir, progress=False)
    assert again == summary  # nothing left to run: the same numbers
    assert len(rows(tmp_path)) == 6
    with pytest.raises(ConfigError, match="other settings"):
        evaluate(EvalConfig("secret_lookup", ENV, n=5), tmp_path, model_path=tiny_model_dir)
    with pytest.raises(ConfigError, match="exactly one"):
        evaluate(config, tmp_path / "x")


def test_the_summary_names_each_distinct_error_and_what_to_do() -> None:
    vllm_400 = (
        "RuntimeError: POST http://127.0.0.1:8000/v1/chat/completions: HTTP 400: "
        '{"error": {"message": "\\"auto\\" tool choice requires --enable-auto-tool-choice and '
        '--tool-call-parser to be set"}}'
    )
    summary = {
        "k": 1, "episodes": 66, "success": 0.0, "pass@1": 0.0, "reward_mean": 0.0,
        "turns_mean": 0.0, "tool_calls_mean": 0.0, "tool_error_rate": 0.0,
        "completion_tokens_mean": 0.0, "reward_components": {}, "stop_reasons": {"error": 66},
        "errors": 66, "error_messages": {vllm_400: 64, "TimeoutError: timed out": 2},
    }  # fmt: skip
    text = "\n".join(summary_lines(summary))
    assert "errors: 66 episode(s) failed" in text
    assert f"64x {vllm_400}" in text
    assert "--enable-auto-tool-choice --tool-call-parser hermes" in text.split("64x")[1]
    assert "2x TimeoutError: timed out" in text
    assert "lower --concurrency" in text


def test_the_server_speaks_the_responses_api_and_streams_both(endpoint: str) -> None:
    """The real ``openai`` client against ``turnrl serve``: a Responses request samples
    what the chat completion of the same conversation samples (the same seed), a later
    request continues it by ``previous_response_id``, function-call items are taken as
    input, and ``stream=True`` of either API carries the very text of the reply."""
    client = openai.OpenAI(base_url=endpoint, api_key="none", max_retries=0, timeout=120)
    question = "What is the value of alpha?"
    chat = client.chat.completions.create(
        model="model", max_tokens=8, seed=3,
        messages=[{"role": "system", "content": "Answer."}, {"role": "user", "content": question}],
    )  # fmt: skip
    text = chat.choices[0].message.content
    seed = {"seed": 3}  # not a Responses parameter of OpenAI's; turnrl serve takes it
    response = client.responses.create(
        model="model", instructions="Answer.", input=question, max_output_tokens=8,
        extra_body=seed,
    )  # fmt: skip
    assert response.output_text == text
    assert 1 <= response.usage.output_tokens <= 8
    later = client.responses.create(
        model="model", previous_response_id=response.id, input="And beta?",
        max_output_tokens=4,
    )  # fmt: skip
    assert later.previous_response_id == response.id
    assert later.usage.input_tokens > response.usage.input_tokens  # the history came first
    with pytest.raises(openai.BadRequestError, match="is not one of this server's"):
        client.responses.create(model="model", previous_response_id="resp_0", input="x")
    called = client.responses.create(
        model="model", max_output_tokens=4,
        input=[
            {"role": "user", "content": question},
            {"type": "function_call", "call_id": "c1", "name": "lookup",
             "arguments": '{"key": "alpha"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "cat"},
        ],
    )  # fmt: skip
    assert called.status == "completed"

    stream = client.chat.completions.create(
        model="model", max_tokens=8, seed=3, stream=True,
        messages=[{"role": "system", "content": "Answer."}, {"role": "user", "content": question}],
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason is not None
    events = list(
        client.responses.create(
            model="model", instructions="Answer.", input=question, max_output_tokens=8,
            extra_body=seed, stream=True,
        )
    )  # fmt: skip
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == text
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == text
