"""The swe environment's foundation: single-site AST mutations, and a real library (toolz,
its PyPI sdist) whose own tests decide which mutations are bugs."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest

from turnrl.envs.swe import library
from turnrl.envs.swe.library import Checkout, Library, is_module, run_pytest
from turnrl.envs.swe.mutate import Mutation, apply, candidates
from turnrl.errors import ConfigError

SOURCE = '''"""Module docstring: 1 < 2 is not code."""


def clamp(x: int, lo: int = 0, hi: int = 10) -> int:
    """Docstring with a + b."""
    if x < lo:
        return lo
    if x > hi and not x == 99:
        return hi
    return x + 1 - 1


if __name__ == "__main__":
    print(clamp(3) == 3)
'''


def test_candidates_cover_the_operators_and_skip_docs_annotations_and_main() -> None:
    found = candidates(SOURCE)
    kinds = {m.kind for m in found}
    assert kinds == {
        "compare", "arithmetic", "boolean", "negation", "constant", "return", "condition",
    }  # fmt: skip
    conditions = {m.after for m in found if m.kind == "condition"}
    assert conditions == {"not x < lo", "not (x > hi and (not x == 99))"}
    lines = {m.lineno for m in found}
    assert 1 not in lines  # the module docstring
    assert {m.before for m in found if m.lineno == 4} == {"0", "10"}  # defaults, not `int`
    assert not any(m.lineno >= 13 for m in found)  # the __main__ block
    assert all(m.before != m.after for m in found)


def test_a_mutation_changes_one_node_and_its_inverse_restores_the_file() -> None:
    lines = SOURCE.splitlines()
    for m in candidates(SOURCE):
        mutated = apply(SOURCE, m)
        ast.parse(mutated)  # still valid Python
        assert m.lineno == m.end_lineno  # single-line nodes in this source
        line = lines[m.lineno - 1]
        expected = line[: m.col] + m.after + line[m.end_col :]
        assert mutated.splitlines() == [*lines[: m.lineno - 1], expected, *lines[m.lineno :]]
        inverse = Mutation(m.kind, m.lineno, m.col, m.lineno, m.col + len(m.after), m.after,
                           m.before)  # fmt: skip
        assert apply(mutated, inverse) == SOURCE


def test_apply_refuses_a_source_that_does_not_match() -> None:
    mutation = Mutation("compare", 6, 7, 6, 13, "x <= lo", "x < lo")
    with pytest.raises(ValueError, match="does not hold"):
        apply(SOURCE, mutation)


def test_only_library_code_counts_as_a_module() -> None:
    assert is_module("toolz/itertoolz.py")
    assert is_module("src/isodate/isodates.py")
    assert not is_module("toolz/tests/test_itertoolz.py")
    assert not is_module("toolz/tests/__init__.py")
    assert not is_module("toolz/conftest.py")  # a conftest could rewrite every outcome
    assert not is_module("toolz/test_helpers.py")
    assert not is_module("toolz/README.rst")


def test_a_missing_test_interpreter_pytest_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(library, "TEST_PYTHON", "/bin/false")
    with pytest.raises(ConfigError, match="python3-pytest"):
        library.check_test_python()


def _has_test_pytest() -> bool:
    return subprocess.run([library.TEST_PYTHON, "-c", "import pytest"]).returncode == 0


needs_pytest = pytest.mark.skipif(
    not _has_test_pytest() and not os.environ.get("CI"),
    reason="/usr/bin/python3 has no pytest (apt-get install python3-pytest)",
)
TOOLZ = Library("toolz", "1.1.0", package="toolz", tests="toolz/tests")


@needs_pytest
def test_real_bugs_in_toolz_break_its_own_tests(tmp_path: Path) -> None:
    checkout = Checkout(TOOLZ, root=tmp_path)
    tree = checkout.fetch()
    assert (tree / "toolz" / "itertoolz.py").is_file()
    modules = checkout.modules()
    assert "toolz/itertoolz.py" in modules
    assert not any("tests" in m.split("/") for m in modules)
    baseline = checkout.baseline()
    assert len(baseline.passed()) > 150  # toolz 1.1.0: 181 tests, all passing
    mutants = checkout.mutants(2)
    assert len(mutants) == 2
    for mutant in mutants:
        pristine = (tree / mutant.path).read_text()
        buggy = apply(pristine, mutant.mutation)
        work = tmp_path / "check"
        subprocess.run(["cp", "-r", str(tree), str(work)], check=True)
        (work / mutant.path).write_text(buggy)
        failing = list(mutant.fail_to_pass)
        assert all(
            o in ("FAILED", "ERROR") for o in run_pytest(TOOLZ, work, failing).outcomes.values()
        )
        (work / mutant.path).write_text(pristine)  # the inverse edit fixes it
        fixed = run_pytest(TOOLZ, work, failing)
        assert set(fixed.outcomes) == set(failing)
        assert set(fixed.outcomes.values()) == {"PASSED"}
        subprocess.run(["rm", "-rf", str(work)], check=True)
    state = (checkout.dir / "mutants-seed0.json").read_text()
    assert Checkout(TOOLZ, root=tmp_path).mutants(2) == mutants  # from the cache
    assert (checkout.dir / "mutants-seed0.json").read_text() == state  # nothing re-run


@needs_pytest
@pytest.mark.parametrize("name", ["cachetools", "isodate"])
def test_src_layout_libraries_have_real_bugs_too(name: str, tmp_path: Path) -> None:
    from turnrl.envs.swe.env import LIBRARIES

    checkout = Checkout(LIBRARIES[name], root=tmp_path)
    assert len(checkout.baseline().passed()) > 100
    (mutant,) = checkout.mutants(1)
    assert mutant.fail_to_pass
    assert mutant.path.startswith(f"src/{name}/")
