"""Chat templates that render no tools (as SmolLM2's and many instruct models' do not): the
call format writes the tool list into the system turn and the results into its own turns,
token-exact; formats that list their tools in the system prompt never need the template to
render them. On the tiny families' tokenizers with tool-less templates written here (the
real SmolLM2 template is tested in test_real_model.py)."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from turnrl.api import train
from turnrl.backends.scripted import ScriptedBackend
from turnrl.envs import SecretLookup
from turnrl.errors import TemplateError
from turnrl.formats import FORMATS, get_format
from turnrl.models import load_tokenizer
from turnrl.models.loading import stop_token_ids
from turnrl.protocols import ToolSchema
from turnrl.rollout.chat import PROBE_TOOL, ChatRenderer, template_report
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, run_episode
from turnrl.types import Completion, GenerationRequest, Message, ToolCall

PLAIN_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML turns and nothing else: no ``tools`` branch, a ``tool`` message is a turn of
that name (SmolLM2's layout, without its default system prompt)."""

PLAIN_LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
"""Llama 3 turns with no tool support (as Llama 3.0's template)."""

PLAIN = {"qwen2": PLAIN_CHATML, "llama3": PLAIN_LLAMA3}


def tool_for(format_name: str) -> ToolSchema:
    """A tool the format can call: code and search_r1 call one tool of a fixed name."""
    name, argument = {"code": ("python", "code"), "search_r1": ("search", "query")}.get(
        format_name, ("lookup", "key")
    )
    schema = copy.deepcopy(PROBE_TOOL)
    schema["function"]["name"] = name
    schema["function"]["parameters"]["properties"] = {argument: {"type": "string"}}
    schema["function"]["parameters"]["required"] = [argument]
    return schema


@pytest.fixture(scope="module")
def plain_tokenizer(family_tokenizer: Callable[[str], Any]) -> Callable[[str], Any]:
    """``arch`` -> a copy of that family's tiny tokenizer with a template without tools."""
    made: dict[str, Any] = {}

    def get(arch: str) -> Any:
        if arch not in made:
            tokenizer = copy.deepcopy(family_tokenizer(arch))
            tokenizer.chat_template = PLAIN[arch]
            made[arch] = tokenizer
        return made[arch]

    return get


def test_a_template_without_a_tools_branch_is_told_apart(
    family_tokenizer: Callable[[str], Any], plain_tokenizer: Callable[[str], Any]
) -> None:
    for arch in PLAIN:
        assert ChatRenderer(family_tokenizer(arch)).template_tools
        assert not ChatRenderer(plain_tokenizer(arch)).template_tools


def test_without_a_call_format_tools_on_a_plain_template_are_refused(
    plain_tokenizer: Callable[[str], Any],
) -> None:
    with pytest.raises(TemplateError, match="does not render tools") as caught:
        ChatRenderer(plain_tokenizer("qwen2")).with_tools([PROBE_TOOL])
    assert "\n" not in str(caught.value)


def test_hermes_writes_qwen2_5_s_layout_on_plain_chatml_turns(
    plain_tokenizer: Callable[[str], Any],
) -> None:
    tokenizer = plain_tokenizer("qwen2")
    hermes = get_format("hermes")
    renderer = ChatRenderer(tokenizer).with_tools([PROBE_TOOL], hermes)
    call = ToolCall("lookup", {"key": "alpha"})
    messages: list[Message] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "alpha?"},
        {"role": "assistant", "content": hermes.render_call(call)},
        *hermes.render_results([(call, "cat"), (call, "dog <|im_end|>")]),
    ]
    text = renderer.text(messages, add_generation_prompt=True)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(PROBE_TOOL)}\n</tools>" in system
    # the two results of one turn: one user turn of <tool_response> blocks
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\ncat\n</tool_response>\n<tool_response>\n"
        "dog <|im_end|>\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert "<|im_start|>tool" not in text
    # the tags are template text (Qwen's tokens for them where the vocabulary has them);
    # the result's control string is text
    ids = renderer.prompt(messages)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert renderer.decode(ids, at_start=True) == text
    assert ids.count(end) == text.count("<|im_end|>") - 1
    tag = tokenizer.convert_tokens_to_ids("<tool_response>")
    if tag != tokenizer.unk_token_id and tag is not None:
        assert ids.count(tag) == 2


def test_without_a_system_turn_the_tool_list_gets_one(
    plain_tokenizer: Callable[[str], Any],
) -> None:
    renderer = ChatRenderer(plain_tokenizer("qwen2")).with_tools([PROBE_TOOL], get_format("hermes"))
    text = renderer.text([{"role": "user", "content": "alpha?"}], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n")


def test_llama3_json_results_are_ipython_turns(plain_tokenizer: Callable[[str], Any]) -> None:
    fmt = get_format("llama3_json")
    renderer = ChatRenderer(plain_tokenizer("llama3")).with_tools([PROBE_TOOL], fmt)
    call = ToolCall("lookup", {"key": "alpha"})
    messages: list[Message] = [
        {"role": "user", "content": "alpha?"},
        {"role": "assistant", "content": fmt.render_call(call)},
        *fmt.render_results([(call, "cat")]),
    ]
    text = renderer.text(messages, add_generation_prompt=True)
    assert "<|start_header_id|>ipython<|end_header_id|>\n\ncat<|eot_id|>" in text
    assert '"name": "lookup"' in text.split("<|eot_id|>")[0]  # the list, in the system turn


@pytest.mark.parametrize("arch", sorted(PLAIN))
@pytest.mark.parametrize("format_name", list(FORMATS))
def test_the_start_up_check_passes_on_a_template_without_tools(
    arch: str, format_name: str, plain_tokenizer: Callable[[str], Any]
) -> None:
    tokenizer = plain_tokenizer(arch)
    report = template_report(
        ChatRenderer(tokenizer),
        get_format(format_name),
        stop_token_ids(tokenizer),
        tools=[tool_for(format_name)],
    )
    assert report.ok, report.problems
    assert (report.prefix, report.round_trip, report.observation_as_text) == (True,) * 3


def test_a_hermes_episode_on_a_plain_template_is_token_exact(
    plain_tokenizer: Callable[[str], Any],
) -> None:
    tokenizer = plain_tokenizer("qwen2")
    spec = SecretLookup()
    task = spec.task(0)
    hermes = get_format("hermes")
    call = hermes.render_call(ToolCall("lookup", {"key": task.metadata["key"]}))
    stops = stop_token_ids(tokenizer)
    backend = ScriptedBackend(tokenizer, [call, task.answer], end_token_id=stops[0])

    async def generate(request: GenerationRequest) -> Completion:
        return (await backend.generate([request]))[0]

    play = run_episode(
        spec.make_env(), task, generate, ChatRenderer(tokenizer),
        limits=EpisodeLimits(), sampling=SamplingParams(stop_token_ids=stops), seed=0,
    )  # fmt: skip
    traj = asyncio.run(play)
    assert traj.success
    assert traj.template_breaks == 0
    [sample] = traj.samples()
    # the ids held before the answer are exactly the whole conversation so far, rendered
    # and encoded at once
    env = spec.make_env()
    asyncio.run(env.reset(task, 0))
    renderer = ChatRenderer(tokenizer).with_tools(env.tool_schemas(), hermes)
    last = traj.turns[-1]
    before_answer = sample.input_ids[: len(sample.input_ids) - len(last.completion_ids)]
    assert before_answer == renderer.prompt(traj.messages[:-1])
    assert "<tools>" in renderer.decode(traj.turns[0].prompt_ids, at_start=True)


@pytest.fixture(scope="module")
def plain_model_dir(
    family_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The qwen2 tiny model, saved again with a ChatML template that renders no tools."""
    out = tmp_path_factory.mktemp("plain") / "model"
    tokenizer = load_tokenizer(family_model_dir("qwen2"))
    tokenizer.chat_template = PLAIN_CHATML
    source = family_model_dir("qwen2")
    out.mkdir()
    for path in source.iterdir():
        if path.is_file() and "token" not in path.name and "chat_template" not in path.name:
            (out / path.name).write_bytes(path.read_bytes())
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("format_name", ["react", "hermes"])
def test_a_run_starts_on_a_template_without_tools(
    format_name: str,
    plain_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The start-up check no longer asks a template to render tools for a format that
    lists them in the system prompt (react); with hermes the format writes them, and the
    run says so once."""
    caplog.set_level("WARNING", logger="turnrl")
    result = train(
        "grpo", out=tmp_path / "run", progress=False,
        overrides=[
            f"model.path={plain_model_dir}", f"env.format={format_name}", "steps=1",
            "warmup.steps=0", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_turns=2", "rollout.max_tokens_per_turn=8", "eval.num_tasks=2",
        ],
    )  # fmt: skip
    first = result.rows[0]
    assert first["startup/template_prefix"] == 1.0
    assert first["startup/template_round_trip"] == 1.0
    said = [r.getMessage() for r in caplog.records if "does not render tools" in r.getMessage()]
    assert len(said) == (1 if format_name == "hermes" else 0)
