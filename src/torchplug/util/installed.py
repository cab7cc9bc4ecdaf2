"""Whether a package is installed, asked without importing it (nor torch): what a strategy or
logger that names ``requires`` is checked against when it is announced and listed."""

from __future__ import annotations

import importlib.util


def missing_package(requires: tuple[str, ...], install_hint: str) -> str | None:
    """The first package of ``requires`` that is not installed, with how to install it (found
    without importing it)."""
    for module in requires:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"package '{module}' not installed — {install_hint or f'pip install {module}'}"
    return None
