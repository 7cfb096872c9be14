"""Formats beyond hermes: Search-R1 tags, ReAct lines, code fences.

Each one round-trips calls, never raises on arbitrary text, reports precise errors for
malformed turns, and renders results as observation messages a ToolEnv can use.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.envs.tool_env import ToolEnv
from turnrl.errors import ConfigError
from turnrl.formats import (
    FORMATS,
    CodeFormat,
    ReActFormat,
    SearchR1Format,
    error_observation,
    get_format,
)
from turnrl.formats.code import _split_fences
from turnrl.protocols import Format, ParsedAction
from turnrl.rewards import exact_match
from turnrl.tools import Tool, ToolSet
from turnrl.types import Role, Task, ToolCall

SEARCH = SearchR1Format()
REACT = ReActFormat()
CODE = CodeFormat()
FAST = settings(max_examples=100, deadline=None)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
names = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-", min_size=1)
# Text with the characters that break naive parsers: quotes, newlines, braces, backslashes,
# backticks, tag brackets, and non-ASCII.
tricky = st.text() | st.lists(
    st.sampled_from(['"', "'", "\n", "\r\n", "{", "}", "\\", "`", "```", "<", ">", "é", "中", "😀"])
    | st.text(max_size=4)
).map("".join)
_SEARCH_TAG = re.compile(r"</?(search|answer|information)>")


def _episode(fmt: Format, tool: Tool, turns: list[str]) -> list[Any]:
    """Reset a ToolEnv using ``fmt`` and play ``turns``; the opening messages and results."""
    env = ToolEnv(
        ToolSet([tool]), lambda task, answer: exact_match(answer, task.answer), format=fmt
    )
    task = Task(id="t", prompt=({"role": "user", "content": "q"},), answer="42")

    async def play() -> list[Any]:
        out: list[Any] = [await env.reset(task, seed=0)]
        for turn in turns:
            out.append(await env.step(turn))
        return out

    return asyncio.run(play())


def _tool(name: str, argument: str) -> Tool:
    def run(**kwargs: str) -> str:
        return f"ran {kwargs[argument]}"

    parameters = {
        "type": "object",
        "properties": {argument: {"type": "string", "description": f"The {argument}."}},
        "required": [argument],
    }
    return Tool(run, name=name, description=f"The {name} tool.", parameters=parameters)


# (format, a call it can render, the tool that call needs, a final-answer turn for "42")
CASES = [
    (SEARCH, ToolCall("search", {"query": "who"}), _tool("search", "query"), "<answer>42</answer>"),
    (REACT, ToolCall("search", {"query": "who"}), _tool("search", "query"), "Final Answer: 42"),
    (CODE, ToolCall("python", {"code": "print(6 * 7)"}), _tool("python", "code"), "\\boxed{42}"),
]
IDS = ["search_r1", "react", "code"]


# --- all formats ----------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "call", "tool", "answer"), CASES, ids=IDS)
def test_satisfies_protocol_and_registry(
    fmt: Format, call: ToolCall, tool: Tool, answer: str
) -> None:
    assert isinstance(fmt, Format)
    assert fmt.name in FORMATS
    assert type(get_format(fmt.name)) is type(fmt)
    assert not fmt.template_tools  # these grammars live in the prompt, not the template


def test_registry_lists_every_format_in_its_error() -> None:
    with pytest.raises(
        ConfigError, match=r"known formats: hermes, search_r1, react, code, llama3_json, mistral$"
    ):
        get_format("xml")


@pytest.mark.parametrize(("fmt", "call", "tool", "answer"), CASES, ids=IDS)
def test_an_episode_runs_a_call_then_scores_the_answer(
    fmt: Format, call: ToolCall, tool: Tool, answer: str
) -> None:
    opening, called, answered = _episode(fmt, tool, [fmt.render_call(call), answer])
    assert opening[0] == {"role": "system", "content": fmt.system_prompt([tool.schema()])}
    [result] = called.observation
    assert called.info["tool_calls"][0].ok
    assert result == fmt.render_results([(call, f"ran {next(iter(call.arguments.values()))}")])[0]
    assert not called.terminated
    assert answered.terminated
    assert answered.reward == 1.0


@pytest.mark.parametrize(("fmt", "call", "tool", "answer"), CASES, ids=IDS)
def test_a_malformed_turn_is_an_error_observation(
    fmt: Format, call: ToolCall, tool: Tool, answer: str
) -> None:
    _, step = _episode(fmt, tool, ["I am not sure."])
    assert step.info == {"format_error": True}
    assert list(step.observation) == error_observation(fmt.parse("I am not sure.").errors)


@pytest.mark.parametrize(("fmt", "call", "tool", "answer"), CASES, ids=IDS)
@FAST
@given(results=st.lists(st.tuples(names, tricky), max_size=4))
def test_rendered_results_are_observation_messages(
    fmt: Format, call: ToolCall, tool: Tool, answer: str, results: list[tuple[str, str]]
) -> None:
    pairs = [(ToolCall(name, dict(call.arguments)), text) for name, text in results]
    messages = fmt.render_results(pairs)
    assert len(messages) == len(pairs)
    for message, (c, text) in zip(messages, pairs, strict=True):
        assert set(message) == {"role", "name", "content"}
        assert message["role"] in get_args(Role)
        assert message["role"] == "tool"
        assert message["name"] == c.name
        assert isinstance(message["content"], str)
        assert text in message["content"]
        assert json.loads(json.dumps(message)) == message


@pytest.mark.parametrize("fmt", [SEARCH, REACT, CODE], ids=IDS)
def test_no_tools_no_prompt(fmt: Format) -> None:
    assert fmt.system_prompt([]) == ""


# Pieces of every grammar, so random text often comes close to a well-formed turn.
grammar_pieces = st.sampled_from(
    [
        *("<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>"),
        *("Thought:", "Action:", "Action Input:", "Final Answer:", "Observation:", " lookup"),
        *("```python", "```output", "```", "````", "\\boxed{", "\\", "{}", '{"k": 1}'),
        *("{", "}", "[", '"', "\n", "\n", " ", "1", "null"),
    ]
)


@pytest.mark.parametrize("fmt", [SEARCH, REACT, CODE], ids=IDS)
@FAST
@given(text=tricky | st.lists(grammar_pieces | st.text(max_size=3)).map("".join))
def test_parse_never_raises_and_gives_one_outcome(fmt: Format, text: str) -> None:
    parsed = fmt.parse(text)
    assert sum([bool(parsed.tool_calls), parsed.answer is not None, bool(parsed.errors)]) == 1


# --- search_r1 ------------------------------------------------------------------------

queries = tricky.map(str.strip).filter(lambda q: bool(q) and not _SEARCH_TAG.search(q))
untagged = tricky.filter(lambda t: not _SEARCH_TAG.search(t))


def test_search_render_call() -> None:
    assert SEARCH.render_call(ToolCall("search", {"query": "café"})) == "<search>café</search>"


@FAST
@given(queries)
def test_search_round_trips(query: str) -> None:
    call = ToolCall("search", {"query": query})
    assert SEARCH.parse(SEARCH.render_call(call)) == ParsedAction(tool_calls=(call,))


@FAST
@given(st.lists(st.tuples(untagged, queries), min_size=1, max_size=4), untagged)
def test_search_several_per_turn_with_thoughts(pairs: list[tuple[str, str]], tail: str) -> None:
    calls = tuple(ToolCall("search", {"query": q}) for _, q in pairs)
    text = "".join(t + SEARCH.render_call(c) for (t, _), c in zip(pairs, calls, strict=True))
    assert SEARCH.parse(text + tail) == ParsedAction(tool_calls=calls)


@FAST
@given(untagged, untagged)
def test_search_answer_is_the_stripped_tag_body(thought: str, answer: str) -> None:
    parsed = SEARCH.parse(f"<think>{thought}</think>\n<answer>{answer}</answer>")
    assert parsed == ParsedAction(answer=answer.strip())


def test_search_tool_name_is_configurable() -> None:
    fmt = SearchR1Format(tool_name="wiki", argument="q")
    call = ToolCall("wiki", {"q": "x y"})
    assert fmt.parse("<search> x y </search>") == ParsedAction(tool_calls=(call,))
    assert fmt.render_call(call) == "<search>x y</search>"
    assert "About the search engine:\nThe wiki tool.\n- q: The q." in fmt.system_prompt(
        [_tool("wiki", "q").schema()]
    )


@pytest.mark.parametrize(
    "call",
    [
        ToolCall("lookup", {"query": "x"}),
        ToolCall("search", {"query": "x", "n": 2}),
        ToolCall("search", {"query": 3}),
        ToolCall("search", {"query": "a </search> b"}),
    ],
)
def test_search_render_call_refuses_what_the_grammar_cannot_hold(call: ToolCall) -> None:
    with pytest.raises(ValueError, match="search_r1"):
        SEARCH.render_call(call)


def test_search_system_prompt_needs_exactly_the_search_tool() -> None:
    prompt = SEARCH.system_prompt([_tool("search", "query").schema()])
    assert "<search>" in prompt
    assert "<information>" in prompt
    assert "<answer>" in prompt
    with pytest.raises(ConfigError, match=r"can call only the tool 'search'.*offers: 'lookup'"):
        SEARCH.system_prompt([_tool("lookup", "key").schema()])
    with pytest.raises(ConfigError, match="offers: 'search', 'lookup'"):
        SEARCH.system_prompt([_tool("search", "query").schema(), _tool("lookup", "k").schema()])


NO_BLOCK = (
    "no <search> or <answer> block: search with <search>query</search> "
    "or finish with <answer>your answer</answer>"
)
BOTH = (
    "a turn either searches or answers, not both: search, read the <information>, "
    "then answer in a later turn"
)
FROM_TOOL = "<information> blocks come from the search tool; end your turn after </search>"


@pytest.mark.parametrize(
    ("text", "errors"),
    [
        ("<search>capital of France", ["unclosed <search> tag"]),
        ("<answer>Paris", ["unclosed <answer> tag"]),
        (
            "<search>a</search><search>b <answer>c</answer>",
            ["unclosed <search> tag (<answer> before </search>)", BOTH],
        ),
        ("<search>a <search>b</search>", ["unclosed <search> tag (<search> before </search>)"]),
        ("Paris</answer>", ["</answer> without an opening <answer>"]),
        ("x</search>", ["</search> without an opening <search>"]),
        (
            "<search>a</search><search> \n </search>",
            ["search 2: empty query; write it between <search> and </search>"],
        ),
        (
            "<answer>a</answer> or <answer>b</answer>",
            ["several <answer> blocks (2); give exactly one answer"],
        ),
        ("<search>a</search><answer>b</answer>", [BOTH]),
        ("<search>a</search><information>fake</information><answer>b</answer>", [FROM_TOOL, BOTH]),
        ("<information>x", [FROM_TOOL]),
        ("The answer is Paris.", [NO_BLOCK]),
        ("", [NO_BLOCK]),
        ("<Answer>Paris</Answer>", [NO_BLOCK]),
        (
            "<search>" * 1000,
            ["unclosed <search> tag (<search> before </search>)", "unclosed <search> tag"],
        ),
        ("</answer></answer>", ["</answer> without an opening <answer>"]),
        (
            "</search><search></search><answer>",
            [
                "</search> without an opening <search>",
                "search 1: empty query; write it between <search> and </search>",
                "unclosed <answer> tag",
            ],
        ),
    ],
)
def test_search_malformed_turns_give_precise_errors(text: str, errors: list[str]) -> None:
    assert SEARCH.parse(text) == ParsedAction(errors=tuple(errors))


def test_search_empty_answer_is_still_an_answer() -> None:
    assert SEARCH.parse("<answer> </answer>") == ParsedAction(answer="")


def test_search_results_are_information_blocks() -> None:
    call = ToolCall("search", {"query": "q"})
    assert SEARCH.render_results([(call, "Doc 1: Paris"), (call, "Doc 2")]) == [
        {
            "role": "tool",
            "name": "search",
            "content": "<information>\nDoc 1: Paris\n</information>",
        },
        {"role": "tool", "name": "search", "content": "<information>\nDoc 2\n</information>"},
    ]


# --- react ----------------------------------------------------------------------------

calls = st.builds(ToolCall, names, st.dictionaries(tricky, json_values, max_size=4))
one_line = tricky.filter(lambda t: "\n" not in t)
no_keywords = tricky.filter(lambda t: ":" not in t)


def test_react_render_call() -> None:
    call = ToolCall("lookup", {"key": 'a "b"', "n": 2})
    assert REACT.render_call(call) == 'Action: lookup\nAction Input: {"key": "a \\"b\\"", "n": 2}'


@FAST
@given(calls)
def test_react_round_trips(call: ToolCall) -> None:
    assert REACT.parse(REACT.render_call(call)) == ParsedAction(tool_calls=(call,))


@FAST
@given(calls, one_line)
def test_react_round_trips_after_a_thought_and_before_the_stop_string(
    call: ToolCall, thought: str
) -> None:
    text = f"Thought: {thought}\n{REACT.render_call(call)}\nObservation:"
    assert REACT.parse(text) == ParsedAction(tool_calls=(call,))


@FAST
@given(one_line, no_keywords)
def test_react_final_answer_is_the_rest_of_the_turn(thought: str, answer: str) -> None:
    parsed = REACT.parse(f"Thought: {thought}\nFinal Answer: {answer}")
    assert parsed == ParsedAction(answer=answer.strip())


def test_react_keywords_may_be_indented_and_json_may_span_lines() -> None:
    text = 'Thought: go\n  Action:  lookup \n  Action Input: {\n  "key": "a"\n}\n'
    assert REACT.parse(text) == ParsedAction(tool_calls=(ToolCall("lookup", {"key": "a"}),))


@pytest.mark.parametrize("name", ["", "two words", "a\nFinal Answer: x"])
def test_react_render_call_refuses_names_the_grammar_cannot_hold(name: str) -> None:
    with pytest.raises(ValueError, match="react: a tool name must be one word"):
        REACT.render_call(ToolCall(name, {}))


def test_react_system_prompt_lists_tools_and_the_grammar() -> None:
    prompt = REACT.system_prompt([_tool("search", "query").schema(), _tool("calc", "x").schema()])
    assert "search: The search tool.\n  arguments: {" in prompt
    assert "calc: The calc tool." in prompt
    assert "Action: the tool's name, one of [search, calc]" in prompt
    for keyword in ("Thought:", "Action Input:", "Observation:", "Final Answer:"):
        assert keyword in prompt


def test_react_unknown_tool_is_reported_by_the_environment() -> None:
    _, step = _episode(REACT, _tool("search", "query"), ['Action: find\nAction Input: {"q": 1}'])
    assert step.observation == (
        {
            "role": "tool",
            "name": "find",
            "content": "Observation: Error: unknown tool 'find'; available tools: search",
        },
    )


NO_INPUT = (
    "Action 'lookup' has no Action Input: add a line 'Action Input: {...}' with the "
    "arguments as a JSON object ({} for none)"
)
BOTH_REACT = (
    "a turn has either an Action or a Final Answer, not both: act, read the Observation, "
    "then answer in a later turn"
)
OBSERVED = "Observation lines come from the tool, not from you: end your turn after Action Input"
NEITHER = (
    "no Action and no Final Answer: call a tool with 'Action:' and 'Action Input:' lines, "
    "or finish with a 'Final Answer:' line"
)


@pytest.mark.parametrize(
    ("text", "errors"),
    [
        ("Thought: hm\nAction: lookup", [NO_INPUT]),
        ("Action: lookup\nObservation:", [NO_INPUT]),
        (
            "Action: lookup\nAction Input: {'key': 'a'}",
            [
                "Action Input is not valid JSON "
                "(Expecting property name enclosed in double quotes at char 1)"
            ],
        ),
        (
            'Action: lookup\nAction Input: {"key": "a"',
            ["Action Input is not valid JSON (Expecting ',' delimiter at char 11)"],
        ),
        (
            'Action: lookup\nAction Input: {"key": "a"} and then I wait',
            [
                "Action Input has text after its JSON value (at char 13); "
                "end your turn after the Action Input"
            ],
        ),
        (
            "Action: lookup\nAction Input:\n",
            ["Action Input is empty: write the arguments as a JSON object ({} for none)"],
        ),
        (
            'Action: lookup\nAction Input: ["a"]',
            ["Action Input must be a JSON object, got an array"],
        ),
        ("Action: lookup\nAction Input: null", ["Action Input must be a JSON object, got null"]),
        (
            "Action:\nAction Input: {}",
            ["Action names no tool: write the tool's name after 'Action:'"],
        ),
        (
            "Action: lookup key a\nAction Input: {}",
            [
                "Action must be one tool name on its own line, got 'lookup key a'; "
                "put the arguments on an 'Action Input:' line"
            ],
        ),
        ("Action Input: {}", ["Action Input without an Action line naming the tool"]),
        ("Action Input: {}\nAction: lookup", ["Action Input must come after the Action line"]),
        ("Action: lookup\nAction Input: {}\nFinal Answer: 4", [BOTH_REACT]),
        (
            "Action: lookup\nAction Input: {}\nObservation: 4\nFinal Answer: 4",
            [OBSERVED, BOTH_REACT],
        ),
        ('Action: lookup\nAction Input: {}\nObservation: {"v": 1}', [OBSERVED]),
        ("Observation:\nAction: lookup\nAction Input: {}", [OBSERVED]),
        (
            "Action: a\nAction Input: {}\nAction: b\nAction Input: {}",
            [
                "several Actions (2) in one turn; write one Action and its Action Input, "
                "then wait for the Observation",
                "several Action Input lines (2); write one per Action",
            ],
        ),
        ("Final Answer: 3\nFinal Answer: 4", ["several Final Answer lines (2); give exactly one"]),
        ("The answer is 4.", [NEITHER]),
        ("Thought: let me think", [NEITHER]),
        ("action: lookup\naction input: {}", [NEITHER]),
        (
            "Action: lookup\nAction Input: " + "[" * 100_000,
            ["Action Input is not valid JSON (RecursionError)"],
        ),
        ("", [NEITHER]),
    ],
)
def test_react_malformed_turns_give_precise_errors(text: str, errors: list[str]) -> None:
    assert REACT.parse(text) == ParsedAction(errors=tuple(errors))


def test_react_results_are_observations() -> None:
    a, b = ToolCall("a", {}), ToolCall("b", {"x": 1})
    assert REACT.render_results([(a, "1"), (b, "Error: boom")]) == [
        {"role": "tool", "name": "a", "content": "Observation: 1"},
        {"role": "tool", "name": "b", "content": "Observation: Error: boom"},
    ]


# --- code -----------------------------------------------------------------------------

code_fragments = st.sampled_from(
    ["```", "````", "```output", "```python", "\n", "\\boxed{", "{", "}", "print(", '"', " "]
)
codes = (tricky | st.lists(code_fragments | st.text(max_size=3)).map("".join)).filter(
    lambda c: bool(c.strip())
)
plain_prose = st.text().filter(lambda t: "`" not in t and "\\" not in t)
latex = st.recursive(
    st.text(st.characters(blacklist_characters="{}\\"), max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3).map(lambda parts: "{" + "".join(parts) + "}")
        | st.lists(inner, min_size=2, max_size=3).map("\\frac".join)
    ),
    max_leaves=8,
)


def test_code_render_call() -> None:
    call = ToolCall("python", {"code": 'print("{é}")'})
    assert CODE.render_call(call) == '```python\nprint("{é}")\n```'


@FAST
@given(codes)
def test_code_round_trips(code: str) -> None:
    call = ToolCall("python", {"code": code})
    assert CODE.parse(CODE.render_call(call)) == ParsedAction(tool_calls=(call,))


@FAST
@given(codes, plain_prose)
def test_code_round_trips_after_prose_and_before_the_stop_string(code: str, prose: str) -> None:
    call = ToolCall("python", {"code": code})
    text = f"{prose}\n{CODE.render_call(call)}\n```output"
    assert CODE.parse(text) == ParsedAction(tool_calls=(call,))


def test_code_with_a_fence_line_inside_gets_a_longer_fence() -> None:
    call = ToolCall("python", {"code": 's = """\n```\n"""'})
    assert CODE.render_call(call) == '````python\ns = """\n```\n"""\n````'
    assert CODE.parse(CODE.render_call(call)).tool_calls == (call,)


@FAST
@given(latex, plain_prose)
def test_code_boxed_answer_keeps_nested_braces(answer: str, prose: str) -> None:
    parsed = CODE.parse(f"{prose}\nSo the answer is \\boxed{{{answer}}}.")
    assert parsed == ParsedAction(answer=answer.strip())


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed { 7 }", "7"),
        ("a \\\\ \\boxed{x^{2}}", "x^{2}"),
        ("\\boxed{}", ""),
        ("```python\nprint(r'\\boxed{1}')\n```\nIt printed 1, so \\boxed{2}", None),
        ("```text\n\\boxed{1}\n```\nSo \\boxed{2}", "2"),
        ("```py\nprint(1)\n```", None),
    ],
)
def test_code_boxed_answers(text: str, answer: str | None) -> None:
    parsed = CODE.parse(text)
    if answer is None:
        assert parsed.answer is None
    else:
        assert parsed == ParsedAction(answer=answer)


@pytest.mark.parametrize("opener", ["```py", "```python3", "  ```Python", "\t````python  x=1"])
def test_code_accepts_python_fence_variants(opener: str) -> None:
    parsed = CODE.parse(f"Let me check.\n{opener}\nprint(1)\n  {opener.strip()[:3]}`\n")
    assert parsed == ParsedAction(tool_calls=(ToolCall("python", {"code": "print(1)"}),))


def test_code_tilde_fences_are_not_fences() -> None:
    assert CODE.parse("~~~python\nprint(1)\n~~~").errors == (NO_CODE,)


def test_code_tool_name_is_configurable() -> None:
    fmt = CodeFormat(tool_name="run", argument="source")
    assert fmt.parse("```python\n1\n```") == ParsedAction(
        tool_calls=(ToolCall("run", {"source": "1"}),)
    )
    with pytest.raises(ConfigError, match="can call only the tool 'run'"):
        fmt.system_prompt([_tool("python", "code").schema()])


@pytest.mark.parametrize(
    "call",
    [
        ToolCall("shell", {"code": "ls"}),
        ToolCall("python", {"src": "1"}),
        ToolCall("python", {"code": 1}),
    ],
)
def test_code_render_call_refuses_what_the_grammar_cannot_hold(call: ToolCall) -> None:
    with pytest.raises(ValueError, match="code"):
        CODE.render_call(call)


def test_code_system_prompt() -> None:
    prompt = CODE.system_prompt([_tool("python", "code").schema()])
    assert "```python" in prompt
    assert "```output" in prompt
    assert "\\boxed{" in prompt
    assert "About the interpreter:\nThe python tool.\n- code: The code.\n\n" in prompt


NO_CODE = (
    "no ```python block and no \\boxed{} answer: run code in a ```python block "
    "(fences start a line) or give the final answer as \\boxed{answer}"
)
OUTPUT = "```output blocks come from the tool: end your turn after ```python"
BOTH_CODE = (
    "a turn either runs code or answers with \\boxed{}, not both: run the code, read its "
    "output, then answer in a later turn"
)


@pytest.mark.parametrize(
    ("text", "errors"),
    [
        (
            "Let me check.\n```python\nprint(1)\n",
            ["unclosed ```python fence opened on line 2: end the block with a line of ```"],
        ),
        (
            "````python\nprint(1)\n```",
            ["unclosed ````python fence opened on line 1: end the block with a line of ````"],
        ),
        ("```\nnotes", ["unclosed ``` fence opened on line 1: end the block with a line of ```"]),
        (
            "```" + "y" * 30,
            [
                "unclosed ```"
                + "y" * 17
                + "... fence opened on line 1: end the block with a line of ```"
            ],
        ),
        (
            "`" * 1000 + "x" * 1000,
            [
                "unclosed fence of 1000 backticks opened on line 1: end the block with a line "
                "of 1000 backticks"
            ],
        ),
        (
            "```python\na = 1\n```\n```python\nprint(a)\n```",
            ["several ```python blocks (2) in one turn; write one block, then wait for its output"],
        ),
        ("```python\n  \n```", ["the ```python block on line 1 is empty"]),
        ("\\boxed{1} or \\boxed{2}", ["several \\boxed{} answers (2); give exactly one"]),
        ("So \\boxed{\\frac{1}{2}", ["unclosed \\boxed{: a closing } is missing"]),
        ("\\boxed{1\\}", ["unclosed \\boxed{: a closing } is missing"]),
        ("```python\nprint(2)\n```\nso \\boxed{2}", [BOTH_CODE]),
        ("```python\nprint(2)\n```\n```output\n2\n```", [OUTPUT]),
        ("```python\nprint(2)\n```\n```output\n2", [OUTPUT]),
        ("```output\n```\n\\boxed{2}", [OUTPUT]),
        ("The answer is 2.", [NO_CODE]),
        ("Run: ```python print(2)```", [NO_CODE]),
        ("```\nprint(2)\n```", [NO_CODE]),
        ("", [NO_CODE]),
    ],
)
def test_code_malformed_turns_give_precise_errors(text: str, errors: list[str]) -> None:
    assert CODE.parse(text) == ParsedAction(errors=tuple(errors))


@FAST
@given(tricky)
def test_code_results_are_output_blocks_holding_the_text_exactly(text: str) -> None:
    [message] = CODE.render_results([(ToolCall("python", {"code": "x"}), text)])
    blocks, prose = _split_fences(message["content"])
    assert [(b.language, b.body, b.closed) for b in blocks] == [("output", text, True)]
    assert prose == ["", ""]


def test_code_results() -> None:
    assert CODE.render_results([(ToolCall("python", {"code": "print(2)"}), "2")]) == [
        {"role": "tool", "name": "python", "content": "```output\n2\n```"}
    ]
