"""The embedded tiny model: a locally trained tokenizer, a chat template, a small causal LM.

Model hubs are unreachable here and many users start on a laptop, so turnrl can build a
model from nothing: a byte-level BPE tokenizer trained on a generated corpus, a ChatML chat
template with tool calls in the Qwen2.5 style, and a Qwen2 or Llama causal LM of about a
million parameters with random (seeded) weights. Everything is saved with
``save_pretrained`` and loaded back through the ordinary ``AutoTokenizer`` /
``AutoModelForCausalLM`` path (``turnrl.models.loading``), exactly as a real hub model is.

The same builder makes tiny models of other families (``TinyModelConfig.arch``): Qwen3,
Llama-3 and Mistral, each with its own control tokens, chat template and tool-call format
(``families.py``), so every family's token accounting can be tested without a hub.

What does not live here: loading (``loading.py``), the other families' templates
(``families.py``) and anything that trains the model.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import jinja2
import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils import logging as hf_logging

from turnrl.errors import ConfigError
from turnrl.formats import get_format
from turnrl.models.families import LLAMA3, MISTRAL, QWEN3, Family
from turnrl.models.pretrain import pretrain_echo
from turnrl.protocols import Format
from turnrl.types import ToolCall

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (tools and loop.first and message.role == 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML with tools, in the Qwen2.5 layout but with a short tool preamble.

With ``tools``, a system turn (the first message's content if it is a system message, else
a one-line default) lists each schema as one JSON line inside ``<tools>``. Messages render
as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; consecutive ``tool`` messages share one
user turn of ``<tool_response>`` blocks, as in Qwen2.5; an assistant message's structured
``tool_calls`` (if any) render as ``<tool_call>`` blocks. Earlier messages are never
rewritten, so rendering a conversation's first k messages gives a prefix of rendering its
first k + 1 (for non-consecutive tool messages), which the rollout engine relies on. Without
tools no default system turn is added: the tiny model's context is small."""

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
"""Tokens that are always a single id; the first is also the padding token."""

QWEN2 = Family(
    name="qwen2",
    model_type="qwen2",
    chat_template=CHAT_TEMPLATE,
    special_tokens=SPECIAL_TOKENS,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    tool_format="hermes",
    tool_result="<tool_response>\n{}\n</tool_response>",
)
"""The original tiny model: ChatML (``CHAT_TEMPLATE``), hermes calls, Qwen2 weights."""

LLAMA = replace(QWEN2, name="llama", model_type="llama")
"""The ChatML tiny model on the Llama architecture (tokens and template as ``QWEN2``)."""

FAMILIES: dict[str, Family] = {f.name: f for f in (QWEN2, LLAMA, QWEN3, LLAMA3, MISTRAL)}
"""Every family a tiny model can be built in, by ``TinyModelConfig.arch``."""

Arch = Literal["qwen2", "llama", "qwen3", "llama3", "mistral"]
_ARCHS = tuple(FAMILIES)


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the tiny model. The defaults give about 1.2M parameters (a few seconds to
    build, fast enough to train on a laptop CPU)."""

    arch: Arch = "qwen2"
    """Family: ``"qwen2"`` (Qwen2ForCausalLM, biased q/k/v) or ``"llama"``, both with the
    ChatML template and hermes calls; or ``"qwen3"``, ``"llama3"``, ``"mistral"``, each with
    its family's tokens, template and call format (``families.py``)."""
    vocab_size: int = 2048
    """Target BPE vocabulary size, the 256 byte tokens and the special tokens included (an
    upper bound: training stops early when the corpus has no more repeated pairs; the model
    is sized to the tokenizer actually trained)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Decoder layers."""
    num_heads: int = 4
    """Attention (query) heads; must divide ``hidden_size``."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``num_heads``."""
    intermediate_size: int = 512
    """Width of each MLP's hidden layer."""
    max_position_embeddings: int = 1024
    """Longest context in tokens (also the tokenizer's ``model_max_length``)."""
    tie_word_embeddings: bool = True
    """Share input embedding and output head: copying tokens from the context (keys and
    values out of a tool response) is then easy to learn, and parameters are saved."""
    seed: int = 0
    """Seed of the weight initialisation (the tokenizer is a pure function of its corpus)."""
    echo_steps: int = 0
    """Steps of generic "repeat what was said" instruction tuning after initialisation
    (``turnrl.models.pretrain``): gives the model the in-context copying that real base
    models have. 0 leaves the model random (fast, for tests)."""
    echo_novel: float = 0.0
    """Share of the echo chats that repeat made-up words instead of known ones, so copying
    works on names the tokenizer splits into pieces (``pretrain.made_up_word``)."""

    def __post_init__(self) -> None:
        if self.arch not in _ARCHS:
            raise ConfigError(f"TinyModelConfig.arch must be one of {_ARCHS}, got {self.arch!r}")
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"TinyModelConfig.{name} must be positive, got {getattr(self, name)}"
                )
        if self.echo_steps < 0:
            raise ConfigError(f"TinyModelConfig.echo_steps must be >= 0, got {self.echo_steps}")
        if not 0.0 <= self.echo_novel <= 1.0:
            raise ConfigError(
                f"TinyModelConfig.echo_novel must be in [0, 1], got {self.echo_novel}"
            )
        least = 256 + len(FAMILIES[self.arch].special_tokens)
        if self.vocab_size < least:
            raise ConfigError(
                f"TinyModelConfig.vocab_size must be at least {least} "
                f"(256 byte tokens plus the special tokens), got {self.vocab_size}"
            )
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"TinyModelConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"TinyModelConfig.num_heads ({self.num_heads}) must be divisible by "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(
                "TinyModelConfig.hidden_size / num_heads (the head size) must be even "
                f"for rotary embeddings, got {self.hidden_size // self.num_heads}"
            )


_WORDS_TEXT = (
    "the a an and or but not no yes is are was were be been has have had do does did "
    "i you he she it we they me him her us them my your his its our their this that these "
    "those what which who whom whose when where why how all any each every some many much "
    "more most few less one two three four five six seven eight nine ten hundred thousand "
    "first last next new old good bad big small long short high low right wrong true false "
    "value key name number word answer question result tool call lookup search find get set "
    "read write file table list item data text code user assistant system function arguments "
    "return response error ok done please thank thanks sorry hello hi help can could will "
    "would should may might must shall to of in on at by for with from about into over under "
    "after before between through up down out off again then once here there now today time "
    "day year way thing man woman child people world life hand part place case point fact "
    "make know think take see come want look use give tell work ask try need feel become "
    "leave put mean keep let begin seem show hear play run move live believe bring happen "
    "provide sit stand lose pay meet include continue learn change lead understand watch "
    "follow stop create speak allow add spend grow open walk win offer remember consider "
    "appear buy wait serve die send expect build stay fall cut reach kill remain suggest "
    "raise pass sell require report decide pull red green blue black white cat dog fox owl "
    "bee cow pig hen ant elk yak bat eel emu ram rat alpha beta gamma delta epsilon zeta eta "
    "theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon phi chi psi omega "
    "city country weather temperature price date month week hour minute second final "
    "correct secret hidden unknown found missing calculate compute add subtract multiply "
    "divide sum total equal equals plus minus times store stored reply replying called "
    "calling returns returned string object integer boolean array type description "
    "parameters properties required example step steps check checked result results "
    "problem solution solve reason reasoning because since while until although if else "
    "only also just very still even never always often sometimes usually maybe perhaps "
    "other another same different such own both either neither several enough most least "
    "house home room door window car road street school book paper letter page story "
    "water food fire earth air light sound music color shape size weight height length "
    "money cost market company business job office team group member family friend "
    "morning evening night north south east west left top bottom front back side middle "
    "start end begin finish early late fast slow hot cold warm cool hard soft easy simple "
    "clear full empty free busy happy sad sure ready able certain possible important "
    "question questions answers values keys names numbers words tools calls files items "
    "message messages content role query queries input output format json test tests"
)
_WORDS = tuple(_WORDS_TEXT.split())
"""Common English words plus the vocabulary of tool use and of turnrl's probe tasks."""

_TOOLS = (
    ("lookup", "key", "Return the value stored under a key."),
    ("search", "query", "Search the documents for a query."),
    ("calculator", "expression", "Evaluate an arithmetic expression."),
    ("get_weather", "city", "Return the weather in a city."),
    ("read_file", "path", "Return the content of a file."),
    ("python", "code", "Run Python code and return its output."),
)


def default_corpus(family: Family = QWEN2) -> list[str]:
    """A generated corpus for training the tiny tokenizer (deterministic, ~5k lines).

    It covers English words and sentences, numbers and arithmetic, tool calls in the
    family's format, tool schemas and whole conversations rendered by the family's chat
    template, so that the pieces a tool-using conversation is made of become single tokens.
    Domain text (an environment's keys and values) is added by callers.
    """
    rng = random.Random(0)
    lines: list[str] = [*_WORDS, *(w.capitalize() for w in _WORDS)]
    for _ in range(1500):
        lines.append(_sentence(rng))
    for _ in range(300):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        result = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"{a} {op} {b} = {result}")
        lines.append(f"{rng.uniform(-100, 100):.2f}")
    call_format = get_format(family.tool_format)
    for _ in range(800):
        lines.append(_tool_call(rng, call_format))
        lines.append(family.tool_result.format(rng.choice(_WORDS)))
    template = _corpus_template(family.chat_template)
    tokens = {"bos_token": family.bos_token or "", "eos_token": family.eos_token}
    for _ in range(400):
        tools = rng.sample([_tool_schema(*t) for t in _TOOLS], rng.randint(0, 2))
        messages: list[dict[str, str]] = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": _sentence(rng)})
        messages.append({"role": "user", "content": _sentence(rng)})
        for _ in range(rng.randint(0, 2)):
            messages.append({"role": "assistant", "content": _tool_call(rng, call_format)})
            messages.append({"role": "tool", "content": rng.choice(_WORDS)})
        messages.append({"role": "assistant", "content": _sentence(rng)})
        lines.append(template.render(messages=messages, tools=tools or None, **tokens))
    if "<think>" in family.all_tokens:  # reasoning blocks, for families that have them
        lines += [f"<think>\n{_sentence(rng)}\n</think>\n\n" for _ in range(200)]
    return lines


def _sentence(rng: random.Random) -> str:
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
    return words.capitalize() + rng.choice((".", ".", ".", "?", "!"))


def _tool_call(rng: random.Random, call_format: Format) -> str:
    name, arg, _ = rng.choice(_TOOLS)
    value = rng.choice(_WORDS) if rng.random() < 0.7 else str(rng.randint(0, 999))
    return str(call_format.render_call(ToolCall(name, {arg: value})))


def _tool_schema(name: str, arg: str, description: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string"}},
                "required": [arg],
            },
        },
    }


def _corpus_template(chat_template: str) -> jinja2.Template:
    """``chat_template`` compiled as transformers compiles it (``tojson`` without HTML
    escaping or key sorting), for rendering corpus conversations before a tokenizer exists."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = json.dumps
    return env.from_string(chat_template)


def build_tokenizer(
    corpus: Iterable[str],
    vocab_size: int = 2048,
    *,
    model_max_length: int = 1024,
    family: Family = QWEN2,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``corpus`` and wrap it for transformers.

    Every byte is in the alphabet, so any text encodes (there is no unknown token) and
    ``encode(decode(ids))`` round-trips (NFC-normalised) text. The family's special tokens
    are single special tokens (ids 0, 1, ...; by default ``SPECIAL_TOKENS``, with
    ``<|im_end|>`` the end-of-sequence token and ``<|endoftext|>`` the pad) and its added
    tokens single non-special ones (after the trained vocabulary); the tokenizer carries the
    family's chat template. The result is a pure function of the corpus, the sizes and the
    family.

    The pipeline (NFC, Qwen2's split regex, then ``ByteLevel(add_prefix_space=False)``) is
    exactly the one transformers' ``Qwen2Tokenizer`` rebuilds when it loads a tokenizer
    saved next to a ``qwen2`` model (transformers 5 ignores the saved pipeline for that model
    type), so the tokenizer loaded by ``AutoTokenizer`` encodes as the trained one does.
    """
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(family.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_split_special(corpus, family.all_tokens), trainer=trainer)
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in family.added_tokens]
    )
    wrap: Any = PreTrainedTokenizerFast  # untyped constructor (kwargs only)
    bos = {"bos_token": family.bos_token} if family.bos_token else {}
    tokenizer: PreTrainedTokenizerFast = wrap(
        tokenizer_object=backend,
        eos_token=family.eos_token,
        pad_token=family.pad_token,
        chat_template=family.chat_template,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        **bos,
    )
    return tokenizer


_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2's pre-tokenizer regex: words with their leading space, single digits, punctuation
runs, newlines (copied from transformers' ``tokenization_qwen2.PRETOKENIZE_REGEX``)."""


def _split_special(corpus: Iterable[str], tokens: Sequence[str]) -> Iterator[str]:
    """The corpus cut at the strings of ``tokens``, as encoding cuts it. The trainer does not
    cut there itself; merges across their pieces (``<|``, ``im``) would only waste vocabulary."""
    split = re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))
    for text in corpus:
        yield from (piece for piece in split.split(text) if piece)


def build_tiny_model(
    out_dir: str | Path,
    config: TinyModelConfig = TinyModelConfig(),
    extra_corpus: Iterable[str] = (),
    *,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Build the tokenizer and a randomly initialised model, save both to ``out_dir``.

    The tokenizer is trained on ``default_corpus()`` plus ``extra_corpus``; the model's
    weights are seeded by ``config.seed``. The directory is written atomically (a temporary
    sibling renamed into place) and also holds ``turnrl_model.json`` (the config and the
    parameter count). An existing non-empty ``out_dir`` is refused unless ``overwrite``.
    """
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(
            f"{out} already exists and is not empty; pass overwrite=True to replace it, "
            "or choose another directory"
        )
    family = FAMILIES[config.arch]
    tokenizer = build_tokenizer(
        [*default_corpus(family), *extra_corpus],
        config.vocab_size,
        model_max_length=config.max_position_embeddings,
        family=family,
    )
    model = _init_model(config, family, tokenizer)
    num_parameters = sum(p.numel() for p in model.parameters())
    echo_losses = (
        pretrain_echo(
            model,
            tokenizer,
            _WORDS,
            steps=config.echo_steps,
            seed=config.seed,
            novel_fraction=config.echo_novel,
            progress=progress,
        )
        if config.echo_steps
        else []
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the model directory should not be
        tokenizer.save_pretrained(tmp)
        with _no_progress_bars():
            model.save_pretrained(tmp)
        info = {
            "config": asdict(config),
            "num_parameters": num_parameters,
            "echo_loss_first": echo_losses[0] if echo_losses else None,
            "echo_loss_last": echo_losses[-1] if echo_losses else None,
        }
        (tmp / "turnrl_model.json").write_text(json.dumps(info, indent=2) + "\n")
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _init_model(config: TinyModelConfig, family: Family, tokenizer: PreTrainedTokenizerFast) -> Any:
    """A float32 causal LM of ``config``'s shape, in ``family``'s architecture, over
    ``tokenizer``'s vocabulary."""
    special: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.convert_tokens_to_ids(family.bos_token or family.pad_token),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    shape: dict[str, Any] = {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
    # Every head is hidden_size / num_heads wide (Qwen3's config would default to 128).
    head_dim: dict[str, Any] = {"head_dim": config.hidden_size // config.num_heads}
    model: Any
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(config.seed)
        if family.model_type == "qwen2":
            model = Qwen2ForCausalLM(Qwen2Config(**shape, **special))
        elif family.model_type == "qwen3":
            model = Qwen3ForCausalLM(Qwen3Config(**shape, **special, **head_dim))
        elif family.model_type == "mistral":  # full attention: the context is short anyway
            model = MistralForCausalLM(
                MistralConfig(**shape, **special, **head_dim, sliding_window=None)
            )
        else:
            model = LlamaForCausalLM(LlamaConfig(**shape, **special))
    return model.to(torch.float32)


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Silence transformers' progress bars (a one-shard save needs none), then restore."""
    progress: Any = hf_logging  # untyped module functions
    was_enabled = progress.is_progress_bar_enabled()
    progress.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            progress.enable_progress_bar()


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``; an existing ``dst`` is moved aside first, removed after."""
    if not dst.exists():
        os.replace(src, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.replace(dst, old / dst.name)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)
