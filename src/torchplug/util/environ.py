"""Reading torchplug's environment controls: comma-separated lists and on/off switches."""

from __future__ import annotations

import os


def env_list(name: str) -> list[str]:
    """The non-empty, stripped items of the comma-separated variable ``name``."""
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def truthy(name: str) -> bool:
    """Whether the variable ``name`` is set to 1, true, yes or on (any case)."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}
