"""Checking a plugin against the hook specification before pluggy sees it: unknown
``torchplug_*`` names and marked functions under no hook's name (with a did-you-mean),
arguments the hook does not pass (shown with `hook_signature`), wrappers that do not yield.
`hook_problems` finds them on a module, object or class without making an instance;
`register_checked` refuses such a plugin naming plugin, hook and signature.
"""

from __future__ import annotations

import functools
import inspect

import pluggy

from torchplug.contract import spec
from torchplug.contract.errors import PluginError
from torchplug.util.signatures import required_args, static_namespace
from torchplug.util.text import did_you_mean, plugin_label, qualified_name  # noqa: F401


def hook_signature(hook: str) -> str:
    """``torchplug_wrap(engine: Engine, model: torch.nn.Module, ...) -> ...`` from the spec."""
    function = getattr(spec, hook)
    sig = inspect.signature(function)
    params = ", ".join(
        f"{p.name}: {p.annotation}" if p.annotation is not inspect.Parameter.empty else p.name
        for p in sig.parameters.values()
    )
    returns = sig.return_annotation
    shown = "" if returns is inspect.Signature.empty else f" -> {returns}"
    return f"{hook}({params}){shown}"


@functools.cache
def _hook_args(hook: str) -> tuple[str, ...]:
    return tuple(required_args(getattr(spec, hook), False))


def hook_problems(plugin: object) -> list[str]:
    """What in ``plugin`` (a module, class or object) does not match the hook specification:
    unknown hook names, marked functions under no hook's name, arguments the hook does not pass,
    wrappers that do not yield. Works on a class without making an instance, so a strategy's
    class is checked when it is announced, long before an Engine creates it."""
    known = sorted(n for n in dir(spec) if n.startswith("torchplug_"))
    problems = []
    namespace = static_namespace(plugin)
    for attr in sorted(dir(plugin)):
        try:
            value = namespace[attr] if attr in namespace else inspect.getattr_static(plugin, attr)
        except AttributeError:
            continue
        function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        marked = getattr(function, f"{spec.PROJECT}_impl", None)
        if not attr.startswith("torchplug_") and marked is None:
            continue
        if not callable(function):
            continue
        if isinstance(marked, dict) and marked.get("specname"):
            attr = marked["specname"]  # @hookimpl(specname=...): implements that hook
        if attr not in known:
            if attr.startswith("torchplug_") or isinstance(marked, dict):
                problems.append(
                    f"'{attr}' is not a torchplug hook.{did_you_mean(attr, known)} "
                    f"Rename it to a hook listed in docs/hooks.md, or remove its @hookimpl "
                    f"marker (and the torchplug_ prefix) if it is a helper"
                )
            continue
        # a method read from the class (getattr_static) still has its self/cls argument
        drop_first = not inspect.ismodule(plugin) and not isinstance(value, staticmethod)
        expected = _hook_args(attr)
        extra = [a for a in required_args(function, drop_first) if a not in expected]
        if extra:
            problems.append(
                f"{attr} takes argument(s) {', '.join(repr(a) for a in extra)}, which the hook "
                f"does not pass. Expected {hook_signature(attr)}; accept any of these arguments "
                f"by name (see docs/hooks.md#{attr})"
            )
        if (
            isinstance(marked, dict)
            and marked.get("wrapper")
            and not inspect.isgeneratorfunction(function)
        ):
            problems.append(
                f"{attr} is marked @hookimpl(wrapper=True) but does not yield; a wrapper runs "
                f"`result = yield` to call the next implementation and returns the result"
            )
    return problems


def register_checked(pm: pluggy.PluginManager, plugin: object, name: str | None = None) -> None:
    """Register ``plugin``; refuse it, naming plugin, hook and the expected signature, when it
    does not match the hook specification."""
    label = plugin_label(plugin, name)
    problems = hook_problems(plugin)
    if problems:
        raise PluginError(
            f"Plugin '{label}' does not match the torchplug hook specification: "
            + "; ".join(problems)
            + "."
        )
    try:
        pm.register(plugin, name=name)  # warns for deprecated hooks (pluggy's warn_on_impl)
    except pluggy.PluginValidationError as exc:
        raise PluginError(
            f"Plugin '{label}' does not follow the torchplug hook specification: {exc}. "
            f"Fix the hook's name or arguments as docs/hooks.md lists them."
        ) from None
