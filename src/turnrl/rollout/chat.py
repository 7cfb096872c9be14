"""Chat-template token accounting: the conversation as the exact tokens the model saw.

The first prompt is rendered by the tokenizer's chat template. After each model turn the
conversation grows by the assistant message and the observation; instead of re-tokenizing
everything (which could change the sampled tokens), the grown conversation is rendered,
the text after what we already hold is taken, and only that suffix is tokenized. A check
confirms that the rendering starts with the history we hold (decoded exactly); a template
that rewrites history (e.g. strips earlier reasoning) is a *template break*: the caller then
starts a fresh sample from a full re-rendering, and counts it.

Message content is text, never control tokens: a tool result (or a user or system message)
that contains ``<|im_end|>``, ``<|eot_id|>`` or ``[INST]`` is encoded as the characters it
is, and only the template's own markup becomes control ids. Content holding no control
string is encoded together with the template text around it, exactly as a plain
``encode`` of the rendering would; content that does is located in the rendering (with
placeholders) and encoded on its own with special tokens split. Assistant content is the
model's own language (its calls use control tokens) and its sampled ids are held, never
re-encoded. ``template_report`` checks a template's prefix property at start-up.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.errors import TemplateError
from turnrl.protocols import Format, ToolSchema
from turnrl.types import Message, ToolCall

Span = tuple[int, int]
"""A ``[start, end)`` range of characters in a rendering."""


@dataclass(frozen=True)
class Continuation:
    """The tokens to append after a completion, or a full re-rendering after a break."""

    ids: tuple[int, ...]
    template_break: bool


class ChatRenderer:
    """Renders conversations to token ids with one tokenizer's chat template."""

    def __init__(self, tokenizer: Any, tools: Sequence[ToolSchema] = ()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                "the tokenizer has no chat template; turnrl needs one to render conversations"
            )
        self.tokenizer = tokenizer
        self.tools: list[ToolSchema] | None = None
        self._set_tools(tools)
        self._control = _ControlTokens(tokenizer)

    def _set_tools(self, tools: Sequence[ToolSchema]) -> None:
        if tools and "tools" not in self.tokenizer.chat_template:
            raise TemplateError(
                "the tokenizer's chat template does not render tools; use a format that puts "
                "the tool list in the system prompt (template_tools=False)"
            )
        self.tools = list(tools) or None

    def with_tools(self, tools: Sequence[ToolSchema]) -> ChatRenderer:
        """The same renderer for a conversation that offers ``tools``."""
        other = copy.copy(self)  # shares the tokenizer and what was read from its vocabulary
        other._set_tools(tools)
        return other

    def text(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        out = self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return str(out)

    def encode(self, text: str) -> tuple[int, ...]:
        """Template text to ids: control-token strings become control ids."""
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_plain(self, text: str) -> tuple[int, ...]:
        """Text to ids with no control id: control-token strings are encoded as characters.

        Special tokens are split by the tokenizer (``split_special_tokens``); a non-special
        added token that looks like markup (Qwen's ``<tool_call>``) is cut after its first
        character, since the tokenizer matches those even then.
        """
        cuts = [m.start() + 1 for m in self._control.unsplit(text)]
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        ids: list[int] = []
        for piece in pieces:
            ids += self.tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=True)
        if any(i in self._control.ids for i in ids):
            raise TemplateError(
                f"cannot encode {text[:60]!r} without control tokens: the tokenizer matches "
                "them even with special tokens split"
            )
        return tuple(ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(
            self.tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

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
        held = self.decode(context_ids)
        if after.startswith(held):
            return Continuation(self._encode(after, spans, start=len(held)), template_break=False)
        return Continuation(self._encode(after, spans), template_break=True)

    def _encode(self, text: str, plain: Sequence[Span], start: int = 0) -> tuple[int, ...]:
        """``text[start:]`` to ids: the ``plain`` spans as text, the rest as template text."""
        ids: list[int] = []
        pos = start
        for a, b in plain:
            if b <= pos:
                continue
            a = max(a, pos)
            ids += self.encode(text[pos:a])
            ids += self.encode_plain(text[a:b])
            pos = b
        ids += self.encode(text[pos:])
        return tuple(ids)

    def _plain_spans(
        self, messages: Sequence[Message], text: str, *, add_generation_prompt: bool
    ) -> tuple[Span, ...]:
        """Where ``text`` (the rendering of ``messages``) shows the content of those
        non-assistant messages that hold a control-token string, in order; usually none.

        The rendering is repeated with a unique placeholder for each such content. Where
        the template writes content verbatim, putting the content back in place of its
        placeholder gives ``text`` again; where it transforms content (e.g. ``tojson``),
        each content's rendered form is read off a rendering with only that content real.
        Raises ``TemplateError`` where neither reproduces ``text`` (a template that branches
        on what the content says).
        """
        dirty = {
            i: content
            for i, m in enumerate(messages)
            if m.get("role") != "assistant"
            and isinstance(content := m.get("content"), str)
            and self._control.found_in(content)
        }
        if not dirty:
            return ()
        marks = _placeholders(dirty, text)
        masked = [{**m, "content": marks[i]} if i in dirty else m for i, m in enumerate(messages)]
        skeleton = self.text(masked, add_generation_prompt=add_generation_prompt)
        filled, spans = _fill(skeleton, {marks[i]: dirty[i] for i in dirty})
        if filled == text:
            return spans
        forms: dict[str, str] = {}
        for i, content in dirty.items():
            count = skeleton.count(marks[i])
            if not count:
                continue  # the template does not show this content
            alone = self.text(
                [{**m, "content": content} if j == i else m for j, m in enumerate(masked)],
                add_generation_prompt=add_generation_prompt,
            )
            grown, rest = divmod(len(alone) - len(skeleton), count)
            if rest:
                continue  # not a plain substitution: left as a placeholder, refused below
            start = skeleton.index(marks[i])
            forms[marks[i]] = alone[start : start + len(marks[i]) + grown]
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
    """A tool result holding the end-of-turn token's text was encoded as text: the stop id
    appears in the continuation only where the template puts it."""
    problems: tuple[str, ...] = ()
    """One sentence per failed check: what failed, where."""

    @property
    def ok(self) -> bool:
        return not self.problems


def template_report(
    renderer: ChatRenderer, call_format: Format, stop_token_ids: Sequence[int]
) -> TemplateReport:
    """Check ``renderer``'s template on a probe episode, as ``run_episode`` would play it.

    The probe: a system and a user message; the assistant calls ``lookup`` in
    ``call_format``; the tool's result comes back (its text includes the end-of-turn
    token's string); the assistant answers. Each assistant turn is held as the ids of its
    text followed by the first stop token, as a sampler would have produced them. The
    tools are the renderer's, else ``PROBE_TOOL`` (rendered by the template if the format
    says so, else described in the system prompt, as ``ToolEnv`` does). Never raises for
    a template's failure: a failure is a ``problems`` line. Meant for a start-up check:
    a template that fails ``prefix`` splits every tool episode into per-turn samples.
    """
    if not stop_token_ids:
        raise ValueError("template_report needs the stop token ids (the end of a turn)")
    stop = int(stop_token_ids[0])
    tools = list(renderer.tools or [PROBE_TOOL])
    system = "You are a careful assistant."
    if call_format.template_tools:
        renderer = renderer.with_tools(tools)
    else:
        renderer = renderer.with_tools(())
        system = f"{system}\n\n{call_format.system_prompt(tools)}"
    function = tools[0].get("function", {})
    name = str(function.get("name", "lookup"))
    properties = list(function.get("parameters", {}).get("properties", {})) or ["key"]
    call = ToolCall(name, {properties[0]: "alpha"})  # one string argument, as the probe's
    end_text = renderer.decode([stop])
    result = f"cat {end_text} dog"
    messages: list[Message] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "What is the value of alpha?"},
    ]
    problems: list[str] = []
    try:
        ids = renderer.prompt(messages)
        text = renderer.text(messages, add_generation_prompt=True)
        round_trip = renderer.decode(ids) == text and renderer.encode(text) == ids
        if not round_trip:
            problems.append(
                "the generation prompt does not round-trip: decoding its ids does not give "
                "the rendered text back exactly, or that text encodes to other ids (the "
                "prefix check compares decoded text, so every turn may count as a break)"
            )
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
        if cont.ids.count(stop) != plain.ids.count(stop) or result not in renderer.decode(cont.ids):
            as_text = False
            problems.append(f"a tool result containing {end_text!r} was not encoded as plain text")
        context = [*cont.ids] if cont.template_break else [*context, *cont.ids]
        answer = "The value is cat."
        context += [*renderer.encode(answer), stop]
        messages += [*observation, {"role": "assistant", "content": answer}]
        whole = renderer.text(messages, add_generation_prompt=False)
        if not whole.startswith(renderer.decode(context)):
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


class _ControlTokens:
    """The strings a tokenizer turns into control ids: its special tokens, and its
    non-special added tokens that look like markup (``<...>`` or ``[...]``, as Qwen's
    ``<tool_call>`` and ``<think>``). Other added tokens (whitespace runs in some
    vocabularies) are ordinary text."""

    def __init__(self, tokenizer: Any) -> None:
        added: dict[int, Any] = dict(getattr(tokenizer, "added_tokens_decoder", {}))
        control = {i: t for i, t in added.items() if t.special or _looks_like_markup(t.content)}
        self.ids = frozenset(control)
        self._all = _alternation(t.content for t in control.values())
        self._unsplit = _alternation(t.content for t in control.values() if not t.special)

    def found_in(self, text: str) -> bool:
        return self._all is not None and self._all.search(text) is not None

    def unsplit(self, text: str) -> list[re.Match[str]]:
        """Occurrences of the control strings that ``split_special_tokens`` leaves whole."""
        return [] if self._unsplit is None else list(self._unsplit.finditer(text))


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


def _placeholders(dirty: dict[int, str], text: str) -> dict[int, str]:
    """One placeholder per content: digits only (``_MARK``, a nonce, the message index,
    ``_MARK``), all of one length so none is inside another, and absent from ``text`` and
    from every content."""
    nonce = 0
    while True:
        marks = {i: f"{_MARK}{nonce:04d}{i:06d}{_MARK}" for i in dirty}
        taken = [text, *dirty.values()]
        if not any(mark in t for mark in marks.values() for t in taken):
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
