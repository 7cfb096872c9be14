"""The embedded tiny model: build, save, load back through the Auto classes, chat template."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from turnrl.errors import ConfigError, TemplateError
from turnrl.models import (
    SPECIAL_TOKENS,
    TinyModelConfig,
    build_tiny_model,
    build_tokenizer,
    default_corpus,
    load_model,
    load_tokenizer,
    loading,
    stop_token_ids,
)

SMALL = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Return the value stored under a key.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string"}},
            "required": ["key"],
        },
    },
}
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
CONVERSATION = [
    {"role": "system", "content": "Answer with one word."},
    {"role": "user", "content": "What is the value of alpha?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "lookup", "arguments": {"key": "alpha"}}\n</tool_call>',
    },
    {"role": "tool", "content": "cat"},
    {"role": "assistant", "content": "The value is cat."},
    {"role": "tool", "content": "error: no tool call found"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return load_tokenizer(model_dir)


def render_ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_build_writes_a_loadable_model(model_dir: Path) -> None:
    info = json.loads((model_dir / "turnrl_model.json").read_text())
    assert info["config"] == json.loads(json.dumps(TinyModelConfig().__dict__))
    model = load_model(model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    assert not model.training
    num_parameters = sum(p.numel() for p in model.parameters())
    assert num_parameters == info["num_parameters"]
    assert 1_000_000 < num_parameters < 2_000_000
    # tied: the output head is the input embedding, not a copy
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not list(model_dir.parent.glob(".model.tmp-*"))


def test_forward_and_generate(model_dir: Path, tokenizer: Any) -> None:
    model = load_model(model_dir)
    ids = torch.tensor([render_ids(tokenizer, CONVERSATION[:2], add_generation_prompt=True)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))  # B T V
    assert torch.isfinite(logits).all()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
    )
    assert out.shape == (1, ids.shape[1] + 4)
    assert torch.equal(out[:, : ids.shape[1]], ids)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_loaded_tokenizer_encodes_like_the_trained_one(tmp_path: Path, arch: str) -> None:
    # transformers 5 rebuilds a qwen2 model's tokenizer pipeline as Qwen2Tokenizer; the
    # trained pipeline must be the same, or loaded models would see different tokens.
    config = TinyModelConfig(arch=arch, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    path = build_tiny_model(tmp_path / arch, config)
    built = build_tokenizer(default_corpus(), config.vocab_size)
    loaded = load_tokenizer(path)
    text = loaded.apply_chat_template(CONVERSATION, tools=[LOOKUP], tokenize=False)
    text += " Ünïcode 😀 ½ 12345.678\t\r\n  don't  THE'LL x\n\n\n"
    assert loaded.encode(text, add_special_tokens=False) == built.encode(
        text, add_special_tokens=False
    )
    model = load_model(path)
    assert type(model).__name__ == ("Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM")
    assert model.config.vocab_size == len(loaded)


def test_special_tokens_are_single_tokens(tokenizer: Any) -> None:
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == len(SPECIAL_TOKENS)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert stop_token_ids(tokenizer) == (im_end, endoftext)


def test_plain_text_round_trips(tokenizer: Any) -> None:
    for text in ["", "hello world", "  two  spaces\n\ttab", "Ünïcode 😀 ½ → 12345", "{}[]\"'\\"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids


def test_common_pieces_are_single_tokens(tokenizer: Any) -> None:
    for piece in ["lookup", "arguments", "name", " the", " value"]:
        assert len(tokenizer.encode(piece, add_special_tokens=False)) == 1, piece


def test_tokenizer_is_deterministic() -> None:
    corpus = default_corpus()
    assert corpus == default_corpus()
    first = build_tokenizer(corpus, 512)
    second = build_tokenizer(corpus, 512)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()


def test_default_corpus_is_quick_and_covers_tool_calls() -> None:
    start = time.perf_counter()
    corpus = default_corpus()
    assert time.perf_counter() - start < 1.0
    assert len(corpus) > 2000
    joined = "\n".join(corpus)
    for needle in ['{"name": "lookup", "arguments": {"key": ', "<tool_call>", "<|im_start|>"]:
        assert needle in joined


def test_chat_template_renders_tools(tokenizer: Any) -> None:
    text = tokenizer.apply_chat_template(
        CONVERSATION[:2], tools=[LOOKUP, CALCULATOR], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nAnswer with one word.\n\n# Tools\n<tools>")
    assert "\n" + json.dumps(LOOKUP) + "\n" in text
    assert "\n" + json.dumps(CALCULATOR) + "\n</tools>" in text
    assert text.count("<|im_start|>system") == 1
    assert text.endswith(
        "<|im_start|>user\nWhat is the value of alpha?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert len(tokenizer.encode(text, add_special_tokens=False)) < 200


def test_chat_template_defaults_the_system_prompt_with_tools(tokenizer: Any) -> None:
    text = tokenizer.apply_chat_template(CONVERSATION[1:2], tools=[LOOKUP], tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>")
    plain = tokenizer.apply_chat_template(CONVERSATION[1:2], tokenize=False)
    assert plain == "<|im_start|>user\nWhat is the value of alpha?<|im_end|>\n"


def test_chat_template_groups_consecutive_tool_messages(tokenizer: Any) -> None:
    messages = [
        *CONVERSATION[:3],
        {"role": "tool", "content": "cat"},
        {"role": "tool", "content": "dog"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\ncat\n</tool_response>\n"
        "<tool_response>\ndog\n</tool_response><|im_end|>\n"
    )


def test_chat_template_renders_structured_tool_calls(tokenizer: Any) -> None:
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "lookup", "arguments": {"key": "beta"}}}
        ],
    }
    text = tokenizer.apply_chat_template([message], tokenize=False)
    assert text == (
        '<|im_start|>assistant\n<tool_call>\n{"name": "lookup", "arguments": {"key": "beta"}}'
        "\n</tool_call><|im_end|>\n"
    )


@pytest.mark.parametrize("tools", [None, [LOOKUP, CALCULATOR]])
def test_rendering_is_a_token_prefix_of_the_grown_conversation(
    tokenizer: Any, tools: list[dict[str, Any]] | None
) -> None:
    # The rollout engine appends only the new suffix after each turn: rendering the first
    # k messages must be a token prefix of rendering the first k + 1.
    for k in range(1, len(CONVERSATION)):
        shorter = render_ids(tokenizer, CONVERSATION[:k], tools=tools)
        longer = render_ids(tokenizer, CONVERSATION[: k + 1], tools=tools)
        assert longer[: len(shorter)] == shorter, k
        assert len(longer) > len(shorter)
        prompt = render_ids(tokenizer, CONVERSATION[:k], tools=tools, add_generation_prompt=True)
        if CONVERSATION[k]["role"] == "assistant":
            assert longer[: len(prompt)] == prompt, k


def test_build_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "model"
    build_tiny_model(out, SMALL)
    first = (out / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="overwrite=True"):
        build_tiny_model(out, SMALL)
    build_tiny_model(out, TinyModelConfig(**{**SMALL.__dict__, "seed": 1}), overwrite=True)
    assert (out / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        build_tiny_model(foreign, SMALL)
    assert [p.name for p in foreign.iterdir()] == ["keep.txt"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert build_tiny_model(empty, SMALL) == empty.resolve()


def test_build_is_seeded(tmp_path: Path) -> None:
    rng_state = torch.get_rng_state()
    a = build_tiny_model(tmp_path / "a", SMALL)
    assert torch.equal(torch.get_rng_state(), rng_state)  # the caller's RNG is untouched
    b = build_tiny_model(tmp_path / "b", SMALL)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_extra_corpus_adds_domain_tokens(tmp_path: Path) -> None:
    word = "zorblatt"
    path = build_tiny_model(tmp_path / "m", SMALL, extra_corpus=[f"the {word}"] * 50)
    assert len(load_tokenizer(path).encode(" " + word, add_special_tokens=False)) == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"arch": "gpt2"}, "arch"),
        ({"hidden_size": 130, "num_heads": 4}, "divisible by num_heads"),
        ({"num_heads": 4, "num_kv_heads": 3}, "divisible by num_kv_heads"),
        ({"num_layers": 0}, "num_layers must be positive"),
        ({"hidden_size": -8}, "hidden_size must be positive"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"hidden_size": 12, "num_heads": 4}, "even"),
    ],
)
def test_bad_config_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TinyModelConfig(**fields)


def test_missing_directory_says_how_to_build_one(tmp_path: Path) -> None:
    missing = tmp_path / "no-model-here"
    for load in (load_model, load_tokenizer):
        with pytest.raises(ConfigError, match="does not exist") as info:
            load(missing)
        assert str(missing) in str(info.value)
        assert "turnrl init-model" in str(info.value)
        assert "no network to a model hub" in str(info.value)


def test_uncached_hub_id_fails_without_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "_hub_offline", lambda: True)
    with pytest.raises(ConfigError, match="hub cache") as info:
        load_tokenizer("turnrl-test/not-a-cached-model")
    assert "turnrl init-model" in str(info.value)


def test_a_directory_without_a_model_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_model(tmp_path)


def test_tokenizer_without_chat_template_is_refused(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m", SMALL)
    (path / "chat_template.jinja").unlink()
    with pytest.raises(TemplateError, match="chat template"):
        load_tokenizer(path)


def test_missing_pad_token_becomes_eos(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m", TinyModelConfig(**{**SMALL.__dict__, "arch": "llama"}))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["pad_token"]
    config_file.write_text(json.dumps(config))
    tokenizer = load_tokenizer(path)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"


def test_echo_tuning_teaches_generic_copying(tmp_path: Path) -> None:
    from turnrl.models.pretrain import echo_chats

    chats = echo_chats(["tulip", "river"], 20, seed=0)
    assert all(c[1]["content"] in c[0]["content"] for c in chats)  # the reply is in the prompt
    assert not any("tool" in m["content"] for c in chats for m in c)  # no tool use in it
    out = build_tiny_model(
        tmp_path / "m", TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, echo_steps=30)
    )
    info = json.loads((out / "turnrl_model.json").read_text())
    assert info["echo_loss_last"] < info["echo_loss_first"]


def test_echo_on_made_up_words_leaves_the_default_chats_alone() -> None:
    from turnrl.models.pretrain import echo_chats, made_up_word

    words = ["tulip", "river", "stone"]
    assert echo_chats(words, 50, seed=3) == echo_chats(words, 50, seed=3, novel_fraction=0.0)
    novel = echo_chats(words, 200, seed=3, novel_fraction=0.5)
    replies = [c[1]["content"] for c in novel]
    assert all(c[1]["content"] in c[0]["content"] for c in novel)  # still a copy of the prompt
    made_up = [r for r in replies if not set(r.split()) <= set(words)]
    assert 60 <= len(made_up) <= 140  # about half, drawn afresh: almost no repeats
    assert len(set(made_up)) > 0.9 * len(made_up)
    rng = random.Random(0)
    samples = [made_up_word(rng) for _ in range(200)]
    assert all(w.isalpha() and 2 <= len(w) <= 16 for w in samples)
    assert any(w[0].isupper() for w in samples)
    assert any(w[0].islower() for w in samples)


def test_echo_novel_is_validated() -> None:
    with pytest.raises(ConfigError, match="echo_novel"):
        TinyModelConfig(echo_novel=1.5)
