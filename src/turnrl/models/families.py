"""What a tiny model of each family looks like: control tokens, chat template, call format.

A ``Family`` is the data that makes a tiny model behave like a real model family at the
token level: its special (control) tokens, its non-special added tokens, its chat template
and the tool-call format its template and tokens are made for. ``tiny.py`` trains a
tokenizer and initialises a model from it; the ChatML families (``qwen2``, ``llama``: the
original tiny model) are defined there, next to their template. The three here are:

- ``qwen3``: ChatML as Qwen2.5, hermes ``<tool_call>`` calls, ``<tool_response>`` results,
  ``<think>`` reasoning; the template drops the ``<think>`` block of every assistant turn
  before the last user message, so it rewrites history when a new user message arrives.
- ``llama3``: Llama 3.1's header layout, tool calls as a bare JSON object, results in
  ``ipython`` turns, the tool list as JSON in the system turn.
- ``mistral``: Mistral's v3 tokenizer layout, ``[INST]`` turns, ``[TOOL_CALLS]`` lists,
  ``[TOOL_RESULTS]`` blocks, the tool list in ``[AVAILABLE_TOOLS]`` before the last user
  message (which also takes the system prompt), so it too rewrites history when a new user
  message arrives.

The templates are written here from the families' documented formats, not copied from
their checkpoints, and are kept short (tiny models have short contexts). Each renders
assistant content verbatim (real templates sometimes trim it), so a tool loop continues
token-exactly; the history rewrites above are the families' own and show up as counted
template breaks in rollouts. No torch here: templates and token lists are plain data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ModelType = Literal["qwen2", "llama", "qwen3", "mistral"]
"""The transformers architecture a family's model is built with."""


@dataclass(frozen=True)
class Family:
    """The tokens and template of one model family (see the module docstring)."""

    name: str
    """The name ``TinyModelConfig.arch`` and ``model.tiny.arch`` use."""
    model_type: ModelType
    """Architecture of the model: Qwen2, Llama, Qwen3 or Mistral ``ForCausalLM``."""
    chat_template: str
    """Jinja chat template, saved with the tokenizer."""
    special_tokens: tuple[str, ...]
    """Control tokens: single special ids, the family's whole set (ids 0, 1, ...)."""
    eos_token: str
    """End of an assistant turn: the sampler's stop token."""
    pad_token: str
    """Pads batches (and is the model's ``bos_token_id`` where the family has no BOS)."""
    tool_format: str
    """The ``turnrl.formats`` name of the tool-call format the template renders."""
    tool_result: str
    """How a tool result looks in text: a ``str.format`` pattern, ``{}`` for the result
    (for the tokenizer's corpus only; rollouts render results with the chat template)."""
    bos_token: str | None = None
    """Beginning of text, written by the template itself (None: the family has none)."""
    added_tokens: tuple[str, ...] = ()
    """Non-special added tokens (single ids that decoding never skips), as Qwen's tags."""

    @property
    def all_tokens(self) -> tuple[str, ...]:
        """Special and added tokens: the strings that encode as one id."""
        return self.special_tokens + self.added_tokens


_CHATML_TOOL_ROUND = (
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
)
"""Consecutive ``tool`` messages share one user turn of ``<tool_response>`` blocks."""

_HERMES_CALLS = (
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
)
"""An assistant message's structured ``tool_calls`` as hermes ``<tool_call>`` blocks."""

QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a function with <tool_call>\\n' }}"
    '{{- \'{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>\' }}'
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    + _CHATML_TOOL_ROUND
    + "{%- elif message.role == 'assistant' %}"
    # Qwen3: reasoning of turns before the last user query is not shown again.
    "{%- if loop.index0 < ns.last_query and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content is string and loop.index0 > ns.last_query %}"
    "{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- content }}" + _HERMES_CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- elif not (tools and loop.first and message.role == 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
"""ChatML with hermes tools and Qwen3's reasoning rule.

As the tiny ChatML template (a system turn lists the tools as JSON lines in ``<tools>``;
consecutive ``tool`` messages share one user turn of ``<tool_response>`` blocks; structured
``tool_calls`` render as ``<tool_call>`` blocks), plus: an assistant turn before the last
``user`` message loses everything up to its ``</think>`` (its reasoning); a
``reasoning_content`` field of a later turn renders as a ``<think>`` block;
``enable_thinking=False`` ends the generation prompt with an empty ``<think>`` block."""

QWEN3 = Family(
    name="qwen3",
    model_type="qwen3",
    chat_template=QWEN3_TEMPLATE,
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    added_tokens=(
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    ),
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    tool_format="hermes",
    tool_result="<tool_response>\n{}\n</tool_response>",
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set system = messages[0].content if messages and messages[0].role == 'system' "
    "else '' %}"
    "{%- if system or tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system }}"
    "{%- if tools %}"
    "{%- if system %}{{- '\\n\\n' }}{%- endif %}"
    "{{- 'To call a function, reply with only a JSON object ' }}"
    '{{- \'{"name": function name, "parameters": {argument name: value}}. Functions:\' }}'
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + content + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + content }}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if content or not loop.first %}{{- '; ' }}{%- endif %}"
    '{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- elif not (loop.first and message.role == 'system') %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{{- content + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
"""Llama 3.1's layout: ``<|begin_of_text|>``, then each message as
``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>``. With ``tools``, the
system turn (the first message's content if it is a system message) ends with the call
instructions and one JSON schema per line. ``tool`` (and ``ipython``) messages render as
``ipython`` turns; structured ``tool_calls`` as ``{"name": ..., "parameters": ...}`` objects
joined by ``; ``."""

LLAMA3 = Family(
    name="llama3",
    model_type="llama",
    chat_template=LLAMA3_TEMPLATE,
    special_tokens=(
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
        "<|finetune_right_pad_id|>",
    ),
    bos_token="<|begin_of_text|>",
    eos_token="<|eot_id|>",
    pad_token="<|finetune_right_pad_id|>",
    tool_format="llama3_json",
    tool_result="<|start_header_id|>ipython<|end_header_id|>\n\n{}<|eot_id|>",
)

MISTRAL_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1, system='') %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- elif message.role == 'system' and message.content is string %}"
    "{%- set ns.system = message.content %}{%- endif %}"
    "{%- endfor %}"
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}"
    "{{- '[AVAILABLE_TOOLS]' }}{{- tools | tojson }}{{- '[/AVAILABLE_TOOLS]' }}"
    "{%- endif %}"
    "{{- '[INST] ' }}"
    "{%- if ns.system and loop.index0 == ns.last_user %}{{- ns.system + '\\n\\n' }}{%- endif %}"
    "{{- content + '[/INST]' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- content }}"
    "{%- if message.tool_calls %}"
    "{{- '[TOOL_CALLS][' }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if not loop.first %}{{- ', ' }}{%- endif %}"
    '{{- \'{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}' }}"
    "{%- endfor %}"
    "{{- ']' }}"
    "{%- endif %}"
    "{{- eos_token }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '[TOOL_RESULTS]' }}"
    "{%- if message.name is defined %}"
    "{{- '{\"name\": ' }}{{- message.name | tojson }}{{- ', \"content\": ' }}"
    "{%- else %}{{- '{\"content\": ' }}{%- endif %}"
    "{{- content | tojson }}{{- '}[/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)
"""Mistral's v3 layout: ``<s>``, user turns as ``[INST] {content}[/INST]``, the assistant's
text right after ``[/INST]`` closed by ``</s>``, structured ``tool_calls`` as one
``[TOOL_CALLS][...]`` JSON list, each ``tool`` message as
``[TOOL_RESULTS]{"name": ..., "content": ...}[/TOOL_RESULTS]`` (the content JSON-encoded).
The tool list (``[AVAILABLE_TOOLS][...][/AVAILABLE_TOOLS]``) and the system prompt go with
the last user message. There is no generation prompt: the model writes right after
``[/INST]`` or ``[/TOOL_RESULTS]``."""

MISTRAL = Family(
    name="mistral",
    model_type="mistral",
    chat_template=MISTRAL_TEMPLATE,
    special_tokens=(
        "<unk>",
        "<s>",
        "</s>",
        "[INST]",
        "[/INST]",
        "[TOOL_CALLS]",
        "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]",
    ),
    bos_token="<s>",
    eos_token="</s>",
    pad_token="<unk>",
    tool_format="mistral",
    tool_result='[TOOL_RESULTS]{{"content": "{}"}}[/TOOL_RESULTS]',
)
