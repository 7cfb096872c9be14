"""Benchmarks measure what a user gets, so they import turnrl the way a user does: only
public names. Public means a name of ``turnrl.__all__`` (``from turnrl import X``,
``turnrl.X``), or of the ``__all__`` of a subpackage the API reference documents (a
``::: turnrl.<package>`` block of docs/api.md, e.g. ``from turnrl.tools import Sandbox``).
A module inside a package (``turnrl.trainer.loop``, ``turnrl.rollout.chat``), a package
the reference leaves out (``turnrl.serving``, ``turnrl.report``) or a name starting with
``_`` is internal. Every benchmarks/*.py is parsed with ``ast`` (no
import), and a failure names the file, the line and the import. There is no exception list:
the component benchmarks that once reached inside the trainer now build what they time
from the public building blocks (``turnrl.trainer``, ``turnrl.distributed``,
``turnrl.models``) or through ``turnrl.train``'s hooks."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
SRC = ROOT / "src" / "turnrl"


def exported(module: Path) -> set[str]:
    """The ``__all__`` of a module's source, read without importing it."""
    for node in ast.parse(module.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return set(ast.literal_eval(node.value))  # type: ignore[union-attr]
    return set()


def documented_packages() -> set[str]:
    """The subpackages docs/api.md documents (``::: turnrl.tools``)."""
    text = (ROOT / "docs" / "api.md").read_text()
    return set(re.findall(r"^::: (turnrl\.\w+)\s*$", text, re.MULTILINE))


def public() -> dict[str, set[str]]:
    """module -> its public names: ``turnrl`` and each documented subpackage."""
    names = {"turnrl": exported(SRC / "__init__.py")}
    for package in documented_packages():
        init = SRC / package.split(".", 1)[1] / "__init__.py"
        names[package] = (
            exported(init) if init.is_file() else exported(init.parent.with_suffix(".py"))
        )
    return names


def turnrl_imports(path: Path) -> list[tuple[int, str]]:
    """(line, ``module.name``) of every turnrl import in ``path``; ``module.*`` for a bare
    ``import turnrl.x.y``; ``turnrl.X`` for an attribute of ``import turnrl``."""
    tree = ast.parse(path.read_text())
    found: list[tuple[int, str]] = []
    bound_to_turnrl: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "turnrl" or node.module.startswith("turnrl."):
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "turnrl":
                    bound_to_turnrl.add(alias.asname or "turnrl")
                elif alias.name.startswith("turnrl."):
                    found.append((node.lineno, f"{alias.name}.*"))
    for node in ast.walk(tree):  # turnrl.X where turnrl is the imported package
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound_to_turnrl
        ):
            found.append((node.lineno, f"turnrl.{node.attr}"))
    return found


def is_public(name: str, names: dict[str, set[str]]) -> bool:
    module, _, attr = name.rpartition(".")
    return module in names and attr in names[module] and not attr.startswith("_")


def test_the_rule_reads_the_public_names() -> None:
    names = public()
    assert {"train", "load_config", "Config", "ToolEnv"} <= names["turnrl"]
    assert is_public("turnrl.train", names)
    assert is_public("turnrl.tools.Sandbox", names)
    assert not is_public("turnrl.trainer.loop.train", names)
    assert not is_public("turnrl.tools.sandbox.Sandbox", names)  # a module inside tools
    assert not is_public("turnrl.distributed.driver._with_adapters", names)


def test_benchmarks_import_only_public_names() -> None:
    names = public()
    wrong = [
        f"benchmarks/{path.name}:{line} imports {name}, which is not public"
        for path in sorted(BENCHMARKS.glob("*.py"))
        for line, name in turnrl_imports(path)
        if not is_public(name, names)
    ]
    assert not wrong, "\n".join(wrong)
