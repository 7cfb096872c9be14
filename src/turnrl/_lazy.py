"""Lazy exports of a package: a name imported from its module when first asked for, so
importing the package stays light (no torch until it is needed)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def lazy_attribute(
    package: str, table: Mapping[str, str], namespace: dict[str, Any], name: str
) -> Any:
    """``name`` from its module in ``table`` (cached in the package's ``namespace``), for
    a package's module-level ``__getattr__``; AttributeError for a name not in ``table``."""
    if name not in table:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(table[name]), name)
    namespace[name] = value
    return value
