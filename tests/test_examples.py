"""The examples run as a user runs them (a few tiny steps each), and the README shows the
calculator example exactly as it is in examples/."""

from __future__ import annotations

import asyncio
import json
import random
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SMALL_RUN
from turnrl import get_format
from turnrl.envs.custom import default_corpus, default_demonstration

ROOT = Path(__file__).resolve().parents[1]
# The agent frameworks' examples train a few steps in their own tests (test_langgraph.py,
# test_pydantic_ai.py, test_smolagents.py, test_dspy.py), skipped where the framework is
# not installed; here they would train a second time.
OWN_TESTS = {"langgraph_agent", "pydantic_ai_agent", "smolagents_agent", "dspy_agent"}
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if p.stem not in OWN_TESTS)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_each_example_trains_a_few_steps(path: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(path), *SMALL_RUN], cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (metrics,) = tmp_path.glob("runs/*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if "loss/policy" in r] == [1, 2]
    assert all(r["rollout/errors"] == 0 for r in rows if "rollout/errors" in r)


def test_the_calculator_is_under_25_lines_without_ceremony_and_is_the_readme_s() -> None:
    source = (ROOT / "examples" / "calculator.py").read_text()
    assert len(source.splitlines()) < 25
    assert "get_format" not in source  # the run's model family chooses the call format
    assert '"role"' not in source  # the prompt is a string
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert source in blocks


def test_the_derived_demonstration_calls_a_tool_in_the_format_then_answers() -> None:
    calculator = runpy.run_path(str(ROOT / "examples" / "calculator.py"))
    make_env = calculator["environment"].make_env
    task = calculator["make_task"](3, "train")
    turns = asyncio.run(default_demonstration(make_env, task, seed=1))
    assert len(turns) == 2
    (call,) = get_format("hermes").parse(turns[0]).tool_calls
    assert call.name == "multiply"
    assert set(call.arguments) == {"a", "b"}
    words = task.prompt[0]["content"].replace("?", " ").split()
    assert all(str(v) in words for v in call.arguments.values())  # numbers it read
    again = asyncio.run(default_demonstration(make_env, task, seed=1))
    assert again == turns  # seeded
    # The answer is a word or number of the prompt or of the tool's reply to that call:
    # over seeds, both kinds occur (the reply is the product of the call's arguments).
    answers = set()
    for seed in range(40):
        call_text, answer = asyncio.run(default_demonstration(make_env, task, seed=seed))
        (call,) = get_format("hermes").parse(call_text).tool_calls
        reply = str(call.arguments["a"] * call.arguments["b"])
        assert answer in words or answer == reply
        answers.add("reply" if answer == reply else "prompt")
    assert answers == {"reply", "prompt"}


def test_the_derived_corpus_has_the_prompts_answers_and_tools() -> None:
    calculator = runpy.run_path(str(ROOT / "examples" / "calculator.py"))
    corpus = default_corpus(calculator["environment"], num_tasks=5)
    task = calculator["make_task"](0, "train")
    assert task.prompt[0]["content"] in corpus
    assert task.answer in corpus
    assert "multiply" in corpus
    assert any("<tool_call>" in line for line in corpus)


@pytest.mark.parametrize(
    ("family_format", "marker"), [("hermes", "<tool_call>"), ("llama3_json", '{"name": "multiply"')]
)
def test_the_calculator_writes_calls_in_the_run_s_family_format(
    family_format: str, marker: str
) -> None:
    """No format in the example: the run's (here set as turnrl.train sets it) decides how
    the warm-up writes the call and how the episode parses it."""
    calculator = runpy.run_path(str(ROOT / "examples" / "calculator.py"))
    environment = calculator["environment"].with_format(family_format)
    assert environment.make_env().format.name == family_format
    task = environment.task(3)
    call, _answer = asyncio.run(environment.demonstration(task, random.Random(1)))
    assert marker in call
    assert "<tool_call>" not in call or family_format == "hermes"
    (parsed,) = get_format(family_format).parse(call).tool_calls
    assert parsed.name == "multiply"
