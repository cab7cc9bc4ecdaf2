"""``TORCHPLUG_TRACE=1``: one stderr line per hook call saying who wrapped it and who answered.

A debugging aid built on pluggy's public hook-call monitoring only, so it sits apart from the
plugin manager it watches (`torchplug.contract.manager` installs it when the variable is set).
"""

from __future__ import annotations

import sys
from typing import Any

import pluggy


def label(plugin: object, name: str) -> str:
    """How a trace line names ``plugin`` registered as ``name``."""
    kind = getattr(plugin, "__name__", None) or type(plugin).__name__
    return kind if name.isdigit() or name.startswith("_") else f"{name} ({kind})"


def install(pm: pluggy.PluginManager) -> None:
    """Print, for every hook call through ``pm``, its wrappers and its answer (or exception)."""

    def named(impl: Any) -> str:
        return label(impl.plugin, pm.get_name(impl.plugin) or "")

    def wraps(impl: Any) -> bool:
        return bool(impl.wrapper or impl.hookwrapper)

    def before(hook: str, impls: list[Any], kwargs: dict[str, Any]) -> None:
        for impl in reversed(impls):  # pluggy calls the last registered first
            if wraps(impl):
                sys.stderr.write(f"[torchplug] {hook}: wrapped by {named(impl)}\n")

    def after(outcome: Any, hook: str, impls: list[Any], kwargs: dict[str, Any]) -> None:
        if outcome.exception is not None:
            sys.stderr.write(f"[torchplug] {hook}: raised {outcome.exception!r}\n")
            return
        result = outcome.get_result()
        if result is None or result == []:
            return
        answering = [named(i) for i in reversed(impls) if not wraps(i)]
        who = answering[0] if len(answering) == 1 else f"one of {', '.join(answering)}"
        wrappers = [named(i) for i in reversed(impls) if wraps(i)]
        # pluggy hands the monitor the outcome of the whole call: what the wrappers returned
        around = f", final result after wrapper(s) {', '.join(wrappers)}" if wrappers else ""
        shown = repr(result)
        shown = shown if len(shown) < 60 else shown[:57] + "..."
        sys.stderr.write(f"[torchplug] {hook}: answered by {who}{around} -> {shown}\n")

    pm.add_hookcall_monitoring(before, after)
