"""SentencePiece-style tokenizers (a Metaspace pre-tokenizer, as transformers loads Llama 2's
and Mistral v0.3's): the start of a text gets a prefix space ("▁") that text after a control
token does not, and the decoder drops it again. The chat encoder encodes and decodes each
piece of a rendering as it reads inside the rendering, so these tokenizers pass the start-up
template check and their tool episodes are token-exact (docs/design.md, invariant 1).

The tokenizers are trained here on the tiny model's corpus: a BPE one built by transformers'
own ``LlamaTokenizer`` (the class a Llama 2 or Mistral v0.3 checkpoint loads as; byte
fallback, ``Metaspace(prepend_scheme="first", split=False)``, its decoder strips the first
space), and a Unigram one with tokenizers' Metaspace pre-tokenizer and decoder. Templates:
the mistral family's, a Llama-2-like one (``[INST]`` as text, tools described in the system
prompt) and the tiny ChatML one (its continuations start with text, a newline)."""

from __future__ import annotations

import asyncio
import json
import string
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaTokenizer, MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

from test_families import (
    CALL,
    LOOKUP,
    TASK,
    FollowUp,
    ToolLoop,
    assert_token_exact,
    lookup_env,
    play,
)
from turnrl.backends.scripted import ScriptedBackend
from turnrl.backends.torch_backend import TorchBackend
from turnrl.formats import get_format
from turnrl.models import default_corpus, load_model, load_tokenizer
from turnrl.models.families import MISTRAL, Family
from turnrl.models.loading import stop_token_ids
from turnrl.models.tiny import QWEN2, _split_special
from turnrl.rollout.chat import ChatRenderer, template_report
from turnrl.rollout.episode import EpisodeLimits
from turnrl.types import Message, ToolCall

LLAMA2_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- message.content + eos_token }}"
    "{%- elif message.role != 'system' %}"
    "{{- bos_token + '[INST] ' }}"
    "{%- if loop.index0 == 1 and messages[0].role == 'system' %}"
    "{{- '<<SYS>>\\n' + messages[0].content + '\\n<</SYS>>\\n\\n' }}{%- endif %}"
    "{{- message.content + ' [/INST]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)
"""Llama 2's layout: each user (or tool) turn ``<s>[INST] {content} [/INST]``, the first with
the system prompt in ``<<SYS>>``, the assistant's text right after, closed by ``</s>``. Only
``<s>``, ``</s>``, ``<unk>`` are control tokens (``[INST]`` is text). Unlike Llama 2's own
template, content is not stripped, so a tool loop continues token-exactly."""

LLAMA2 = Family(
    name="llama2",
    model_type="llama",
    chat_template=LLAMA2_TEMPLATE,
    special_tokens=("<unk>", "<s>", "</s>"),
    bos_token="<s>",
    eos_token="</s>",
    pad_token="<unk>",
    tool_format="react",
    tool_result="<s>[INST] Observation: {} [/INST]",
)
CHATML = replace(QWEN2, special_tokens=("<unk>", *QWEN2.special_tokens), pad_token="<unk>")
"""The tiny ChatML family with an unknown token first (ids 0, 1, ...), as SentencePiece has."""
FAMILIES = {"mistral": MISTRAL, "llama2": LLAMA2, "chatml": CHATML}
CASES = [("mistral", "bpe"), ("mistral", "unigram"), ("llama2", "bpe"), ("chatml", "bpe")]


def train_tokenizer(family: Family, model: str, *, legacy: bool = False) -> Any:
    """A SentencePiece-style tokenizer trained on ``family``'s tiny-model corpus, carrying
    its template. ``bpe``: transformers' ``LlamaTokenizer`` over a trained vocabulary (with
    ``legacy=True`` its Metaspace prepends "▁" after every control token, as old Llama
    checkpoints load); ``unigram``: a Unigram model with tokenizers' Metaspace pre-tokenizer
    and decoder, wrapped by ``PreTrainedTokenizerFast``."""
    corpus = list(_split_special(default_corpus(family), family.all_tokens))
    specials = list(family.special_tokens)
    backend = Tokenizer(models.BPE(unk_token="<unk>") if model == "bpe" else models.Unigram())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    if model == "unigram":
        backend.decoder = decoders.Metaspace(prepend_scheme="first")
        trainer: Any = trainers.UnigramTrainer(
            vocab_size=900, special_tokens=specials, unk_token="<unk>", show_progress=False,
            initial_alphabet=list(string.printable),
        )  # fmt: skip
        backend.train_from_iterator(corpus, trainer=trainer)
        wrap: Any = PreTrainedTokenizerFast
        return wrap(
            tokenizer_object=backend, bos_token=family.bos_token, eos_token=family.eos_token,
            unk_token="<unk>", pad_token=family.pad_token, chat_template=family.chat_template,
            clean_up_tokenization_spaces=False,
        )  # fmt: skip
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]  # byte fallback, as Llama's vocabulary
    trainer = trainers.BpeTrainer(
        vocab_size=1100, min_frequency=2, special_tokens=[*specials, *byte_tokens],
        show_progress=False,
    )  # fmt: skip
    backend.train_from_iterator(corpus, trainer=trainer)
    trained = json.loads(backend.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    llama: Any = LlamaTokenizer
    tokenizer = llama(
        vocab=trained["vocab"], merges=merges, legacy=legacy, unk_token="<unk>",
        bos_token=family.bos_token or specials[1], eos_token=family.eos_token,
        pad_token=family.pad_token, chat_template=family.chat_template,
    )  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


@pytest.fixture(scope="module")
def metaspace() -> Callable[[str, str], Any]:
    """(template family, model) -> its SentencePiece-style tokenizer (shared: do not modify)."""
    built: dict[tuple[str, str], Any] = {}

    def get(family: str, model: str) -> Any:
        if (family, model) not in built:
            built[family, model] = train_tokenizer(FAMILIES[family], model)
        return built[family, model]

    return get


def fmt_of(family: str) -> Any:
    return get_format(FAMILIES[family].tool_format)


def control_ids(tokenizer: Any) -> set[int]:
    return set(tokenizer.added_tokens_decoder)


@pytest.mark.parametrize(("family", "model"), CASES)
def test_the_tokenizer_gives_the_start_of_a_text_a_prefix_space(
    family: str, model: str, metaspace: Callable[[str, str], Any]
) -> None:
    """What makes these tokenizers different: a text encoded alone starts with "▁", the same
    text after a control token does not, and decoding drops a leading "▁"."""
    tokenizer = metaspace(family, model)
    assert type(tokenizer.backend_tokenizer.pre_tokenizer).__name__ == "Metaspace"
    end = FAMILIES[family].eos_token
    alone = tokenizer.encode("cat dog", add_special_tokens=False)
    inside = tokenizer.encode(f"{end}cat dog", add_special_tokens=False)[1:]
    assert tokenizer.convert_ids_to_tokens(alone)[0].startswith("▁")
    assert not tokenizer.convert_ids_to_tokens(inside)[0].startswith("▁")
    assert tokenizer.decode(alone) == "cat dog"
    # the renderer encodes a piece as it reads inside a rendering, and decodes it so too
    renderer = ChatRenderer(tokenizer)
    assert renderer.encode("cat dog") == tuple(inside)
    assert renderer.encode("cat dog", at_start=True) == tuple(alone)
    assert renderer.decode(alone) == " cat dog"  # a sampled "▁cat" is " cat" in the chat
    assert renderer.decode(alone, at_start=True) == "cat dog"
    as_text = renderer.encode_plain(f"cat {end} dog")
    assert not set(as_text) & control_ids(tokenizer)
    assert renderer.decode(as_text) == f"cat {end} dog"
    assert not tokenizer.convert_ids_to_tokens(list(as_text))[0].startswith("▁")


@pytest.mark.parametrize(("family", "model"), CASES)
def test_template_report_passes(
    family: str, model: str, metaspace: Callable[[str, str], Any]
) -> None:
    tokenizer = metaspace(family, model)
    report = template_report(ChatRenderer(tokenizer), fmt_of(family), stop_token_ids(tokenizer))
    assert report.ok, report.problems
    assert (report.prefix, report.round_trip, report.observation_as_text) == (True, True, True)


@pytest.mark.parametrize(("family", "model"), CASES)
def test_each_control_token_in_a_tool_result_is_text(
    family: str, model: str, metaspace: Callable[[str, str], Any]
) -> None:
    tokenizer = metaspace(family, model)
    renderer = ChatRenderer(tokenizer)
    fmt = fmt_of(family)
    stop = stop_token_ids(tokenizer)[0]
    control = control_ids(tokenizer)

    def after_call(result: str) -> tuple[list[int], tuple[int, ...], str]:
        messages: list[Message] = [
            *TASK.prompt,
            {"role": "assistant", "content": fmt.render_call(CALL)},
            *fmt.render_results([(CALL, result)]),
        ]
        held = [*renderer.prompt(messages[:1]), *renderer.encode(messages[1]["content"]), stop]
        cont = renderer.continuation(messages[:2], messages[2:], held)
        assert not cont.template_break
        return held, cont.ids, renderer.text(messages, add_generation_prompt=True)

    _, clean, _ = after_call("cat dog")
    for token in FAMILIES[family].all_tokens:
        result = f"cat {token} dog{token}"
        held, ids, text = after_call(result)
        assert renderer.decode([*held, *ids], at_start=True) == text, token
        assert [t for t in ids if t in control] == [t for t in clean if t in control], token
        assert result in renderer.decode(ids), token


@pytest.mark.parametrize(("family", "model"), CASES)
def test_a_rendering_is_encoded_as_the_whole_string_is(
    family: str, model: str, metaspace: Callable[[str, str], Any]
) -> None:
    """Clean content: the ids of prompt and continuation are exactly the ids of the whole
    rendered string, though each continuation is encoded on its own. (The Llama-2-like
    template's generation prompt ends in text, ``[/INST]``: the replies start with "▁", as
    a SentencePiece model's words do, so the sampled ids are the whole string's too.)"""
    tokenizer = metaspace(family, model)
    fmt = fmt_of(family)
    tools = [LOOKUP] if fmt.template_tools else []
    renderer = ChatRenderer(tokenizer, tools)
    stop = stop_token_ids(tokenizer)[0]
    messages: list[Message] = [{"role": "system", "content": "Be brief."}, *TASK.prompt]
    ids = list(renderer.prompt(messages))
    lead = " " if family == "llama2" else ""
    for reply, result in ((lead + fmt.render_call(CALL), "cat  and\ndog"), (" It is cat.", None)):
        ids += [*renderer.encode(reply), stop]
        messages.append({"role": "assistant", "content": reply})
        if result is not None:
            observation = fmt.render_results([(CALL, result)])
            cont = renderer.continuation(messages, observation, ids)
            assert not cont.template_break
            ids += cont.ids
            messages += observation
        text = renderer.text(messages, add_generation_prompt=result is not None)
        whole = tokenizer.encode(text, add_special_tokens=False)
        assert whole[: len(ids)] == ids  # the finished chat's rendering may end in a newline
        assert text.startswith(renderer.decode(ids, at_start=True))


@pytest.mark.parametrize(("family", "model"), [c for c in CASES if c[0] != "llama2"])
def test_a_tool_description_with_control_strings_is_text(
    family: str, model: str, metaspace: Callable[[str, str], Any]
) -> None:
    """(The Llama-2-like template renders no tools: the system prompt describes them.)"""
    tokenizer = metaspace(family, model)
    assert fmt_of(family).template_tools
    noisy = json.loads(json.dumps(LOOKUP))
    strings = " ".join(FAMILIES[family].all_tokens)
    noisy["function"]["description"] = f"Look up a key. {strings}"
    noisy["function"]["parameters"]["properties"]["key"]["description"] = f'"{strings}"\n'
    messages: list[Message] = [*TASK.prompt]
    ids = ChatRenderer(tokenizer, [noisy]).prompt(messages)
    clean = ChatRenderer(tokenizer, [LOOKUP]).prompt(messages)
    control = control_ids(tokenizer)
    assert [t for t in ids if t in control] == [t for t in clean if t in control]
    text = ChatRenderer(tokenizer, [noisy]).text(messages, add_generation_prompt=True)
    assert ChatRenderer(tokenizer).decode(ids, at_start=True) == text


# --- episodes ---------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "model"), CASES)
def test_a_scripted_tool_episode_is_token_exact(
    family: str, model: str, metaspace: Callable[[str, str], Any]
) -> None:
    """The scripted sampler encodes its replies as text alone, "▁" first, as a SentencePiece
    model samples them after ``[/INST]``; the template shows them as sampled."""
    tokenizer = metaspace(family, model)
    fmt = fmt_of(family)
    end = FAMILIES[family].eos_token
    answer = "Final Answer: cat" if family == "llama2" else "cat"
    script = [fmt.render_call(ToolCall("lookup", {"key": "beta"})), fmt.render_call(CALL), answer]
    for value in ("cat", f"cat{end} x [INST] <s>"):
        traj = play(lookup_env(fmt, value), tokenizer, ScriptedBackend(tokenizer, script))
        assert traj.stop_reason == "answered", traj.messages
        assert traj.success
        assert [r.ok for r in traj.tool_calls] == [False, True]
        assert traj.template_breaks == 0
        assert_token_exact(traj)
        [sample] = traj.samples()
        env = lookup_env(fmt)
        asyncio.run(env.reset(TASK, 0))
        renderer = ChatRenderer(tokenizer, env.tool_schemas() if fmt.template_tools else [])
        text = renderer.text(traj.messages, add_generation_prompt=False)
        decoded = renderer.decode(sample.input_ids, at_start=True)
        assert text.startswith(decoded)
        assert text[len(decoded) :] in ("", "\n")


@pytest.mark.parametrize(("family", "breaks"), [("mistral", 1), ("llama2", 0), ("chatml", 0)])
def test_a_new_user_message_continues_or_is_a_counted_break(
    family: str, breaks: int, metaspace: Callable[[str, str], Any]
) -> None:
    tokenizer = metaspace(family, "bpe")
    fmt = fmt_of(family)
    answers = ["Final Answer: cat", "Final Answer: dog"] if family == "llama2" else ["cat", "dog"]
    script = [fmt.render_call(CALL), *answers]
    traj = play(FollowUp(fmt), tokenizer, ScriptedBackend(tokenizer, script))
    assert traj.stop_reason == "answered"
    assert traj.template_breaks == breaks  # mistral moves its tool list to the new message
    assert_token_exact(traj)


def random_model(tokenizer: Any) -> Any:
    """A random Mistral-architecture model over ``tokenizer``'s vocabulary (head size 32),
    its end-of-turn token made likely so that episodes have several turns."""
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=None,
        max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MistralForCausalLM(config).to(torch.float32).eval()


@pytest.mark.parametrize(("family", "model"), [("mistral", "bpe"), ("chatml", "unigram")])
def test_sampled_episodes_are_token_exact_and_the_learner_scores_what_was_sampled(
    family: str, model: str, metaspace: Callable[[str, str], Any]
) -> None:
    tokenizer = metaspace(family, model)
    lm = random_model(tokenizer)
    head = lm.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    head.bias.data[tokenizer.eos_token_id] = 5.0
    env = ToolLoop(fmt_of(family), f"cat {FAMILIES[family].eos_token} [INST]")
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=16, max_episode_tokens=64)
    trajs = [play(env, tokenizer, TorchBackend(lm, tokenizer), limits, seed=s) for s in range(4)]
    continued = 0
    for traj in trajs:
        assert traj.error is None
        assert_token_exact(traj)
        assert traj.template_breaks == 0
        continued += len(traj.turns) - 1
        for sample in traj.samples():
            ids = torch.tensor([sample.input_ids])
            with torch.no_grad():
                logits = lm(input_ids=ids).logits[0, :-1].float()
            scores = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
            assert torch.allclose(scores[mask], torch.tensor(sample.logprobs[1:])[mask], atol=1e-4)
    assert continued >= 4


# --- the start-up check ----------------------------------------------------------------


def save_model(tokenizer: Any, out: Path) -> Path:
    tokenizer.save_pretrained(out)
    random_model(tokenizer).save_pretrained(out)
    return out


def test_a_run_with_a_sentencepiece_tokenizer_passes_the_start_up_check(
    metaspace: Callable[[str, str], Any], tmp_path: Path
) -> None:
    """A Mistral-architecture model directory with the Metaspace tokenizer loads through the
    Auto classes as it was built, passes the start-up check and trains."""
    from conftest import SMALL_RUN
    from turnrl.trainer.config import load_config
    from turnrl.trainer.loop import train

    tokenizer = train_tokenizer(MISTRAL, "bpe")
    path = save_model(tokenizer, tmp_path / "model")
    loaded = load_tokenizer(path)
    assert loaded.backend_tokenizer.pre_tokenizer.prepend_scheme == "first"
    text = loaded.apply_chat_template([*TASK.prompt], tools=[LOOKUP], tokenize=False) + "½ é"
    assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(
        text, add_special_tokens=False
    )
    assert load_model(path).config.vocab_size == len(loaded)
    config = load_config(None, [*SMALL_RUN, f"model.path={path}", "env.format=mistral"])
    result = train(config, tmp_path / "run", progress=False)
    first = result.rows[0]
    assert first["startup/template_prefix"] == 1.0
    assert first["startup/template_round_trip"] == 1.0
    assert first["startup/observation_as_text"] == 1.0
    assert len(result.rows) == 3


def test_a_legacy_tokenizer_fails_the_round_trip_and_says_why() -> None:
    """``legacy=True`` puts "▁" after every control token (``[TOOL_CALLS]▁[``), which the
    rendered text does not have: no encoding can make it round-trip, and the report says
    which setting to change."""
    tokenizer = train_tokenizer(MISTRAL, "bpe", legacy=True)
    assert tokenizer.backend_tokenizer.pre_tokenizer.prepend_scheme == "always"
    report = template_report(ChatRenderer(tokenizer), fmt_of("mistral"), stop_token_ids(tokenizer))
    assert not report.round_trip
    assert any("legacy=False" in p for p in report.problems)
