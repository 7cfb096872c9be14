"""Tiny models of the Qwen3, Llama-3 and Mistral families (beside the ChatML qwen2 one):
built locally, loaded through the Auto classes, templates that lay conversations out as
each family does, and token-exact multi-turn tool episodes in each family's call format
(docs/design.md, invariant 1), with history rewrites split and counted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import pytest
import torch

from conftest import swe_tests_can_run
from turnrl.backends.scripted import ScriptedBackend
from turnrl.backends.torch_backend import TorchBackend
from turnrl.envs import SecretLookup
from turnrl.envs.tool_env import ToolEnv
from turnrl.errors import ConfigError
from turnrl.formats import get_format
from turnrl.models import TinyModelConfig, build_tokenizer, default_corpus, load_model
from turnrl.models.families import LLAMA3, MISTRAL, QWEN3
from turnrl.models.loading import stop_token_ids
from turnrl.models.tiny import FAMILIES, Arch
from turnrl.protocols import Backend, Format, ToolSchema
from turnrl.rewards import exact_match
from turnrl.rollout.chat import ChatRenderer
from turnrl.rollout.episode import EpisodeLimits, SamplingParams, run_episode
from turnrl.tools import Tool, ToolSet
from turnrl.types import Message, StepResult, Task, ToolCall, Trajectory

ARCHS = ("qwen2", "qwen3", "llama3", "mistral")
MODEL_CLASS = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama3": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
}
TASK = Task(
    id="t",
    prompt=({"role": "user", "content": "What is the value of alpha?"},),
    answer="cat",
)
LOOKUP: ToolSchema = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a key.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "The key."}},
            "required": ["key"],
        },
    },
}
CALL = ToolCall("lookup", {"key": "alpha"})


def family_format(arch: str) -> Format:
    return get_format(FAMILIES[arch].tool_format)


def lookup_env(fmt: Format, value: str = "cat") -> ToolEnv:
    """A ToolEnv with one tool, ``lookup``, that returns ``value`` for the key ``alpha``."""

    def lookup(key: str) -> str:
        """Look up a key.

        Args:
            key: The key.
        """
        if key != "alpha":
            raise LookupError(f"no key {key!r}")
        return value

    return ToolEnv(
        ToolSet([Tool.from_function(lookup)]), lambda t, a: exact_match(a, "cat"), format=fmt
    )


class FollowUp:
    """A lookup ToolEnv whose first answer is met by a second user question (a new query,
    as in a chat); the second answer ends the episode."""

    def __init__(self, fmt: Format) -> None:
        self.inner = lookup_env(fmt)
        self.answers = 0

    async def reset(self, task: Task, seed: int) -> list[Message]:
        return await self.inner.reset(task, seed)

    async def step(self, action: str) -> StepResult:
        result = await self.inner.step(action)
        if result.terminated and not self.answers:
            self.answers += 1
            return StepResult(observation=({"role": "user", "content": "And beta?"},))
        return result

    def tool_schemas(self) -> list[ToolSchema]:
        return self.inner.tool_schemas()

    def stop_strings(self) -> tuple[str, ...]:
        return self.inner.stop_strings()


def play(
    env: Any, tokenizer: Any, backend: Backend, limits: EpisodeLimits | None = None, seed: int = 0
) -> Trajectory:
    """One episode of ``TASK`` in ``env``, sampled by ``backend``, stopped by the family's
    stop tokens, with every request kept on ``requests``."""
    requests: list[Any] = []

    async def generate(request: Any) -> Any:
        requests.append(request)
        return (await backend.generate([request]))[0]

    traj = asyncio.run(
        run_episode(
            env, TASK, generate, ChatRenderer(tokenizer),
            limits=limits or EpisodeLimits(max_turns=4, max_tokens_per_turn=48),
            sampling=SamplingParams(stop_token_ids=stop_token_ids(tokenizer)), seed=seed,
        )
    )  # fmt: skip
    traj.info["requests"] = requests
    return traj


def assert_token_exact(traj: Trajectory) -> None:
    """Invariant 1 and the loss mask, checked against what the sampler was given.

    Each request's prompt is the previous request's prompt, its completion and the turn's
    new template ids (unless the turn starts a new sample after a template break); each
    sample the learner gets is exactly its last request's prompt plus that completion;
    the loss mask is 1 exactly on the sampled ids."""
    requests = traj.info["requests"]
    assert len(requests) == len(traj.turns)
    samples = traj.samples()
    assert len(samples) == 1 + traj.template_breaks
    assert sum(t.new_sample for t in traj.turns) == traj.template_breaks
    ends: list[int] = []  # the index of each sample's last turn
    for k, turn in enumerate(traj.turns):
        prompt = list(requests[k].prompt_ids)
        if k and not turn.new_sample:
            before = [*requests[k - 1].prompt_ids, *traj.turns[k - 1].completion_ids]
            assert prompt == [*before, *turn.prompt_ids]
        else:
            assert prompt == list(turn.prompt_ids)
            if k:
                ends.append(k - 1)
    ends.append(len(traj.turns) - 1)
    for sample, last in zip(samples, ends, strict=True):
        turn = traj.turns[last]
        assert list(sample.input_ids) == [*requests[last].prompt_ids, *turn.completion_ids]
        sampled = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
        start = next(k for k in range(last, -1, -1) if k == 0 or traj.turns[k].new_sample)
        expected = [t for turn in traj.turns[start : last + 1] for t in turn.completion_ids]
        assert sampled == expected
        assert not sample.loss_mask[0]


# --- building and loading ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_each_family_loads_through_the_auto_classes(
    arch: str, family_model_dir: Callable[[str], Path], family_tokenizer: Callable[[str], Any]
) -> None:
    family = FAMILIES[arch]
    path = family_model_dir(arch)
    tokenizer = family_tokenizer(arch)
    model = load_model(path)
    assert type(model).__name__ == MODEL_CLASS[arch]
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.hidden_size // model.config.num_attention_heads == 32
    assert tokenizer.chat_template == family.chat_template
    assert tokenizer.eos_token == family.eos_token
    assert tokenizer.pad_token == family.pad_token
    assert stop_token_ids(tokenizer)[0] == tokenizer.eos_token_id
    # every control token is one id, special ones special, the rest (Qwen's tags) not
    specials = {t.content: t.special for t in tokenizer.added_tokens_decoder.values()}
    assert specials == {
        **dict.fromkeys(family.special_tokens, True),
        **dict.fromkeys(family.added_tokens, False),
    }
    for token in family.all_tokens:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    # the loaded tokenizer encodes as the trained one
    built = build_tokenizer([*default_corpus(family), *SecretLookup().corpus()], 800, family=family)
    text = tokenizer.apply_chat_template(
        [*TASK.prompt, {"role": "assistant", "content": family_format(arch).render_call(CALL)}],
        tools=[LOOKUP], tokenize=False,
    )  # fmt: skip
    text += " Ünïcode 😀 ½ 12345.678\t\r\n  don't  THE'LL x\n\n\n"
    assert tokenizer.encode(text, add_special_tokens=False) == built.encode(
        text, add_special_tokens=False
    )
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_a_family_needs_room_for_its_special_tokens() -> None:
    least = 256 + len(MISTRAL.special_tokens)
    with pytest.raises(ConfigError, match=f"at least {least}"):
        TinyModelConfig(arch="mistral", vocab_size=least - 1)
    with pytest.raises(ConfigError, match="arch must be one of"):
        TinyModelConfig(arch="gemma")  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ARCHS)
def test_structured_tool_calls_render_as_the_family_format_writes_them(
    arch: str, family_tokenizer: Callable[[str], Any]
) -> None:
    tokenizer = family_tokenizer(arch)
    structured = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": dict(CALL.__dict__)}],
    }
    written = {"role": "assistant", "content": family_format(arch).render_call(CALL)}
    render = tokenizer.apply_chat_template
    assert render([*TASK.prompt, structured], tokenize=False) == render(
        [*TASK.prompt, written], tokenize=False
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_rendering_is_a_token_prefix_of_the_grown_tool_conversation(
    arch: str, family_tokenizer: Callable[[str], Any]
) -> None:
    tokenizer = family_tokenizer(arch)
    fmt = family_format(arch)
    conversation: list[Message] = [
        {"role": "system", "content": "Answer with one word."},
        *TASK.prompt,
        {"role": "assistant", "content": fmt.render_call(CALL)},
        *fmt.render_results([(CALL, "cat")]),
        {"role": "assistant", "content": "The value is cat."},
    ]

    def ids(n: int, tools: list[ToolSchema] | None, prompt: bool = False) -> list[int]:
        text = tokenizer.apply_chat_template(
            conversation[:n], tools=tools, tokenize=False, add_generation_prompt=prompt
        )
        return list(tokenizer.encode(text, add_special_tokens=False))

    for tools in (None, [LOOKUP]):
        for k in range(2, len(conversation)):
            shorter, longer = ids(k, tools), ids(k + 1, tools)
            assert longer[: len(shorter)] == shorter, (k, tools)
            if conversation[k]["role"] == "assistant":
                prompt = ids(k, tools, prompt=True)
                assert longer[: len(prompt)] == prompt, (k, tools)


# --- the families' layouts --------------------------------------------------------------


def test_qwen3_drops_reasoning_before_the_last_user_message(
    family_tokenizer: Callable[[str], Any],
) -> None:
    tokenizer = family_tokenizer("qwen3")
    thought = "<think>\nLook it up.\n</think>\n\nIt is cat."
    chat: list[Message] = [
        {"role": "user", "content": "alpha?"},
        {"role": "assistant", "content": thought},
        {"role": "user", "content": "beta?"},
        {"role": "assistant", "content": thought},
    ]
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    assert text == (
        "<|im_start|>user\nalpha?<|im_end|>\n<|im_start|>assistant\nIt is cat.<|im_end|>\n"
        f"<|im_start|>user\nbeta?<|im_end|>\n<|im_start|>assistant\n{thought}<|im_end|>\n"
    )
    # a tool result is not a user query: reasoning in a tool loop stays
    loop = [chat[0], chat[1], {"role": "tool", "content": "cat"}]
    assert thought in tokenizer.apply_chat_template(loop, tokenize=False)
    structured = {"role": "assistant", "content": "cat", "reasoning_content": "\nhm\n"}
    assert tokenizer.apply_chat_template([chat[0], structured], tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\nhm\n</think>\n\ncat<|im_end|>\n"
    )
    no_thinking = tokenizer.apply_chat_template(
        chat[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_llama3_layout(family_tokenizer: Callable[[str], Any]) -> None:
    tokenizer = family_tokenizer("llama3")
    chat: list[Message] = [
        {"role": "system", "content": "Be brief."},
        *TASK.prompt,
        {"role": "assistant", "content": family_format("llama3").render_call(CALL)},
        {"role": "tool", "name": "lookup", "content": "cat"},
    ]
    text = tokenizer.apply_chat_template(
        chat, tools=[LOOKUP], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.\n\n"
        'To call a function, reply with only a JSON object {"name": function name, '
        '"parameters": {argument name: value}}. Functions:\n'
        + json.dumps(LOOKUP)
        + "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is the value of alpha?"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "lookup", "parameters": {"key": "alpha"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\ncat<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    plain = tokenizer.apply_chat_template(TASK.prompt, tokenize=False)
    assert plain == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
        "What is the value of alpha?<|eot_id|>"
    )


def test_mistral_layout_puts_tools_and_system_with_the_last_user_message(
    family_tokenizer: Callable[[str], Any],
) -> None:
    tokenizer = family_tokenizer("mistral")
    tools = "[AVAILABLE_TOOLS]" + json.dumps([LOOKUP]) + "[/AVAILABLE_TOOLS]"
    chat: list[Message] = [
        {"role": "system", "content": "Be brief."},
        *TASK.prompt,
        {"role": "assistant", "content": family_format("mistral").render_call(CALL)},
        {"role": "tool", "name": "lookup", "content": 'a "quoted"\nvalue'},
        {"role": "assistant", "content": "cat"},
    ]
    text = tokenizer.apply_chat_template(chat, tools=[LOOKUP], tokenize=False)
    assert text == (
        f"<s>{tools}[INST] Be brief.\n\nWhat is the value of alpha?[/INST]"
        '[TOOL_CALLS][{"name": "lookup", "arguments": {"key": "alpha"}}]</s>'
        '[TOOL_RESULTS]{"name": "lookup", "content": "a \\"quoted\\"\\nvalue"}[/TOOL_RESULTS]'
        "cat</s>"
    )
    again = tokenizer.apply_chat_template(
        [*chat, {"role": "user", "content": "And beta?"}], tools=[LOOKUP], tokenize=False
    )
    assert again.startswith("<s>[INST] What is the value of alpha?[/INST][TOOL_CALLS]")
    assert again.endswith(f"cat</s>{tools}[INST] Be brief.\n\nAnd beta?[/INST]")
    # no generation prompt: the assistant writes right after [/INST]
    assert tokenizer.apply_chat_template(
        TASK.prompt, tokenize=False, add_generation_prompt=True
    ) == tokenizer.apply_chat_template(TASK.prompt, tokenize=False)


# --- token-exact episodes ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tool_episode_in_the_family_format_is_token_exact(
    arch: str, family_tokenizer: Callable[[str], Any]
) -> None:
    tokenizer = family_tokenizer(arch)
    fmt = family_format(arch)
    end = FAMILIES[arch].eos_token
    bad = fmt.render_call(ToolCall("lookup", {"key": "beta"}))  # an error result, then a retry
    script = [bad, fmt.render_call(CALL), "cat"]
    clean = play(lookup_env(fmt), tokenizer, ScriptedBackend(tokenizer, script))
    # the same episode where the tool's output contains the family's end-of-turn token
    dirty = play(lookup_env(fmt, f"cat{end} x"), tokenizer, ScriptedBackend(tokenizer, script))
    for traj in (clean, dirty):
        assert traj.stop_reason == "answered"
        assert traj.success
        assert [r.ok for r in traj.tool_calls] == [False, True]
        assert traj.template_breaks == 0
        assert_token_exact(traj)
        [sample] = traj.samples()
        # the ids are the template's rendering of the conversation, nothing else
        env = lookup_env(fmt)
        asyncio.run(env.reset(TASK, 0))
        text = ChatRenderer(tokenizer, env.tool_schemas()).text(
            traj.messages, add_generation_prompt=False
        )
        decoded = ChatRenderer(tokenizer).decode(sample.input_ids)
        assert text.startswith(decoded)
        assert text[len(decoded) :] in ("", "\n")  # what the template writes after the end
    # the tool output's end-of-turn text is text: control ids only where the template puts them
    clean_ids, dirty_ids = (t.samples()[0].input_ids for t in (clean, dirty))
    control = set(tokenizer.added_tokens_decoder)
    assert [t for t in dirty_ids if t in control] == [t for t in clean_ids if t in control]
    assert f"cat{end} x" in ChatRenderer(tokenizer).decode(dirty.turns[2].prompt_ids)


@pytest.mark.parametrize(("arch", "breaks"), [("qwen2", 0), ("qwen3", 1), ("llama3", 0)])
def test_a_new_user_message_after_reasoning_breaks_only_qwen3(
    arch: str, breaks: int, family_tokenizer: Callable[[str], Any]
) -> None:
    tokenizer = family_tokenizer(arch)
    fmt = family_format(arch)
    # reasoning before each reply (Llama-3 has none: its calls are bare JSON)
    think = "" if arch == "llama3" else "<think>\nThe tool knows.\n</think>\n\n"
    script = [think + fmt.render_call(CALL), think + "cat", think + "dog"]
    traj = play(FollowUp(fmt), tokenizer, ScriptedBackend(tokenizer, script))
    assert traj.stop_reason == "answered"
    assert traj.template_breaks == breaks
    assert [t.new_sample for t in traj.turns] == [False, False, bool(breaks)]
    assert_token_exact(traj)
    if breaks:  # the new sample starts from the rewritten history: no reasoning in it
        first_prompt = ChatRenderer(tokenizer).decode(traj.turns[2].prompt_ids)
        assert first_prompt.count("<think>") == 0
        assert "<|im_start|>assistant\ncat<|im_end|>" in first_prompt
    # the learner gets every sampled token exactly once
    assert sum(sum(s.loss_mask) for s in traj.samples()) == traj.num_completion_tokens


def test_mistral_moves_its_tool_list_to_a_new_user_message_a_counted_break(
    family_tokenizer: Callable[[str], Any],
) -> None:
    tokenizer = family_tokenizer("mistral")
    fmt = family_format("mistral")
    script = [fmt.render_call(CALL), "cat", "dog"]
    traj = play(FollowUp(fmt), tokenizer, ScriptedBackend(tokenizer, script))
    assert traj.stop_reason == "answered"
    assert traj.template_breaks == 1
    assert traj.turns[2].new_sample
    assert_token_exact(traj)


class ToolLoop:
    """Env double for a random model: whatever it writes, a tool result comes back (in the
    family format's rendering, holding the family's end-of-turn text), so every episode
    runs to ``max_turns`` through real sampled ids."""

    def __init__(self, fmt: Format, result: str) -> None:
        self.fmt = fmt
        self.result = result

    async def reset(self, task: Task, seed: int) -> list[Message]:
        return [{"role": "system", "content": "Use the tool."}, *task.prompt]

    async def step(self, action: str) -> StepResult:
        return StepResult(observation=tuple(self.fmt.render_results([(CALL, self.result)])))

    def tool_schemas(self) -> list[ToolSchema]:
        return [LOOKUP]

    def stop_strings(self) -> tuple[str, ...]:
        return ()


@pytest.mark.parametrize("arch", ARCHS)
def test_torch_backend_episodes_are_token_exact_and_the_learner_scores_what_was_sampled(
    arch: str, family_model_dir: Callable[[str], Path], family_tokenizer: Callable[[str], Any]
) -> None:
    tokenizer = family_tokenizer(arch)
    model = load_model(family_model_dir(arch))
    # A random model ends a turn about once in 800 tokens; an output bias on its
    # end-of-turn token makes that about one in seven, so episodes have several turns.
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    head.bias.data[tokenizer.eos_token_id] = 5.0
    backend = TorchBackend(model, tokenizer)
    env = ToolLoop(family_format(arch), f"cat {FAMILIES[arch].eos_token}")
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=16, max_episode_tokens=64)
    trajs = [play(env, tokenizer, backend, limits, seed=s) for s in range(4)]
    continued = 0
    for traj in trajs:
        assert traj.error is None
        assert traj.stop_reason in ("max_turns", "max_tokens_per_turn")
        assert_token_exact(traj)
        continued += sum(1 for t in traj.turns[1:] if not t.new_sample)
        for sample in traj.samples():
            ids = torch.tensor([sample.input_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, :-1].float()
            scores = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
            sampled = torch.tensor(sample.logprobs[1:])[mask]
            assert torch.allclose(scores[mask], sampled, atol=1e-4)
    assert continued >= 4  # turns really continued a held context (not only fresh samples)


def test_families_are_distinct_records() -> None:
    assert set(FAMILIES) == set(get_args(Arch)) == {"qwen2", "llama", "qwen3", "llama3", "mistral"}
    assert all(name == f.name for name, f in FAMILIES.items())
    assert FAMILIES["qwen3"] is QWEN3
    assert FAMILIES["llama3"] is LLAMA3
    assert FAMILIES["llama"].chat_template == FAMILIES["qwen2"].chat_template
    for family in FAMILIES.values():
        assert family.eos_token in family.special_tokens
        assert family.pad_token in family.special_tokens
        get_format(family.tool_format)  # a registered format


@pytest.mark.parametrize(
    ("arch", "call_format"),
    [("qwen3", "hermes"), ("llama3", "llama3_json"), ("mistral", "mistral")],
)
def test_a_run_trains_each_family_in_its_own_format(
    arch: str, call_format: str, tmp_path: Path
) -> None:
    """The start-up check passes each family's template with its own call format (prefix,
    round trip, observations as text) and the run trains."""
    from conftest import SMALL_RUN
    from turnrl.trainer.config import load_config
    from turnrl.trainer.loop import train

    config = load_config(None, [*SMALL_RUN, f"model.tiny.arch={arch}", f"env.format={call_format}"])
    result = train(config, tmp_path / "run", progress=False)
    first = result.rows[0]
    assert first["startup/template_prefix"] == 1.0
    assert first["startup/template_round_trip"] == 1.0
    assert first["startup/observation_as_text"] == 1.0
    assert first["startup/logprob_gap_max"] < 1e-4
    assert len(result.rows) == 3


def test_a_template_that_fails_the_start_up_check_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import SMALL_RUN
    from turnrl.errors import TemplateError
    from turnrl.rollout.chat import TemplateReport
    from turnrl.trainer import loop, startup
    from turnrl.trainer.config import load_config

    failing = TemplateReport(
        True, True, False, ("a tool result containing '<|im_end|>' was not encoded as plain text",)
    )
    monkeypatch.setattr(startup, "template_report", lambda *a, **k: failing)
    with pytest.raises(TemplateError, match=r"start-up check.*not encoded as plain text"):
        loop.train(load_config(None, SMALL_RUN), tmp_path / "run", progress=False)
    prefix_only = TemplateReport(False, True, True, ("the template rewrites history",))
    monkeypatch.setattr(startup, "template_report", lambda *a, **k: prefix_only)
    result = loop.train(load_config(None, SMALL_RUN), tmp_path / "run2", progress=False)
    assert result.rows[0]["startup/template_prefix"] == 0.0  # warned, logged, not refused


def test_every_registered_environment_passes_the_template_check(tokenizer: Any) -> None:
    """The start-up probe calls each environment's own first tool in its own format (a
    single-tool format such as search_r1 or code can call nothing else)."""
    from types import SimpleNamespace

    from turnrl.envs import make_env_family, registry
    from turnrl.models.loading import stop_token_ids
    from turnrl.rollout.chat import ChatRenderer
    from turnrl.trainer.config import load_config
    from turnrl.trainer.startup import check_template

    config = load_config(None, [])
    names = [n for n in registry.ENVIRONMENTS if n != "swe" or swe_tests_can_run()]
    for name in names:  # search_qa's default format is search_r1
        parts: Any = SimpleNamespace(
            family=make_env_family(name), renderer=ChatRenderer(tokenizer),
            sampling=SimpleNamespace(stop_token_ids=stop_token_ids(tokenizer)), config=config,
        )  # fmt: skip
        row = check_template(parts)
        assert row["startup/template_round_trip"] == 1.0, name
        assert row["startup/observation_as_text"] == 1.0, name
