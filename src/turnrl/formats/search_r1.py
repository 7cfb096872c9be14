"""The Search-R1 tag format: ``<search>query</search>`` -> ``<information>...</information>``.

Search-R1 (Jin et al., 2025, arXiv:2503.09516, "Search-R1: Training LLMs to Reason and
Leverage Search Engines with Reinforcement Learning") trains a model to interleave
reasoning with search: the model writes a query between ``<search>`` tags, the retriever's
passages come back between ``<information>`` tags, and the final answer is written between
``<answer>`` tags (the reward is an exact match on it).

Grammar of one model turn (text outside the blocks, e.g. ``<think>`` reasoning, is free):

- one or more ``<search>query</search>`` blocks: each is a call to the search tool
  (``tool_name``, default ``search``) with ``{argument: query}`` (default ``query``); the
  query is stripped of surrounding whitespace. Several searches in one turn run in order
  and each gets its own ``<information>`` block back;
- or exactly one ``<answer>text</answer>``: the final answer (its stripped text).

Errors (the whole turn is rejected, each problem listed once): an unclosed tag, a closing tag
without its opening tag, a tag inside another block, an empty query, several answers,
searches and an answer in the same turn (the answer would be written before the results
are read, so the turn is refused rather than half-run), ``<information>`` written by the
model (it comes from the tool), and a turn with neither a search nor an answer.

Tags are exact and lower-case. Whether a tool exists is the environment's business; this
format only calls the one tool it is configured with, and its ``system_prompt`` refuses a
tool list that holds any other. ``stop_strings`` end generation after a search, as the
original rollout does, so the model cannot invent the results.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from turnrl.formats._single_tool import describe_tool, the_single_tool
from turnrl.protocols import ParsedAction, ToolSchema
from turnrl.types import Message, ToolCall

_TAG = re.compile(r"<(/?)(search|answer|information)>")


class SearchR1Format:
    """Search-R1 tags; several searches per turn, or one answer."""

    name: str = "search_r1"
    template_tools: bool = False
    stop_strings: tuple[str, ...] = ("</search>",)

    def __init__(self, *, tool_name: str = "search", argument: str = "query") -> None:
        """``tool_name``: the tool a ``<search>`` block calls; ``argument``: its argument
        that receives the query text."""
        self.tool_name = tool_name
        self.argument = argument

    def system_prompt(self, tools: Sequence[ToolSchema]) -> str:
        if not tools:
            return ""
        about = describe_tool(the_single_tool(tools, self.tool_name, self.name))
        about = f"About the search engine:\n{about}\n\n" if about else ""
        return (
            "Think step by step. You can look things up with a search engine: write a query "
            "between <search> and </search>, then stop. The results come back between "
            "<information> and </information>. Search as many times as you need.\n\n"
            f"{about}"
            "When you are sure of the answer, write it between <answer> and </answer> in a "
            "turn without any search, for example: <answer>Marie Curie</answer>"
        )

    def render_call(self, call: ToolCall) -> str:
        """``<search>query</search>``. Raises ValueError for a call this format cannot
        express (another tool, other arguments, or a query holding a tag)."""
        query = call.arguments.get(self.argument)
        if call.name != self.tool_name or set(call.arguments) != {self.argument}:
            raise ValueError(
                f"{self.name} can only render {self.tool_name}({self.argument}=...), got {call}"
            )
        if not isinstance(query, str) or _TAG.search(query):
            raise ValueError(f"{self.name}: the query must be a string without tags: {query!r}")
        return f"<search>{query}</search>"

    def parse(self, text: str) -> ParsedAction:
        """The searches, or the answer, or every error found. Never raises."""
        queries: list[str] = []
        answers: list[str] = []
        errors: list[str] = []
        tags = list(_TAG.finditer(text))
        i = 0
        while i < len(tags):
            tag = tags[i]
            closing, kind = tag.group(1) == "/", tag.group(2)
            i += 1
            if kind == "information":
                errors.append(
                    "<information> blocks come from the search tool; end your turn after </search>"
                )
                continue
            if closing:
                errors.append(f"</{kind}> without an opening <{kind}>")
                continue
            after = tags[i] if i < len(tags) else None
            if after is None:
                errors.append(f"unclosed <{kind}> tag")
                continue
            if after.group(1) != "/" or after.group(2) != kind:
                errors.append(f"unclosed <{kind}> tag ({after.group(0)} before </{kind}>)")
                continue
            i += 1
            body = text[tag.end() : after.start()].strip()
            if kind == "answer":
                answers.append(body)
                continue
            queries.append(body)
            if not body:
                errors.append(
                    f"search {len(queries)}: empty query; write it between <search> and </search>"
                )
        if len(answers) > 1:
            errors.append(f"several <answer> blocks ({len(answers)}); give exactly one answer")
        if queries and answers:
            errors.append(
                "a turn either searches or answers, not both: search, read the <information>, "
                "then answer in a later turn"
            )
        if not (queries or answers or errors):
            errors.append(
                "no <search> or <answer> block: search with <search>query</search> "
                "or finish with <answer>your answer</answer>"
            )
        if errors:
            return ParsedAction(errors=tuple(dict.fromkeys(errors)))  # each problem once
        if answers:
            return ParsedAction(answer=answers[0])
        return ParsedAction(
            tool_calls=tuple(ToolCall(self.tool_name, {self.argument: q}) for q in queries)
        )

    def render_results(self, results: Sequence[tuple[ToolCall, str]]) -> list[Message]:
        """One ``tool`` message per search, its content an ``<information>`` block."""
        return [
            {"role": "tool", "name": call.name, "content": f"<information>\n{text}\n</information>"}
            for call, text in results
        ]
