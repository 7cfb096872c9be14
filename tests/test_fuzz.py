"""Random and adversarial inputs into every parser, validator and loader of user text
(tests/fuzzing.py's targets, a few hundred inputs per target; 10,000 in the ``slow`` test): parsers
return a ParsedAction, the others raise only their documented errors, with a message.
Then each crash the fuzzer found once, pinned."""

from __future__ import annotations

from pathlib import Path

import pytest

import fuzzing
from turnrl.errors import ConfigError, ToolDefinitionError
from turnrl.jsonl import read_jsonl_lines
from turnrl.tools import Tool
from turnrl.trainer.config import load_config
from turnrl.trainer.sinks import trim_run_files

TARGETS = list(fuzzing.fuzz_targets(Path("unused")))
KNOWN: dict[str, str] = {}
"""Targets with a crash found and not yet fixed; strict, so a fix makes the test fail."""


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN[n], strict=True)) if n in KNOWN else n
     for n in TARGETS],
)  # fmt: skip
def test_no_uncaught_exception(name: str, tmp_path: Path) -> None:
    strategy, check, allowed, _ = fuzzing.fuzz_targets(tmp_path)[name]
    found = fuzzing.fuzz_target(strategy, check, allowed, examples=200, seed=TARGETS.index(name))
    assert found["inputs"] == 200
    assert not found["crashes"], found["crashes"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TARGETS)
def test_no_uncaught_exception_in_ten_thousand_inputs(name: str, tmp_path: Path) -> None:
    """The long run (about 8 minutes for every target, measured on 2 cores): 10,000 inputs each,
    seeded by the target's number."""
    strategy, check, allowed, _ = fuzzing.fuzz_targets(tmp_path)[name]
    found = fuzzing.fuzz_target(strategy, check, allowed, examples=10_000, seed=TARGETS.index(name))
    assert found["inputs"] == 10_000
    assert found["uncaught"] == 0, found["crashes"]
    assert not found["crashes"], found["crashes"]


def test_a_deeply_nested_argument_is_described_not_raised() -> None:
    def echo(items: list[int]) -> str:
        return str(items)

    problem = Tool.from_function(echo).validate({"items": fuzzing.DeepList(), "x": 1})
    assert problem is not None
    assert "nested too deeply" in problem


def test_a_python_object_is_not_taken_for_a_json_object() -> None:
    def echo(options: dict[str, int]) -> str:
        return ""

    problem = Tool.from_function(echo).validate({"options": object()})
    assert problem is not None
    assert "must be an object, got Python object" in problem


@pytest.mark.parametrize("annotation", ["1 +", ""])
def test_an_annotation_that_is_no_expression_is_a_definition_error(annotation: str) -> None:
    def fn(x: int) -> str:
        return ""

    fn.__annotations__ = {"x": annotation}
    with pytest.raises(ToolDefinitionError, match="cannot read the signature"):
        Tool.from_function(fn)


@pytest.mark.parametrize(
    "data", [b'{"a": 1}\n\x96\xcd\n', b"[" * 5000 + b"\n", b"9" * 5000 + b"\n"]
)
def test_a_bad_jsonl_line_is_a_config_error_naming_the_line(data: bytes, tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(data)
    line = data.count(b"\n")
    with pytest.raises(ConfigError, match=f"tasks.jsonl:{line}: not"):
        list(read_jsonl_lines(path))


@pytest.mark.parametrize("value", ["9" * 5000, "[" * 3000])
def test_a_set_value_json_cannot_read_stays_a_string(value: str) -> None:
    with pytest.raises(ConfigError, match="must be int"):
        load_config(None, [f"seed={value}"])


def test_env_options_must_be_a_table() -> None:
    with pytest.raises(ConfigError, match=r"env\.options must be a table"):
        load_config(None, ["env.options=TRUE"])


def test_a_recipe_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.toml"
    recipe.write_bytes(b"steps = 3\n\xc8")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(str(recipe))


def test_a_resume_drops_a_line_nested_too_deeply(tmp_path: Path) -> None:
    rows = b'{"step": 1}\n' + b"[" * 5000 + b"\n"
    (tmp_path / "metrics.jsonl").write_bytes(rows)
    assert trim_run_files(tmp_path, 1) == {"metrics.jsonl": 1}
    assert (tmp_path / "metrics.jsonl").read_bytes() == b'{"step": 1}\n'
