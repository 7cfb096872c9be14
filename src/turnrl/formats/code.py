"""The code-fence format of tool-integrated reasoning: ```python -> ```output, then \\boxed{}.

ToRL (Li et al., 2025, arXiv:2503.23383, "ToRL: Scaling Tool-Integrated RL") and its
predecessors (ToRA, PAL) let a math model write a Python program inside a ```python
fence; the interpreter's output comes back inside a ```output fence and the model
continues. The final answer is written as ``\\boxed{...}``, the convention of math data
sets and their graders.

Grammar of one model turn (text outside fences is free reasoning):

- exactly one ```python block (``py`` and ``python3`` are accepted too): a call to the tool
  ``tool_name`` (default ``python``) with ``{argument: code}`` (default ``code``), the
  code being the lines between the fences, verbatim;
- or exactly one ``\\boxed{answer}`` outside any fence: the final answer is the text
  between its braces, stripped. Braces nest (``\\boxed{\\frac{1}{2}}`` gives
  ``\\frac{1}{2}``) and a backslash escapes the next character (``\\{`` is a literal brace).

Fences follow CommonMark: a fence is a line of three or more backticks, optionally
indented, followed on the opening line by a language; it closes at a line of at least as
many backticks and nothing else. So code holding a line of backticks is rendered with a
longer fence and reads back unchanged. Fences in other languages (```text, bare ```) are
prose: ignored, and ``\\boxed`` inside them does not count.

One block per turn, by choice: several ```python blocks are an error rather than running
the first (silently dropping the rest) or all (the later blocks were written without
seeing the earlier output). Errors (the whole turn is rejected, each problem listed once): an
unclosed fence, several python blocks, an empty python block, several ``\\boxed``
answers, an unclosed ``\\boxed{``, code and an answer in the same turn, an ```output block
the model wrote itself (it comes from the tool), and a turn with neither code nor answer.
An empty ```output opening line at the very end is allowed: it is the stop string
(``stop_strings``) at which generation ends after a code block.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from turnrl.formats._single_tool import describe_tool, the_single_tool
from turnrl.protocols import ParsedAction, ToolSchema
from turnrl.types import Message, ToolCall

_PYTHON_LANGUAGES = frozenset({"python", "py", "python3"})
_OPEN = re.compile(r"[ \t]*(`{3,})([^`]*)")
_CLOSE = re.compile(r"[ \t]*(`{3,})\s*")
_LEADING_TICKS = re.compile(r"^[ \t]*(`+)", re.MULTILINE)
_BOXED = re.compile(r"\\boxed\s*\{")


@dataclass(frozen=True)
class _Block:
    language: str
    info: str
    body: str
    line: int  # 1-based line of the opening fence
    ticks: int
    closed: bool


class CodeFormat:
    """```python fences run code; ``\\boxed{}`` answers. One block per turn."""

    name: str = "code"
    template_tools: bool = False
    stop_strings: tuple[str, ...] = ("```output",)

    def __init__(self, *, tool_name: str = "python", argument: str = "code") -> None:
        """``tool_name``: the tool a ```python block calls; ``argument``: its argument that
        receives the code."""
        self.tool_name = tool_name
        self.argument = argument

    def system_prompt(self, tools: Sequence[ToolSchema]) -> str:
        if not tools:
            return ""
        about = describe_tool(the_single_tool(tools, self.tool_name, self.name))
        about = f"About the interpreter:\n{about}\n\n" if about else ""
        return (
            "Reason step by step. You can run Python to compute or check things: write one "
            "program in a fenced block, then stop:\n"
            "```python\nprint(2 ** 10)\n```\n"
            "What the program prints comes back in a block that starts with ```output. "
            "Write at most one program per turn.\n\n"
            f"{about}"
            "When you know the final answer, write it as \\boxed{answer}, for example "
            "\\boxed{1024}, in a turn without code."
        )

    def render_call(self, call: ToolCall) -> str:
        """A ```python block (a longer fence if the code holds backtick lines). Raises
        ValueError for a call this format cannot express (another tool, other arguments)."""
        code = call.arguments.get(self.argument)
        if call.name != self.tool_name or set(call.arguments) != {self.argument}:
            raise ValueError(
                f"{self.name} can only render {self.tool_name}({self.argument}=...), got {call}"
            )
        if not isinstance(code, str):
            raise ValueError(f"{self.name}: the code must be a string, got {code!r}")
        return _fenced("python", code)

    def parse(self, text: str) -> ParsedAction:
        """The one call, or the answer, or every error found. Never raises."""
        blocks, prose = _split_fences(text)
        errors: list[str] = []
        codes: list[str] = []
        for block in blocks:
            if block.language == "output":
                # An empty, unclosed ```output at the end is the stop string; anything
                # else is output the model wrote itself.
                if block.closed or block.body.strip():
                    errors.append(
                        "```output blocks come from the tool: end your turn after ```python"
                    )
            elif not block.closed:
                errors.append(_unclosed(block))
            elif block.language in _PYTHON_LANGUAGES:
                codes.append(block.body)
                if not block.body.strip():
                    errors.append(f"the ```python block on line {block.line} is empty")
        answers = _boxed_answers(prose, errors)
        if len(codes) > 1:
            errors.append(
                f"several ```python blocks ({len(codes)}) in one turn; write one block, "
                "then wait for its output"
            )
        if len(answers) > 1:
            errors.append(f"several \\boxed{{}} answers ({len(answers)}); give exactly one")
        if codes and answers:
            errors.append(
                "a turn either runs code or answers with \\boxed{}, not both: run the code, "
                "read its output, then answer in a later turn"
            )
        if not (codes or answers or errors):
            errors.append(
                "no ```python block and no \\boxed{} answer: run code in a ```python block "
                "(fences start a line) or give the final answer as \\boxed{answer}"
            )
        if errors:
            return ParsedAction(errors=tuple(dict.fromkeys(errors)))  # each problem once
        if answers:
            return ParsedAction(answer=answers[0])
        return ParsedAction(tool_calls=(ToolCall(self.tool_name, {self.argument: codes[0]}),))

    def render_results(self, results: Sequence[tuple[ToolCall, str]]) -> list[Message]:
        """One ``tool`` message per call, its content an ```output block."""
        return [
            {"role": "tool", "name": call.name, "content": _fenced("output", text)}
            for call, text in results
        ]


def _fenced(language: str, body: str) -> str:
    """``body`` in a fence longer than any backtick run that starts one of its lines."""
    longest = max((len(m.group(1)) for m in _LEADING_TICKS.finditer(body)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{body}\n{fence}"


def _unclosed(block: _Block) -> str:
    """The error for an unclosed fence, short whatever the fence and its info string."""
    if block.ticks > 8:
        opener, closer = f"fence of {block.ticks} backticks", f"{block.ticks} backticks"
    else:
        info = block.info if len(block.info) <= 20 else block.info[:17] + "..."
        opener, closer = f"{'`' * block.ticks}{info} fence", "`" * block.ticks
    return f"unclosed {opener} opened on line {block.line}: end the block with a line of {closer}"


def _split_fences(text: str) -> tuple[list[_Block], list[str]]:
    """The fenced blocks and the prose between them (one string per stretch of prose)."""
    blocks: list[_Block] = []
    prose: list[str] = []
    stretch: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        opening = _OPEN.fullmatch(lines[i])
        if opening is None:
            stretch.append(lines[i])
            i += 1
            continue
        prose.append("\n".join(stretch))
        stretch = []
        ticks, info = len(opening.group(1)), opening.group(2).strip()
        language = info.split()[0].lower() if info else ""
        end = i + 1
        while end < len(lines):
            closing = _CLOSE.fullmatch(lines[end])
            if closing is not None and len(closing.group(1)) >= ticks:
                break
            end += 1
        body = "\n".join(lines[i + 1 : end])
        blocks.append(_Block(language, info, body, i + 1, ticks, closed=end < len(lines)))
        i = end + 1
    prose.append("\n".join(stretch))
    return blocks, prose


def _boxed_answers(prose: Sequence[str], errors: list[str]) -> list[str]:
    """The stripped contents of every ``\\boxed{...}``; an unclosed one is an error."""
    answers: list[str] = []
    for stretch in prose:
        pos = 0
        while (found := _BOXED.search(stretch, pos)) is not None:
            end = _matching_brace(stretch, found.end())
            if end is None:
                errors.append("unclosed \\boxed{: a closing } is missing")
                break
            answers.append(stretch[found.end() : end].strip())
            pos = end + 1
    return answers


def _matching_brace(text: str, start: int) -> int | None:
    """The index of the ``}`` that closes a ``{`` just before ``start``, or None."""
    depth = 1
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None
