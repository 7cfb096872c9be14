"""Chat-template token accounting: the conversation as the exact tokens the model saw.

The first prompt is rendered by the tokenizer's chat template. After each model turn the
conversation grows by the assistant message and the observation; instead of re-tokenizing
everything (which could change the sampled tokens), the grown conversation is rendered,
the text after what we already hold is taken, and only that suffix is tokenized. A check
confirms that the rendering starts with the history we hold (decoded exactly); a template
that rewrites history (e.g. strips earlier reasoning) is a *template break*: the caller then
starts a fresh sample from a full re-rendering, and counts it.

Message content and tool schemas are text, never control tokens: a tool result (or a user
or system message, or a tool's description) that contains ``<|im_end|>``, ``<|eot_id|>`` or
``[INST]`` is encoded as the characters it is, and only the template's own markup becomes
control ids. A rendering with no control string outside the template's markup is encoded
as a plain ``encode`` of it would be; where content holds one, the content is located in
the rendering (with placeholders) and encoded with special tokens split (for
SentencePiece-style tokenizers, the whole run of text between the template's control tokens
around it, since they merge across spaces). Assistant content is the model's own language
(its calls use control tokens) and its sampled ids are held, never re-encoded.

Pieces of a rendering are encoded as they tokenize *inside* it. SentencePiece-style
tokenizers (a Metaspace pre-tokenizer, as Llama 2's and Mistral's) mark the start of a text
with a prefix space ("▁") that text after a control token does not get, and their decoder
drops it again; for those, a piece that does not start the rendering is encoded after an
anchor whose ids are then dropped, and a completion is decoded after one. Tokenizers without
that start-of-text rule (byte-level BPE: Qwen, Llama 3) encode and decode pieces directly.
``template_report`` checks a template's prefix property at start-up.
"""

from __future__ import annotations

import copy
import re
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.errors import TemplateError
from turnrl.formats.plain_template import for_plain_template
from turnrl.protocols import Format, ToolSchema
from turnrl.types import Message, ToolCall

Span = tuple[int, int]
"""A ``[start, end)`` range of characters in a rendering."""

Location = tuple[str | int, ...]
"""Where a string sits among the messages and tools a template renders: keys, indices."""


@dataclass(frozen=True)
class Continuation:
    """The tokens to append after a completion, or a full re-rendering after a break."""

    ids: tuple[int, ...]
    template_break: bool


class ChatRenderer:
    """Renders conversations to token ids with one tokenizer's chat template.

    Tools offered to the conversation (``with_tools``) are rendered by the template where
    it renders tools (``template_tools``). Where it does not, the renderer writes them in
    the conversation's call format instead (``call_format``, see
    ``turnrl.formats.plain_template``): the tool list at the end of the system turn and
    the tool results in the turns the format documents, rewritten just before the template
    is applied, so the messages held and the ids sampled are never changed.
    """

    def __init__(
        self, tokenizer: Any, tools: Sequence[ToolSchema] = (), call_format: Format | None = None
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                "the tokenizer has no chat template; turnrl needs one to render conversations"
            )
        self.tokenizer = tokenizer
        self._control = _ControlTokens(tokenizer)
        self._start = _TextStart(tokenizer, self._control.anchor)
        self.template_tools = _renders_tools(tokenizer)
        """The chat template renders a ``tools=`` list (else the call format writes it)."""
        self.call_format = call_format
        self.tools: list[ToolSchema] | None = None
        self._dirty_tools: dict[Location, str] = {}
        self._set_tools(tools)

    def _set_tools(self, tools: Sequence[ToolSchema]) -> None:
        if tools and not self.template_tools and self.call_format is None:
            raise TemplateError(
                "the tokenizer's chat template does not render tools, and no tool-call "
                "format was given to write the tool list into the system turn; use a "
                "format that puts it in the system prompt (template_tools=False)"
            )
        self.tools = list(tools) or None
        self._dirty_tools = {
            path: leaf
            for path, leaf in _string_leaves(self.tools or [], ("tools",))
            if self._control.found_in(leaf)
        }

    def with_tools(
        self, tools: Sequence[ToolSchema], call_format: Format | None = None
    ) -> ChatRenderer:
        """The same renderer for a conversation that offers ``tools``, its calls written in
        ``call_format`` (kept from this renderer where None): the format writes the tool
        list and the results where the template renders no tools."""
        other = copy.copy(self)  # shares the tokenizer and what was read from its vocabulary
        if call_format is not None:
            other.call_format = call_format
        other._set_tools(tools)
        return other

    @property
    def format_writes_tools(self) -> bool:
        """The conversation offers tools that the template cannot render: the call format
        writes them into the system turn, and writes the results."""
        return bool(self.tools) and not self.template_tools

    def text(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        return self._render(messages, self.tools, add_generation_prompt)

    def _render(
        self, messages: Sequence[Any], tools: Sequence[Any] | None, add_generation_prompt: bool
    ) -> str:
        if tools and not self.template_tools:
            assert self.call_format is not None  # _set_tools refused tools without one
            messages = for_plain_template(self.call_format, messages, tools)
            tools = None
        out = self.tokenizer.apply_chat_template(
            list(messages),
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return str(out)

    def encode(self, text: str, *, at_start: bool = False) -> tuple[int, ...]:
        """Template text to ids: control-token strings become control ids.

        ``at_start``: ``text`` begins a rendering, and is encoded as the tokenizer's own
        ``encode`` does; else it is a piece inside one (after a control token, as a
        completion or a continuation is), which a SentencePiece-style tokenizer encodes
        without the prefix space it gives the start of a text.
        """
        if not text:
            return ()
        if at_start or not self._start.encodes:
            return tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return self._start.encode_inside(text)

    def encode_plain(self, text: str, *, at_start: bool = False) -> tuple[int, ...]:
        """Text to ids with no control id: control-token strings are encoded as characters.

        Special tokens are split by the tokenizer (``split_special_tokens``); a non-special
        added token that looks like markup (Qwen's ``<tool_call>``), or a special token the
        model has as a vocabulary piece (a Unigram model's ``</s>``), is cut after its first
        character, since the tokenizer matches those even then. (The unknown token, for a
        character outside the vocabulary, is no markup.) ``at_start`` as ``encode``.
        """
        cuts = [m.start() + 1 for m in self._control.unsplit(text)]
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if not piece:
                continue
            if (at_start and k == 0) or not self._start.encodes:
                ids += self.tokenizer.encode(
                    piece, add_special_tokens=False, split_special_tokens=True
                )
            else:
                ids += self._start.encode_plain_inside(piece)
        if any(i in self._control.ids and i != self.tokenizer.unk_token_id for i in ids):
            raise TemplateError(
                f"cannot encode {text[:60]!r} without control tokens: the tokenizer matches "
                "them even with special tokens split"
            )
        return tuple(ids)

    def decode(self, ids: Sequence[int], *, at_start: bool = False) -> str:
        """Ids to text, exactly (no special token skipped, no spaces cleaned up).

        ``at_start``: the ids begin a rendering; else they are a piece inside one, as a
        sampled completion is: a SentencePiece-style decoder drops the prefix space of the
        start of a text, which inside a conversation is part of it and kept.
        """
        if at_start or not self._start.decodes:
            return _decode(self.tokenizer, ids)
        return self._start.decode_inside(ids)

    def prompt(self, messages: Sequence[Message]) -> tuple[int, ...]:
        """The token ids of a conversation ready for the assistant's next turn."""
        text = self.text(messages, add_generation_prompt=True)
        return self._encode(text, self._plain_spans(messages, text, add_generation_prompt=True))

    def continuation(
        self,
        history: Sequence[Message],
        observation: Sequence[Message],
        context_ids: Sequence[int],
    ) -> Continuation:
        """Tokens that follow ``context_ids`` once ``observation`` is appended.

        ``history`` ends with the assistant message whose sampled tokens end ``context_ids``.
        The returned ids cover what the template forces after the completion (e.g. a newline
        after the end-of-turn token), the observation, and the next generation prompt.
        """
        messages = [*history, *observation]
        after = self.text(messages, add_generation_prompt=True)
        spans = self._plain_spans(messages, after, add_generation_prompt=True)
        held = self.decode(context_ids, at_start=True)
        if after.startswith(held):
            return Continuation(self._encode(after, spans, start=len(held)), template_break=False)
        return Continuation(self._encode(after, spans), template_break=True)

    def _encode(self, text: str, plain: Sequence[Span], start: int = 0) -> tuple[int, ...]:
        """``text[start:]`` to ids, ``text[:start]`` being held already: the ``plain`` spans
        as text, the rest as template text.

        For a SentencePiece-style tokenizer each plain span is widened to its whole run of
        text (``_runs``). A byte-level one encodes the span alone, as it always has: its
        pre-tokenizer cuts the text at the spaces and newlines around content anyway."""
        ids: list[int] = []
        pos = start
        for a, b in self._runs(text, plain) if self._start.encodes else plain:
            if b <= pos:
                continue
            a = max(a, pos)
            ids += self.encode(text[pos:a], at_start=pos == 0)
            ids += self.encode_plain(text[a:b], at_start=a == 0)
            pos = b
        ids += self.encode(text[pos:], at_start=pos == 0)
        return tuple(ids)

    def _runs(self, text: str, plain: Sequence[Span]) -> list[Span]:
        """The ``plain`` spans of ``text``, each widened to the whole run of text between
        the template's control tokens before and after it, merged where they meet.

        A run is what the tokenizer encodes in one piece when it encodes the whole
        rendering (it cuts text at control tokens only), so its ids do not depend on where
        in it the content starts and ends, whatever merges the tokenizer makes across
        spaces (SentencePiece's do)."""
        if not plain:
            return []
        template = [
            m
            for m in self._control.matches(text)
            if not any(a < m.end() and m.start() < b for a, b in plain)
        ]
        starts = [m.start() for m in template]
        ends = [m.end() for m in template]
        runs: list[Span] = []
        for a, b in plain:
            before = bisect_right(ends, a) - 1
            after = bisect_left(starts, b)
            run = (
                ends[before] if before >= 0 else 0,
                starts[after] if after < len(starts) else len(text),
            )
            if runs and run[0] <= runs[-1][1]:
                runs[-1] = (runs[-1][0], max(runs[-1][1], run[1]))
            else:
                runs.append(run)
        return runs

    def _dirty(self, messages: Sequence[Message]) -> dict[Location, str]:
        """The strings shown as text that hold a control-token string, by where they sit:
        the content of non-assistant messages, and the tool schemas' strings."""
        dirty: dict[Location, str] = {
            ("messages", i, "content"): content
            for i, m in enumerate(messages)
            if m.get("role") != "assistant"
            and isinstance(content := m.get("content"), str)
            and self._control.found_in(content)
        }
        return {**dirty, **self._dirty_tools}

    def _render_with(
        self, messages: Sequence[Message], values: dict[Location, str], add_generation_prompt: bool
    ) -> str:
        """The rendering with the strings at ``values``' locations replaced by its values."""
        tools = _replaced(self.tools, ("tools",), values) if self._dirty_tools else self.tools
        return self._render(
            _replaced(list(messages), ("messages",), values), tools, add_generation_prompt
        )

    def _plain_spans(
        self, messages: Sequence[Message], text: str, *, add_generation_prompt: bool
    ) -> tuple[Span, ...]:
        """Where ``text`` (the rendering of ``messages`` and the tools) shows those strings
        (non-assistant message content, tool schemas) that hold a control-token string, in
        order; usually none.

        The rendering is repeated with a unique placeholder for each such string. Where
        the template writes it verbatim, putting the string back in place of its
        placeholder gives ``text`` again; where it transforms it (e.g. ``tojson``), each
        string's rendered form is read off a rendering with only that string real.
        Raises ``TemplateError`` where neither reproduces ``text`` (a template that branches
        on what the content says).
        """
        dirty = self._dirty(messages)
        if not dirty:
            return ()
        marks = dict(zip(dirty, _placeholders(len(dirty), [text, *dirty.values()]), strict=True))
        skeleton = self._render_with(messages, marks, add_generation_prompt)
        filled, spans = _fill(skeleton, {marks[p]: dirty[p] for p in dirty})
        if filled == text:
            return spans
        forms: dict[str, str] = {}
        for path, value in dirty.items():
            count = skeleton.count(marks[path])
            if not count:
                continue  # the template does not show this string
            alone = self._render_with(messages, {**marks, path: value}, add_generation_prompt)
            grown, rest = divmod(len(alone) - len(skeleton), count)
            if rest:
                continue  # not a plain substitution: left as a placeholder, refused below
            start = skeleton.index(marks[path])
            forms[marks[path]] = alone[start : start + len(marks[path]) + grown]
        filled, spans = _fill(skeleton, forms)
        if filled != text:
            raise TemplateError(
                "cannot tell message content from template text in this chat template's "
                "rendering (it changes what it writes depending on the content), so a "
                "message holding a control-token string cannot be encoded as plain text"
            )
        return spans


PROBE_TOOL: ToolSchema = {
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
"""The tool of ``template_report``'s probe conversation (when the renderer has none)."""


@dataclass(frozen=True)
class TemplateReport:
    """What ``template_report`` found about a chat template and tokenizer."""

    prefix: bool
    """Every step of the probe continued the tokens held so far: the assistant's call, the
    tool result and the next generation prompt (and the final answer) extend the rendering
    without rewriting it, so episodes stay one token-exact sample (no template break)."""
    round_trip: bool
    """The probe's generation prompt decodes to exactly its rendered text, and that text
    encodes back to the same ids: the text-based prefix check can be trusted."""
    observation_as_text: bool
    """A tool result holding the text of the end-of-turn token and of every control token
    the template writes was encoded as text: control ids appear in the continuation only
    where the template puts them."""
    problems: tuple[str, ...] = ()
    """One sentence per failed check: what failed, where."""

    @property
    def ok(self) -> bool:
        return not self.problems


def template_report(
    renderer: ChatRenderer,
    call_format: Format,
    stop_token_ids: Sequence[int],
    tools: Sequence[ToolSchema] | None = None,
) -> TemplateReport:
    """Check ``renderer``'s template on a probe episode, as ``run_episode`` would play it.

    The probe: a system and a user message; the assistant calls ``lookup`` in
    ``call_format``; the tool's result comes back (its text includes the end-of-turn
    token's string and every control string the template wrote in the prompt); the
    assistant answers. Each assistant turn is held as the ids of its text (as encoded
    after the prompt) followed by the first stop token, as a sampler would have produced
    them. The tools are ``tools``, else the renderer's, else ``PROBE_TOOL`` (rendered by
    the template if the format says so and the template can, else described in the system
    prompt: by the environment, as ``ToolEnv`` does, where the format says so, else by the
    renderer in the format's way). Never
    raises for a template's failure: a failure is a ``problems`` line. Meant for a
    start-up check: a template that fails ``prefix`` splits every tool episode into
    per-turn samples.
    """
    if not stop_token_ids:
        raise ValueError("template_report needs the stop token ids (the end of a turn)")
    stop = int(stop_token_ids[0])
    tools = list(tools or renderer.tools or [PROBE_TOOL])
    system = "You are a careful assistant."
    if call_format.template_tools:
        renderer = renderer.with_tools(tools, call_format)
    else:
        renderer = renderer.with_tools(())
        system = f"{system}\n\n{call_format.system_prompt(tools)}"
    function = tools[0].get("function", {})
    name = str(function.get("name", "lookup"))
    properties = list(function.get("parameters", {}).get("properties", {})) or ["key"]
    call = ToolCall(name, {properties[0]: "alpha"})  # one string argument, as the probe's
    end_text = renderer.decode([stop], at_start=True)
    messages: list[Message] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "What is the value of alpha?"},
    ]
    problems: list[str] = []
    try:
        ids = renderer.prompt(messages)
        text = renderer.text(messages, add_generation_prompt=True)
        round_trip = (
            renderer.decode(ids, at_start=True) == text
            and renderer.encode(text, at_start=True) == ids
        )
        if not round_trip:
            problems.append(
                "the generation prompt does not round-trip: decoding its ids does not give "
                "the rendered text back exactly, or that text encodes to other ids (the "
                "prefix check compares decoded text, so every turn may count as a break)"
                + (_SPACE_AFTER_CONTROL if renderer.decode(renderer.encode("a")) != "a" else "")
            )
        written = (m.group() for m in renderer._control.matches(text))
        result = " ".join(["cat", *dict.fromkeys([end_text, *written]), "dog"])
        prefix, as_text = True, True
        call_text = call_format.render_call(call)
        context = [*ids, *renderer.encode(call_text), stop]
        messages.append({"role": "assistant", "content": call_text})
        observation = call_format.render_results([(call, result)])
        clean = call_format.render_results([(call, "cat dog")])
        cont = renderer.continuation(messages, observation, context)
        plain = renderer.continuation(messages, clean, context)
        if cont.template_break:
            prefix = False
            problems.append(
                "after the tool call and its result, the rendering no longer starts with "
                "the tokens held: the template rewrites history, so every tool episode "
                "splits into per-turn samples (counted as rollout/template_breaks)"
            )
        control = renderer._control.ids
        if [i for i in cont.ids if i in control] != [i for i in plain.ids if i in control] or (
            result not in renderer.decode(cont.ids)
        ):
            as_text = False
            problems.append(
                f"a tool result containing the template's control strings ({result[4:-4]!r}) "
                "was not encoded as plain text"
            )
        context = [*cont.ids] if cont.template_break else [*context, *cont.ids]
        answer = "The value is cat."
        context += [*renderer.encode(answer), stop]
        messages += [*observation, {"role": "assistant", "content": answer}]
        whole = renderer.text(messages, add_generation_prompt=False)
        if not whole.startswith(renderer.decode(context, at_start=True)):
            prefix = False
            problems.append(
                "the final answer, as sampled after the generation prompt, is not how the "
                "template renders the finished conversation (the generation prompt and the "
                "rendering of assistant turns disagree)"
            )
    except TemplateError as exc:  # a template turnrl cannot work with: every check fails
        problems.append(f"the probe could not be rendered: {exc}")
        return TemplateReport(False, False, False, tuple(problems))
    return TemplateReport(prefix, round_trip, as_text, tuple(problems))


_SPACE_AFTER_CONTROL = (
    "; the tokenizer puts a prefix space in front of the text after each control token "
    "(a Metaspace pre-tokenizer with prepend_scheme='always', as transformers builds a "
    "Llama tokenizer with legacy=True): load the tokenizer with legacy=False"
)
"""Why a SentencePiece-style tokenizer fails the round trip, where that is the reason."""


class _ControlTokens:
    """The strings a tokenizer turns into control ids: its special tokens, and its
    non-special added tokens that look like markup (``<...>`` or ``[...]``, as Qwen's
    ``<tool_call>`` and ``<think>``). Other added tokens (whitespace runs in some
    vocabularies) are ordinary text. Those of them the tokenizer still turns into a control
    id with special tokens split are ``unsplit``."""

    def __init__(self, tokenizer: Any) -> None:
        added: dict[int, Any] = dict(getattr(tokenizer, "added_tokens_decoder", {}))
        control = {i: t for i, t in added.items() if t.special or _looks_like_markup(t.content)}
        self.ids = frozenset(control)
        self._all = _alternation(t.content for t in control.values())
        # Split special tokens can still come back whole where the model has them as
        # pieces of its vocabulary (a Unigram model finds them); those are cut too.
        special = [t.content for t in control.values() if t.special]
        pieces = (
            tokenizer(special, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            if special
            else []
        )
        whole = [s for s, ids in zip(special, pieces, strict=True) if self.ids & set(ids)]
        self._unsplit = _alternation(
            [*(t.content for t in control.values() if not t.special), *whole]
        )
        # A special token that matches only its own text (no stripping of the whitespace
        # around it): what a piece inside a rendering is encoded after. The end of
        # sequence first, the lowest id otherwise, so the choice is the same every time.
        plain = {
            i: t.content
            for i, t in sorted(control.items())
            if t.special and not (t.lstrip or t.rstrip or t.single_word)
        }
        eos = getattr(tokenizer, "eos_token_id", None)
        first = eos if eos in plain else next(iter(plain), None)
        self.anchor: tuple[str, int] | None = None if first is None else (plain[first], first)

    def found_in(self, text: str) -> bool:
        return self._all is not None and self._all.search(text) is not None

    def matches(self, text: str) -> list[re.Match[str]]:
        """Occurrences of the control strings in ``text``, left to right."""
        return [] if self._all is None else list(self._all.finditer(text))

    def unsplit(self, text: str) -> list[re.Match[str]]:
        """Occurrences of the control strings that ``split_special_tokens`` leaves whole
        (encoded as text, they are cut after their first character)."""
        return [] if self._unsplit is None else list(self._unsplit.finditer(text))


class _TextStart:
    """Whether a tokenizer treats the start of a text apart, and pieces inside a text.

    SentencePiece-style tokenizers (a Metaspace pre-tokenizer with ``prepend_scheme``
    ``"first"``, as transformers loads Llama 2's and Mistral's; or a ``Prepend("▁")``
    normalizer) give the text at the very start of a string a prefix space ("▁"), and their
    decoder drops a leading space at the start of what it decodes. A piece of a rendering
    that follows a control token gets neither. So a piece is encoded after ``anchor`` (a
    control token, one id, which is dropped) and decoded after it; plain text (control
    strings split, so no control anchor) after a text anchor whose own ids are dropped,
    verified to be a prefix of the ids (the tokenizer made no token across the two).
    Byte-level BPE tokenizers have no such rule (``encodes`` and ``decodes`` are False),
    and their pieces are encoded and decoded directly, at no extra cost.
    """

    _PROBES = ("a", " a", "a b", "\n", "1", ".")
    """Texts whose ids, at the start of a string and after a control token, tell whether
    the tokenizer encodes the start of a text apart."""
    _TEXT_ANCHORS = ("\x00", "\n", ".", "a")
    """Plain-text anchors, tried in order: a character outside the vocabulary (byte
    fallback, or the unknown token) merges with nothing; the others rarely do."""

    def __init__(self, tokenizer: Any, anchor: tuple[str, int] | None) -> None:
        self.tokenizer = tokenizer
        self.anchor = anchor
        self.encodes = False
        """Text is encoded otherwise at the start of a string than after a control token."""
        self.decodes = False
        """Ids are decoded otherwise at the start of a string than after a control token."""
        self._text_anchors: list[tuple[str, tuple[int, ...]]] = []
        if anchor is None:  # no special token to tell the two apart: pieces are encoded as is
            return
        try:
            encodes = any(
                tuple(tokenizer.encode(s, add_special_tokens=False)) != self.encode_inside(s)
                for s in self._PROBES
            )
            ids = self.encode_inside(" a b")
            decodes = _decode(tokenizer, ids) != self.decode_inside(ids)
        except TemplateError:  # the anchor does not work: pieces are encoded as they are
            return
        self.encodes, self.decodes = encodes, decodes
        if self.encodes:
            self._text_anchors = [
                (a, tuple(tokenizer.encode(a, add_special_tokens=False, split_special_tokens=True)))
                for a in self._TEXT_ANCHORS
            ]

    def encode_inside(self, text: str) -> tuple[int, ...]:
        """``text`` (control strings recognised) as encoded after a control token."""
        assert self.anchor is not None
        mark, mark_id = self.anchor
        ids = self.tokenizer.encode(mark + text, add_special_tokens=False)
        if not ids or ids[0] != mark_id:
            raise TemplateError(
                f"cannot encode {text[:60]!r} as it reads after a control token: the "
                f"tokenizer does not keep {mark!r} as one token in front of it"
            )
        return tuple(ids[1:])

    def encode_plain_inside(self, text: str) -> tuple[int, ...]:
        """``text`` (control strings split) as encoded after a control token."""
        for mark, mark_ids in self._text_anchors:
            ids = self.tokenizer.encode(
                mark + text, add_special_tokens=False, split_special_tokens=True
            )
            if tuple(ids[: len(mark_ids)]) == mark_ids:
                return tuple(ids[len(mark_ids) :])
        raise TemplateError(
            f"cannot encode {text[:60]!r} as text inside a rendering: the tokenizer merges "
            "it with every anchor tried in front of it"
        )

    def decode_inside(self, ids: Sequence[int]) -> str:
        """``ids`` decoded as they read after a control token."""
        assert self.anchor is not None
        mark, mark_id = self.anchor
        text = _decode(self.tokenizer, [mark_id, *ids])
        if not text.startswith(mark):
            raise TemplateError(f"the tokenizer does not decode {mark!r} to itself")
        return text[len(mark) :]


def _renders_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template renders a ``tools=`` list: it names ``tools``
    and a one-message conversation renders otherwise with ``PROBE_TOOL`` than without."""
    if "tools" not in tokenizer.chat_template:
        return False
    probe = [{"role": "user", "content": "Hello."}]
    try:
        renders = [
            tokenizer.apply_chat_template(probe, tools=t, tokenize=False)
            for t in ([PROBE_TOOL], None)
        ]
    except Exception:  # a template that cannot render the probe: trust that it names tools
        return True
    return bool(renders[0] != renders[1])


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """``ids`` as the tokenizer decodes them: every token, no spaces cleaned up."""
    return str(
        tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    )


def _string_leaves(tree: Any, path: Location) -> Iterator[tuple[Location, str]]:
    """Every string value in ``tree`` (dicts and lists), with where it sits."""
    if isinstance(tree, str):
        yield path, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _string_leaves(value, (*path, key))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from _string_leaves(value, (*path, i))


def _replaced(tree: Any, path: Location, values: dict[Location, str]) -> Any:
    """A copy of ``tree`` with the strings at ``values``' paths replaced (others shared)."""
    if path in values:
        return values[path]
    if isinstance(tree, dict):
        return {k: _replaced(v, (*path, k), values) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_replaced(v, (*path, i), values) for i, v in enumerate(tree)]
    return tree


def _looks_like_markup(content: str) -> bool:
    return len(content) > 2 and (
        (content[0], content[-1]) == ("<", ">") or (content[0], content[-1]) == ("[", "]")
    )


def _alternation(strings: Iterable[str]) -> re.Pattern[str] | None:
    """A pattern matching any of ``strings``, longest first (None for none)."""
    ordered = sorted({s for s in strings if s}, key=len, reverse=True)
    return re.compile("|".join(re.escape(s) for s in ordered)) if ordered else None


_MARK = "4127308659"
"""Brackets each placeholder: digits, which escaping and case changes leave as they are."""


def _placeholders(count: int, taken: Sequence[str]) -> list[str]:
    """``count`` placeholders: digits only (``_MARK``, a nonce, a number, ``_MARK``), all of
    one length so none is inside another, and found in none of the ``taken`` texts."""
    nonce = 0
    while True:
        marks = [f"{_MARK}{nonce:04d}{i:06d}{_MARK}" for i in range(count)]
        if not any(mark in t for mark in marks for t in taken):
            return marks
        nonce += 1


def _fill(skeleton: str, forms: dict[str, str]) -> tuple[str, tuple[Span, ...]]:
    """``skeleton`` with each placeholder replaced by its form, and the forms' spans."""
    if not forms:
        return skeleton, ()
    pattern = re.compile("|".join(re.escape(mark) for mark in forms))
    out: list[str] = []
    spans: list[Span] = []
    pos = length = 0
    for match in pattern.finditer(skeleton):
        out.append(skeleton[pos : match.start()])
        length += match.start() - pos
        form = forms[match.group()]
        spans.append((length, length + len(form)))
        out.append(form)
        length += len(form)
        pos = match.end()
    out.append(skeleton[pos:])
    return "".join(out), tuple(spans)
