"""Names imported on first use, for the two public faces (``torchplug``, ``torchplug.plugin``):
importing either stays cheap (no torch, no plugin) until a name that needs them is used."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any


def exports(
    module: str,
    table: dict[str, str],
    namespace: dict[str, Any],
    moved: Iterable[str] = (),
    moved_to: str = "",
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``module``, whose name ``n`` lives in module
    ``table[n]``; a value, once imported, is kept in ``namespace`` (the module's globals).

    A name in ``moved`` (it belongs to the face ``moved_to`` now) keeps working but is not kept
    in ``namespace``, so that every use of it goes through here and warns: one
    ``DeprecationWarning`` per use, pointing at the caller's line. ``dir()`` leaves it out."""
    moved = frozenset(moved)

    def getattr_(name: str) -> Any:
        source = table.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        if name not in moved:
            namespace[name] = value
        # (sys._getframe: CPython's documented, cheap frame access; inspect costs an import)
        elif not sys._getframe(1).f_code.co_filename.startswith("<frozen importlib"):  # noqa: SLF001
            # (``from torchplug import X`` asks twice: importlib's ``hasattr``, skipped here,
            # then the importing line itself, which is the one named.)
            old = f"{'tp' if module == 'torchplug' else module}.{name}"
            warnings.warn(
                f"{old} is an author name: import it from {moved_to} "
                f"(from {moved_to} import {name}); {old} keeps working through API 1.x",
                DeprecationWarning,
                stacklevel=2,
            )
        return value

    def dir_() -> list[str]:
        return sorted({*namespace.get("__all__", ()), *(n for n in table if n not in moved)})

    return getattr_, dir_
