"""``from_verifiers``: real ``verifiers`` environments (a single-turn exact-match task, a
calculator ToolEnv, a MultiTurnEnv guessing game) built from in-memory datasets, adapted,
and played through turnrl's rollout with a scripted model and the real tokenizer/template.
No verifiers object is mocked; the model is the only thing scripted."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

vf = pytest.importorskip("verifiers", reason="verifiers is not installed (the verifiers extra)")
datasets = pytest.importorskip("datasets", reason="verifiers' datasets is not installed")

from turnrl.backends.scripted import ScriptedBackend  # noqa: E402
from turnrl.envs.policy import Episode, play, replay  # noqa: E402
from turnrl.envs.registry import make_env_family  # noqa: E402
from turnrl.envs.verifiers_env import VerifiersFamily, from_verifiers  # noqa: E402
from turnrl.errors import ConfigError  # noqa: E402
from turnrl.formats import get_format  # noqa: E402
from turnrl.models.loading import stop_token_ids  # noqa: E402
from turnrl.rollout.chat import ChatRenderer  # noqa: E402
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, run_episode  # noqa: E402
from turnrl.types import Completion, GenerationRequest, ToolCall, Trajectory  # noqa: E402

HERMES = get_format("hermes")
LIMITS = EpisodeLimits(max_turns=6, max_tokens_per_turn=256, max_episode_tokens=2048,
                       max_context_tokens=8192)  # fmt: skip
QUESTIONS = [
    {"question": "What is 2 + 3?", "answer": "5"},
    {"question": "What is 4 * 4?", "answer": "16"},
    {"question": "What is 9 - 7?", "answer": "2"},
]


@pytest.fixture(autouse=True)
def _keep_signal_handlers() -> Iterator[None]:
    """A verifiers Environment installs SIGINT/SIGTERM handlers when built; give the test
    process its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    datasets.disable_progress_bars()
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def dataset(rows: list[dict[str, Any]] = QUESTIONS) -> Any:
    return datasets.Dataset.from_list(rows)


def exact_match(completion: Any, answer: str, parser: Any) -> float:
    return float((parser.parse_answer(completion) or "").strip() == answer)


def tagged(completion: Any, parser: Any) -> float:
    """The format term: the last message has an <answer> tag."""
    return float(parser.parse_answer(completion) is not None)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. 2 + 3.
    """
    allowed = set("0123456789+-*/(). ")
    if not set(expression) <= allowed:
        raise ValueError(f"not arithmetic: {expression!r}")
    return str(eval(expression))


def single_turn(**kwargs: Any) -> Any:
    parser = vf.XMLParser(["answer"], answer_field="answer")
    rubric = vf.Rubric(funcs=[exact_match, tagged], weights=[1.0, 0.2], parser=parser)
    return vf.SingleTurnEnv(dataset=dataset(), system_prompt="Answer in <answer> tags.",
                            parser=parser, rubric=rubric, **kwargs)  # fmt: skip


def calculator_env(**kwargs: Any) -> Any:
    rubric = vf.Rubric(funcs=[exact_match])
    return vf.ToolEnv(dataset=dataset(), tools=[calculator], rubric=rubric,
                      max_turns=kwargs.pop("max_turns", 4), **kwargs)  # fmt: skip


class GuessNumber(vf.MultiTurnEnv):
    """Guess the secret number (the answer); the env says higher or lower; a right guess
    ends the game with a final message."""

    cleaned: list[str]

    async def setup_state(self, state: Any) -> Any:
        state["guesses"] = 0
        return state

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
        guess = str(messages[-1].content or "").strip()
        state["guesses"] += 1
        if not guess.isdigit():
            return [vf.UserMessage(content="Say a number.")]
        target = int(state["answer"])
        if int(guess) == target:
            state["solved"] = True
            final = [vf.UserMessage(content=f"Correct, it was {target}!")]
            state["final_env_response"] = final
            return final
        return [vf.UserMessage(content="Higher." if int(guess) < target else "Lower.")]

    @vf.cleanup
    async def note_cleanup(self, state: Any) -> None:
        self.cleaned.append(str(state["answer"]))


def won(state: Any) -> float:
    return float(state.get("solved", False))


def few_guesses(state: Any) -> float:
    return 1.0 / max(int(state.get("guesses", 0)), 1)


def game(max_turns: int = 5) -> Any:
    rows = [{"question": "Guess my number from 1 to 9.", "answer": "5"}]
    rubric = vf.Rubric(funcs=[won, few_guesses], weights=[1.0, 0.5])
    env = GuessNumber(dataset=dataset(rows), rubric=rubric, max_turns=max_turns)
    env.cleaned = []
    return env


def call(name: str, **arguments: Any) -> str:
    return HERMES.render_call(ToolCall(name, arguments))


def run(tokenizer: Any, spec: VerifiersFamily, texts: list[str], index: int = 0) -> Trajectory:
    """One episode of task ``index`` through turnrl's rollout, the model scripted."""
    stops = stop_token_ids(tokenizer)
    backend = ScriptedBackend(tokenizer, texts, end_token_id=stops[0])

    async def generate(request: GenerationRequest) -> Completion:
        return (await backend.generate([request]))[0]

    return asyncio.run(
        run_episode(spec.make_env(), spec.task(index), generate, ChatRenderer(tokenizer),
                    limits=LIMITS, sampling=SamplingParams(stop_token_ids=stops), seed=0)
    )  # fmt: skip


def text_episode(spec: VerifiersFamily, texts: list[str], index: int = 0) -> Episode:
    return asyncio.run(play(spec.make_env(), spec.task(index), replay(texts), seed=0, max_steps=8))


def observations(traj: Trajectory, role: str) -> list[str]:
    return [str(m["content"]) for m in traj.messages if m["role"] == role]


# --- a single-turn task with an exact-match rubric ---------------------------------------


def test_single_turn_rewards_are_the_rubrics_weighted_sum(tokenizer: Any) -> None:
    spec = from_verifiers(single_turn())
    right = run(tokenizer, spec, ["<answer>\n5\n</answer>"])
    assert right.error is None
    assert right.messages[0] == {"role": "system", "content": "Answer in <answer> tags."}
    assert right.messages[1] == {"role": "user", "content": "What is 2 + 3?"}
    assert right.reward == pytest.approx(1.2)  # 1.0 * exact + 0.2 * tagged
    assert right.reward_components == {"exact_match": 1.0, "tagged": 1.0, "num_turns": 1.0}
    assert right.success
    assert right.terminated  # one turn is a single-turn env's end, not a truncation
    assert not right.truncated
    assert right.stop_reason == "answered"

    wrong = run(tokenizer, spec, ["<answer>\n6\n</answer>"])
    assert wrong.reward == pytest.approx(0.2)
    assert wrong.reward_components["exact_match"] == 0.0
    assert not wrong.success  # 0.2 < the env's pass_threshold (0.5)
    assert wrong.terminated

    untagged = run(tokenizer, spec, ["5"], index=0)
    assert untagged.reward == 0.0
    assert untagged.reward_components == {"exact_match": 0.0, "tagged": 0.0, "num_turns": 1.0}


def test_tasks_come_from_the_dataset_and_the_eval_split_from_the_eval_dataset() -> None:
    held_out = dataset([{"question": "What is 1 + 1?", "answer": "2"}])
    spec = from_verifiers(single_turn(eval_dataset=held_out))
    first = spec.task(0)
    assert first.prompt == (
        {"role": "system", "content": "Answer in <answer> tags."},
        {"role": "user", "content": "What is 2 + 3?"},
    )
    assert first.answer == "5"
    assert first.metadata == {"verifiers_row": {"question": "What is 2 + 3?", "example_id": 0}}
    assert spec.task(4).answer == "16"  # index modulo the dataset's length
    assert spec.task(4).id == "train-4"
    assert spec.task(0, "test").answer == "2"
    assert spec.task(3, "eval").prompt[-1]["content"] == "What is 1 + 1?"
    assert spec.task(1) == spec.task(1)
    json.dumps([first.prompt, first.answer, dict(first.metadata)])  # tasks are JSON data
    assert spec.name == "SingleTurnEnv"
    assert spec.reward_range == (0.0, 1.2)
    assert spec.make_env().format is None  # no tools: the text goes to verifiers as it is
    with_tools = from_verifiers(calculator_env())
    assert with_tools.make_env().format is with_tools.format


def test_the_demonstration_writes_the_parsers_format_and_the_corpus_holds_the_data(
    tokenizer: Any,
) -> None:
    spec = from_verifiers(single_turn())
    (turn,) = spec.demonstration(spec.task(0), random.Random(0))
    answer = spec.vf_env.parser.parse_answer([{"role": "assistant", "content": turn}])
    assert answer in {"5", "16", "2"}  # a random answer of the dataset, in <answer> tags
    assert run(tokenizer, spec, [turn]).reward_components["tagged"] == 1.0
    corpus = spec.corpus()
    assert {"What is 2 + 3?", "What is 4 * 4?", "16", "Answer in <answer> tags."} <= set(corpus)


# --- a ToolEnv with a Python calculator ---------------------------------------------------


def test_tool_env_calls_run_in_verifiers_and_come_back_as_tool_messages(tokenizer: Any) -> None:
    spec = from_verifiers(calculator_env())
    traj = run(tokenizer, spec, [call("calculator", expression="2 + 3"), "5"])
    assert traj.error is None
    assert observations(traj, "tool") == ["5"]
    assert [(r.name, dict(r.arguments), r.ok) for r in traj.tool_calls] == [
        ("calculator", {"expression": "2 + 3"}, True)
    ]
    assert traj.reward == 1.0
    assert traj.success
    assert traj.terminated  # verifiers' no_tools_called: the answer ends it
    assert traj.reward_components == {
        "exact_match": 1.0, "num_turns": 2.0, "total_tool_calls": 1.0, "calculator_calls": 1.0,
    }  # fmt: skip


def test_the_template_gets_the_tool_schema_verifiers_built() -> None:
    spec = from_verifiers(calculator_env())
    env = spec.make_env()

    async def opening() -> list[Any]:
        try:
            return await env.reset(spec.task(0), seed=0)
        finally:
            await env.close()

    assert asyncio.run(opening()) == [{"role": "user", "content": "What is 2 + 3?"}]
    (schema,) = env.tool_schemas()
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["description"] == "Evaluate an arithmetic expression."
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert spec.tool_schemas() == [schema]


def test_a_format_without_template_tools_lists_them_in_the_system_prompt() -> None:
    spec = from_verifiers(calculator_env(), format="react")
    episode = text_episode(spec, ["I give up."])
    system = episode.opening[0]
    assert system["role"] == "system"
    assert "calculator" in system["content"]
    assert episode.opening[1] == {"role": "user", "content": "What is 2 + 3?"}


def test_tool_failures_are_observations_and_records_say_so(tokenizer: Any) -> None:
    spec = from_verifiers(calculator_env(max_turns=6))
    texts = [
        call("calculator", expression="1 / 0"),
        call("calculator", expression="import os"),
        call("abacus", expression="1"),
        "<tool_call>{not json}</tool_call>",
        "5",
    ]
    traj = run(tokenizer, spec, texts)
    assert traj.error is None
    assert [(r.name, r.ok, r.error) for r in traj.tool_calls] == [
        ("calculator", False, "ZeroDivisionError: division by zero"),
        ("calculator", False, "ValueError: not arithmetic: 'import os'"),
        ("abacus", False, "KeyError: 'abacus'"),
    ]
    tool_messages = observations(traj, "tool")
    # verifiers' error_formatter writes the text the model reads
    assert tool_messages[:3] == ["division by zero", "not arithmetic: 'import os'", "'abacus'"]
    assert tool_messages[3].startswith("Error: your tool call could not be understood")
    assert traj.success  # the episode went on to the answer
    # the malformed turn never reached verifiers: it counts 4 turns, turnrl 5
    assert traj.reward_components["num_turns"] == 4.0
    assert len(traj.turns) == 5


def test_verifiers_max_turns_truncates(tokenizer: Any) -> None:
    spec = from_verifiers(calculator_env(max_turns=2))
    texts = [call("calculator", expression="1 + 1"), call("calculator", expression="2 + 2")]
    traj = run(tokenizer, spec, texts)
    assert traj.truncated
    assert not traj.terminated
    assert traj.stop_reason == "env_truncated"
    assert not traj.success
    assert traj.reward == 0.0  # still scored, as verifiers scores every rollout
    assert "exact_match" in traj.reward_components
    assert [(r.ok, r.error) for r in traj.tool_calls] == [
        (True, None), (False, "not run: the verifiers rollout ended first"),
    ]  # fmt: skip
    episode = text_episode(spec, texts)
    assert episode.results[-1].info["truncated_reason"] == "max_turns_reached"


def test_a_stop_error_fails_the_episode_as_an_infrastructure_error(tokenizer: Any) -> None:
    spec = from_verifiers(calculator_env(stop_errors=[ZeroDivisionError]))
    traj = run(tokenizer, spec, [call("calculator", expression="1 / 0"), "5"])
    assert traj.stop_reason == "error"
    assert traj.error is not None
    assert traj.error.startswith("RuntimeError: verifiers rollout failed: ToolCallError")


# --- a MultiTurnEnv game ----------------------------------------------------------------


def test_a_multi_turn_game_is_driven_by_its_env_response(tokenizer: Any) -> None:
    vf_env = game()
    spec = from_verifiers(vf_env, name="guess")
    traj = run(tokenizer, spec, ["3", "seven", "7", "5"])
    assert traj.error is None
    assert observations(traj, "user")[1:] == ["Higher.", "Say a number.", "Lower."]
    assert traj.terminated
    assert traj.stop_reason == "answered"
    assert traj.reward == pytest.approx(1.0 + 0.5 / 4)
    assert traj.reward_components == {"won": 1.0, "few_guesses": 0.25, "num_turns": 4.0}
    assert traj.success
    assert traj.tool_calls == []
    assert vf_env.cleaned == ["5"]  # verifiers' cleanup handlers ran
    assert spec.name == "guess"

    # the final env response comes back with the last step
    last = text_episode(spec, ["5"]).results[-1]
    assert last.terminated
    assert last.observation == ({"role": "user", "content": "Correct, it was 5!"},)
    assert last.info["stop_condition"] == "has_final_env_response"


def test_a_game_past_its_turn_limit_is_truncated(tokenizer: Any) -> None:
    traj = run(tokenizer, from_verifiers(game(max_turns=2)), ["1", "2"])
    assert traj.truncated
    # not won; verifiers stops at max_turns before answering the second guess: one guess
    # counted, few_guesses = 1 at weight 0.5
    assert traj.reward == pytest.approx(0.5)
    assert traj.reward_components == {"won": 0.0, "few_guesses": 1.0, "num_turns": 2.0}
    assert not traj.success


def test_an_episode_turnrl_ends_first_cancels_the_rollout_and_runs_cleanup(
    tokenizer: Any,
) -> None:
    vf_env = game(max_turns=10)
    spec = from_verifiers(vf_env)
    stops = stop_token_ids(tokenizer)
    backend = ScriptedBackend(tokenizer, ["1", "2"], end_token_id=stops[0])

    async def generate(request: GenerationRequest) -> Completion:
        return (await backend.generate([request]))[0]

    traj = asyncio.run(
        run_episode(spec.make_env(), spec.task(0), generate, ChatRenderer(tokenizer),
                    limits=EpisodeLimits(max_turns=2, max_tokens_per_turn=64),
                    sampling=SamplingParams(stop_token_ids=stops), seed=0)
    )  # fmt: skip
    assert traj.stop_reason == "max_turns"
    assert traj.error is None
    assert traj.info.get("close_error") is None
    assert vf_env.cleaned == ["5"]


def test_an_env_that_rewrites_history_fails_the_episode_loudly() -> None:
    class Forgetful(GuessNumber):
        async def get_prompt_messages(self, state: Any) -> Any:
            if not state["trajectory"]:
                return state["prompt"]
            return [vf.UserMessage(content="Start over: guess again.")]

    rubric = vf.Rubric(funcs=[won])
    rows = [{"question": "Guess my number.", "answer": "5"}]
    vf_env = Forgetful(dataset=dataset(rows), rubric=rubric, max_turns=4)
    vf_env.cleaned = []
    env = from_verifiers(vf_env).make_env()
    with pytest.raises(RuntimeError, match="rewrote the conversation"):
        asyncio.run(play(env, from_verifiers(vf_env).task(0), replay(["1"]), seed=0, max_steps=3))


# --- the family: the protocol, demonstrations, refusals, loading by id ----------------------


def test_the_demonstration_is_a_valid_call_then_an_answer(tokenizer: Any) -> None:
    spec = from_verifiers(calculator_env())
    task = spec.task(1)
    call_text, answer = spec.demonstration(task, random.Random(3))
    (parsed,) = HERMES.parse(call_text).tool_calls
    assert parsed.name == "calculator"
    assert set(parsed.arguments) == {"expression"}
    assert parsed.arguments["expression"] in {"What", "is", "4"}  # a word of the prompt
    assert answer in {"5", "16", "2"}
    traj = run(tokenizer, spec, [call_text, answer], index=1)
    assert traj.error is None
    assert [r.name for r in traj.tool_calls] == ["calculator"]
    assert traj.terminated
    assert spec.demonstration(task, random.Random(3)) == [call_text, answer]  # seeded


def test_the_corpus_has_prompts_answers_schemas_and_demonstrations() -> None:
    spec = from_verifiers(calculator_env())
    corpus = spec.corpus()
    assert "What is 9 - 7?" in corpus
    assert "16" in corpus
    assert any('"name": "calculator"' in line for line in corpus)
    assert any(line.startswith("<tool_call>") for line in corpus)


def test_group_reward_functions_and_other_objects_are_refused() -> None:
    def best_of_group(completions: list[Any]) -> list[float]:
        return [1.0] * len(completions)

    grouped = vf.SingleTurnEnv(dataset=dataset(), rubric=vf.Rubric(funcs=[best_of_group]))
    with pytest.raises(ConfigError, match="group reward functions"):
        from_verifiers(grouped)
    with pytest.raises(TypeError, match="takes a verifiers Environment or an env id"):
        from_verifiers(object())
    with pytest.raises(ConfigError, match="env_args are for an env id"):
        from_verifiers(single_turn(), env_args={"x": 1})


ENV_MODULE = """
import verifiers as vf
from datasets import Dataset

def exact(completion, answer, parser):
    return float((parser.parse_answer(completion) or "").strip() == answer)

def load_environment(answer: str = "5"):
    rows = [{"question": "What is 2 + 3?", "answer": answer}]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[exact]))
"""


def test_an_installed_env_loads_by_id_also_from_a_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: Any
) -> None:
    (tmp_path / "tiny_vf_env.py").write_text(textwrap.dedent(ENV_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = from_verifiers("tiny-vf-env", env_args={"answer": "6"})
    assert spec.name == "tiny-vf-env"
    assert run(tokenizer, spec, ["6"]).reward == 1.0
    configured: Any = make_env_family(
        "turnrl.envs.verifiers_env:from_verifiers", vf_env="tiny-vf-env", format="hermes"
    )
    assert isinstance(configured, VerifiersFamily)
    assert run(tokenizer, configured, ["5"]).success


def test_importing_turnrl_envs_imports_neither_verifiers_nor_numpy() -> None:
    code = (
        "import sys, turnrl.envs, turnrl.envs.verifiers_env\n"
        "print(sorted(m for m in ('verifiers', 'numpy', 'torch', 'datasets') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("make", [single_turn, calculator_env, game])
def test_every_adapted_env_replays_the_same_episode(make: Callable[[], Any]) -> None:
    """Same task, same turns: the same observations, rewards and end flags."""
    spec = from_verifiers(make())
    task = spec.task(0)
    turns = spec.demonstration(task, random.Random(0))

    def transcript() -> list[Any]:
        episode = text_episode(spec, turns)
        return [(r.observation, r.reward, r.terminated, r.truncated) for r in episode.results]

    assert transcript() == transcript()
