"""Names imported on first use, for the two public faces (``torchplug``, ``torchplug.plugin``):
importing either stays cheap (no torch, no plugin) until a name that needs them is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(
    module: str, table: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``module``, whose name ``n`` lives in module
    ``table[n]``; a value, once imported, is kept in ``namespace`` (the module's globals)."""

    def getattr_(name: str) -> Any:
        source = table.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace.get("__all__", ()), *table})

    return getattr_, dir_
