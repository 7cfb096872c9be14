"""Benchmarks measure what a user gets, so they import turnrl the way a user does: only
public names. Public means a name of ``turnrl.__all__`` (``from turnrl import X``,
``turnrl.X``), or of the ``__all__`` of a subpackage the API reference documents (a
``::: turnrl.<package>`` block of docs/api.md, e.g. ``from turnrl.tools import Sandbox``).
A module inside a package (``turnrl.trainer.loop``, ``turnrl.rollout.chat``), a package
the reference leaves out (``turnrl.serving``, ``turnrl.report``) or a name starting with
``_`` is internal. Every benchmarks/*.py is parsed with ``ast`` (no
import), and a failure names the file, the line and the import.

``INTERNAL`` lists the imports of internals that component benchmarks still make (they
time one part inside the trainer); it may only shrink: an entry no benchmark needs any
more fails too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
SRC = ROOT / "src" / "turnrl"

INTERNAL: dict[str, set[str]] = {
    "bf16_gradients.py": {
        "turnrl.trainer.loop.train",
        "turnrl.trainer.startup.LearnerSpec",
        "turnrl.trainer.startup.in_process_learner",
    },
    "copying.py": {"turnrl.envs.search_qa.build_world", "turnrl.models.pretrain.made_up_word"},
    "learner.py": {"turnrl.trainer.forward"},
    "scale.py": {
        "turnrl.distributed.driver.GroupLearner",
        "turnrl.distributed.driver._with_adapters",
        "turnrl.distributed.rank.decoder_layers",
        "turnrl.distributed.ranks_to_workers.FromRanks",
        "turnrl.distributed.rollout_workers.RayRolloutWorkers",
        "turnrl.trainer.config.resolved",
        "turnrl.trainer.startup.WorkersSpec",
    },
}
"""Component benchmarks that reach inside the trainer, which no public name does:
bf16_gradients swaps the learner's class inside a run (its private ``_gradient``), through the
loop's ``make_learner`` hook; copying measures the tiny model on the word generators of its
own echo tuning (``made_up_word``) and of search_qa's worlds (``build_world``); learner
forces a layout through ``forward.MIN_SHARED_PREFIX`` (a tuning constant) and counts the
cells ``forward.pack_rows`` packs; scale times the distributed driver's weight-sync paths
(the rollout workers, the learner ranks' broadcast, LoRA adapters on the ranks), which a run
chooses by its settings and no public name builds alone. The other benchmarks import
public names only."""


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
    wrong, still_needed = [], {file: set() for file in INTERNAL}
    for path in sorted(BENCHMARKS.glob("*.py")):
        for line, name in turnrl_imports(path):
            if is_public(name, names):
                continue
            if name in INTERNAL.get(path.name, set()):
                still_needed[path.name].add(name)
                continue
            wrong.append(f"benchmarks/{path.name}:{line} imports {name}, which is not public")
    assert not wrong, "\n".join(wrong)
    stale = [f"{file}: {sorted(INTERNAL[file] - used)}" for file, used in still_needed.items()
             if INTERNAL[file] - used]  # fmt: skip
    assert not stale, "INTERNAL lists imports no benchmark makes any more: " + "; ".join(stale)
