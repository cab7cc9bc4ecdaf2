"""Reading a function's arguments and an object's attributes without running them, fast.

Why: every process checks every plugin's hooks against the specification when it loads them
(`torchplug.contract.validation`), before its first step, and ``inspect.signature`` and
``inspect.getattr_static`` per attribute cost about 20 ms there; the launch benchmark row
counts that time twice (the launcher and each rank)."""

from __future__ import annotations

import inspect
import types
from typing import Any


def required_args(function: Any, drop_first: bool) -> list[str]:
    """The arguments a caller must pass by name: those without defaults, as pluggy reads them
    (``drop_first``: without the first, a method's ``self`` read from its class). A plain
    function is read from its code object, as ``inspect.signature`` reads it, without building
    a signature; anything else (a wrapped function, a builtin, a callable object) through
    ``inspect.signature``."""
    code = getattr(function, "__code__", None)
    plain = type(function) is types.FunctionType and not (
        hasattr(function, "__wrapped__") or hasattr(function, "__signature__")
    )
    if plain and code is not None and not (drop_first and code.co_argcount == 0):
        positional = code.co_argcount
        names = code.co_varnames[: positional + code.co_kwonlyargcount]
        required = positional - len(function.__defaults__ or ())
        keywords = function.__kwdefaults__ or {}
        first = 1 if drop_first else 0
        return [
            n
            for i, n in enumerate(names)
            if i >= first and (i < required or (i >= positional and n not in keywords))
        ]
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return []
    if drop_first and params:
        params = params[1:]
    return [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def static_namespace(plugin: object) -> dict[str, Any]:
    """Name -> value as ``inspect.getattr_static`` reads each, in one walk: the module's
    namespace, or the class's MRO (and an object's own ``__dict__``)."""
    if inspect.ismodule(plugin):
        return dict(vars(plugin))
    found: dict[str, Any] = {}
    for base in reversed(inspect.getmro(plugin if inspect.isclass(plugin) else type(plugin))):
        found.update(vars(base))
    if not inspect.isclass(plugin):
        found.update(getattr(plugin, "__dict__", {}))
    return found
