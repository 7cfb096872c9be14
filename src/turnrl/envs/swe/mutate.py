"""Single-site bugs for the ``swe`` environment, made by AST mutation.

``candidates(source)`` lists every place in a module where one small, plausible edit
changes behaviour: a comparison flipped or loosened (``<`` -> ``<=``, ``==`` -> ``!=``), an
arithmetic operator swapped (``+`` -> ``-``, ``*`` -> ``//``), a boolean connective swapped
(``and`` -> ``or``), an integer constant moved by one, a ``not`` dropped, an ``if``/``while``
condition negated, a returned value replaced by ``None``. ``apply(source, mutation)`` rewrites only that node's text (the rest
of the file keeps its formatting), so the bug is one hunk a model can find, and the
inverse edit restores the file exactly.

Mutations in docstrings, type annotations and ``if __name__ == "__main__"`` blocks are
skipped: they rarely change what the tests see.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

_COMPARE_SWAPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
    ast.In: ast.NotIn, ast.NotIn: ast.In,
}  # fmt: skip
_BINARY_SWAPS: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
}  # fmt: skip


@dataclass(frozen=True)
class Mutation:
    """One single-site edit: the node's position (1-based lines, 0-based columns as in
    ``ast``), its text before and after, and the operator's name."""

    kind: str
    lineno: int
    col: int
    end_lineno: int
    end_col: int
    before: str
    after: str

    def describe(self) -> str:
        return f"{self.kind} at line {self.lineno}: {self.before!r} -> {self.after!r}"


def candidates(source: str) -> list[Mutation]:
    """Every single-site mutation of ``source``, in source order."""
    tree = ast.parse(source)
    skip = _skipped_nodes(tree)
    conditions = {
        id(n.test) for n in ast.walk(tree) if isinstance(n, (ast.If, ast.While, ast.IfExp))
    }
    out: list[Mutation] = []
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, (ast.expr, ast.stmt)):
            continue
        replacements = _replacements(node)
        if id(node) in conditions and isinstance(node, ast.expr) and not _is_not(node):
            replacements.append(("condition", ast.UnaryOp(ast.Not(), node)))
        for kind, replacement in replacements:
            before = ast.get_source_segment(source, node)
            if before is None:
                continue
            after = ast.unparse(replacement)
            if after == before:
                continue
            out.append(
                Mutation(
                    kind,
                    node.lineno,
                    node.col_offset,
                    node.end_lineno or node.lineno,
                    node.end_col_offset or 0,
                    before,
                    after,
                )
            )
    return sorted(out, key=lambda m: (m.lineno, m.col, m.kind))


def apply(source: str, mutation: Mutation) -> str:
    """``source`` with ``mutation``'s node text replaced; refuses if the text differs."""
    lines = source.splitlines(keepends=True)
    start = _offset(lines, mutation.lineno, mutation.col)
    end = _offset(lines, mutation.end_lineno, mutation.end_col)
    if source[start:end] != mutation.before:
        raise ValueError(f"the source does not hold {mutation.before!r} where expected")
    return source[:start] + mutation.after + source[end:]


def _offset(lines: list[str], lineno: int, col: int) -> int:
    """Character offset of (line, column); ``ast`` columns count UTF-8 bytes."""
    before = sum(len(line) for line in lines[: lineno - 1])
    text = lines[lineno - 1].encode()[:col].decode(errors="ignore") if lines else ""
    return before + len(text)


def _replacements(node: ast.AST) -> list[tuple[str, ast.AST]]:
    out: list[tuple[str, ast.AST]] = []
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        swap = _COMPARE_SWAPS.get(type(node.ops[0]))
        if swap is not None:
            out.append(("compare", ast.Compare(node.left, [swap()], node.comparators)))
    elif isinstance(node, ast.BinOp):
        swap_op = _BINARY_SWAPS.get(type(node.op))
        if swap_op is not None and not _is_string_format(node):
            out.append(("arithmetic", ast.BinOp(node.left, swap_op(), node.right)))
    elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        out.append(("boolean", ast.BoolOp(other, node.values)))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        out.append(("negation", node.operand))
    elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 16:
        out.append(("constant", ast.Constant(node.value + 1)))
    elif (
        isinstance(node, ast.Return)
        and node.value is not None
        and not (isinstance(node.value, ast.Constant) and node.value.value is None)
    ):
        out.append(("return", ast.Return(ast.Constant(None))))
    return out


def _is_not(node: ast.AST) -> bool:
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)


def _is_string_format(node: ast.BinOp) -> bool:
    return isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant)


def _skipped_nodes(tree: ast.Module) -> set[int]:
    """Nodes inside docstrings, annotations and ``__main__`` blocks."""
    skip: set[int] = set()

    def drop(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            drop(node.returns)
            for arg in (*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs):
                drop(arg.annotation)
        elif isinstance(node, ast.AnnAssign):
            drop(node.annotation)
        elif isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            drop(node)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                drop(body[0])
    return skip
