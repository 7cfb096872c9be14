"""Chat-template token accounting: the conversation as the exact tokens the model saw.

The first prompt is rendered by the tokenizer's chat template. After each model turn the
conversation grows by the assistant message and the observation; instead of re-tokenizing
everything (which could change the sampled tokens), the grown conversation is rendered,
the text after what we already hold is taken, and only that suffix is tokenized. A check
confirms that the rendering starts with the history we hold (decoded exactly); a template
that rewrites history (e.g. strips earlier reasoning) is a *template break*: the caller then
starts a fresh sample from a full re-rendering, and counts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.errors import TemplateError
from turnrl.protocols import ToolSchema
from turnrl.types import Message


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
        if tools and "tools" not in tokenizer.chat_template:
            raise TemplateError(
                "the tokenizer's chat template does not render tools; use a format that puts "
                "the tool list in the system prompt (template_tools=False)"
            )
        self.tokenizer = tokenizer
        self.tools = list(tools) or None

    def with_tools(self, tools: Sequence[ToolSchema]) -> ChatRenderer:
        """The same renderer for a conversation that offers ``tools``."""
        return ChatRenderer(self.tokenizer, tools)

    def text(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        out = self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return str(out)

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(
            self.tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    def prompt(self, messages: Sequence[Message]) -> tuple[int, ...]:
        """The token ids of a conversation ready for the assistant's next turn."""
        return self.encode(self.text(messages, add_generation_prompt=True))

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
        after = self.text([*history, *observation], add_generation_prompt=True)
        held = self.decode(context_ids)
        if after.startswith(held):
            return Continuation(self.encode(after[len(held) :]), template_break=False)
        return Continuation(self.encode(after), template_break=True)
