"""The per-step hook calls (contract/dispatch.py) behave exactly as pluggy's own calls: same order,
same results, same exceptions, for every arrangement of wrappers and implementations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import torchplug.plugin as tpp
from torchplug.contract import dispatch, manager

HOOK = "torchplug_reduce"  # (engine, tensor, op), firstresult


def impl(log: list, name: str, value: Any = None, raises: BaseException | None = None, **opts):
    class Impl:
        @tpp.hookimpl(**opts)
        def torchplug_reduce(self, engine: Any, tensor: Any, op: str) -> Any:
            log.append(f"{name}({tensor},{op})")
            if raises is not None:
                raise raises
            return value

    return Impl()


def subset_impl(log: list, value: Any) -> object:
    class Subset:
        @tpp.hookimpl
        def torchplug_reduce(self, op: str) -> Any:  # a subset of the arguments, reordered
            log.append(f"subset({op})")
            return value

    return Subset()


def wrapper(log: list, name: str, mode: str = "pass", **opts: Any) -> object:
    class Wrapper:
        @tpp.hookimpl(wrapper=True, **opts)
        def torchplug_reduce(self, engine: Any, tensor: Any, op: str) -> Any:
            log.append(f"{name} before")
            if mode == "no-yield":
                return "never"
            try:
                result = yield
            except ValueError as exc:
                log.append(f"{name} caught {exc}")
                if mode == "swallow":
                    return f"{name} replaced"
                raise
            log.append(f"{name} after {result!r}")
            if mode == "twice":
                yield
            if mode == "convert":
                raise KeyError(name)
            return f"{name}[{result}]" if mode == "decorate" else result

    return Wrapper()


def old_style(log: list) -> object:
    class Old:
        @tpp.hookimpl(hookwrapper=True)
        def torchplug_reduce(self, engine: Any, tensor: Any, op: str) -> Any:
            log.append("old before")
            outcome = yield
            log.append(f"old after {outcome.get_result()!r}")

    return Old()


ARRANGEMENTS: dict[str, Callable[[list], list[object]]] = {
    "one": lambda log: [impl(log, "a", 1)],
    "first non-None wins": lambda log: [impl(log, "late", 2), impl(log, "none"), impl(log, "b", 3)],
    "tryfirst and trylast": lambda log: [
        impl(log, "last", 1, trylast=True),
        impl(log, "first", None, tryfirst=True),
        impl(log, "mid", 2),
    ],
    "all None": lambda log: [impl(log, "a"), impl(log, "b")],
    "subset of arguments": lambda log: [subset_impl(log, 5), impl(log, "a", 1)],
    "a wrapper": lambda log: [impl(log, "a", 1), wrapper(log, "w", "decorate")],
    "nested wrappers": lambda log: [
        impl(log, "a", 1),
        wrapper(log, "inner", "decorate"),
        wrapper(log, "outer", "decorate"),
        wrapper(log, "first", "pass", tryfirst=True),
    ],
    "an error passed through wrappers": lambda log: [
        impl(log, "a", raises=ValueError("boom")),
        wrapper(log, "w1"),
        wrapper(log, "w2"),
    ],
    "an error swallowed": lambda log: [
        impl(log, "a", raises=ValueError("boom")),
        wrapper(log, "inner", "swallow"),
        wrapper(log, "outer", "decorate"),
    ],
    "a wrapper converting": lambda log: [impl(log, "a", 1), wrapper(log, "w", "convert")],
    "a wrapper not yielding": lambda log: [impl(log, "a", 1), wrapper(log, "w", "no-yield")],
    "a wrapper yielding twice": lambda log: [
        impl(log, "a", 1),
        wrapper(log, "twice", "twice"),
        wrapper(log, "outer"),
    ],
    "StopIteration from an implementation": lambda log: [
        impl(log, "a", raises=StopIteration("s")),
        wrapper(log, "w"),
    ],
    "KeyboardInterrupt": lambda log: [
        impl(log, "a", raises=KeyboardInterrupt()),
        wrapper(log, "w"),
    ],
    "old-style hookwrapper (pluggy's caller)": lambda log: [impl(log, "a", 1), old_style(log)],
}


def outcome(call: Callable[[], Any], log: list) -> tuple:
    try:
        result: Any = ("returned", call())
    except BaseException as exc:  # noqa: BLE001 - compared below
        # a wrapper yielding twice raises a RuntimeError subclass here (it passes the others)
        kind = "RuntimeError" if isinstance(exc, RuntimeError) else type(exc).__name__
        result = ("raised", kind, str(exc))
    return result, list(log)


@pytest.mark.parametrize("name", sorted(ARRANGEMENTS))
def test_same_as_pluggy(name):
    results = []
    for fast in (False, True):
        log: list = []
        pm = manager.new_plugin_manager()
        for plugin in ARRANGEMENTS[name](log):
            pm.register(plugin)
        if fast:
            call = dispatch.resolve(pm, HOOK)
            results.append(outcome(lambda call=call: call("E", "t", "sum"), log))
        else:
            hook = getattr(pm.hook, HOOK)
            results.append(outcome(lambda hook=hook: hook(engine="E", tensor="t", op="sum"), log))
    assert results[1] == results[0]
    assert results[0][1], "nothing ran"


def test_a_plain_implementation_is_called_directly():
    """One implementation taking every argument, no wrappers: the function itself, no layer."""
    pm = manager.new_plugin_manager()
    plugin = impl([], "a", 1)
    pm.register(plugin)
    assert dispatch.resolve(pm, HOOK) == plugin.torchplug_reduce


def test_monitoring_goes_through_pluggy(monkeypatch, capsys):
    monkeypatch.setenv("TORCHPLUG_TRACE", "1")
    pm = manager.new_plugin_manager()
    pm.register(impl([], "a", 7))
    assert dispatch.resolve(pm, HOOK, pm.tracing)("E", "t", "sum") == 7
    assert "torchplug_reduce: answered by" in capsys.readouterr().err
