"""Per-step hook calls without pluggy's per-call bookkeeping.

pluggy's ``HookCaller`` checks the call's arguments and copies its list of implementations on
every call, then runs them through a general loop: around a small ``loss.backward()`` that came to
+9 to +13 µs per Engine call on this project's CI machine (``python -m benchmarks --only
dispatch``). An Engine's plugins are fixed when it is built, so its per-step action hooks are
resolved once into plain functions that run the same implementations, in the same order, with the
semantics of pluggy's ``_multicall``: new-style wrappers (``wrapper=True``) outermost first, each
receiving the result or the exception of what it wraps and returning the final result; inside
them the implementations, stopping at the first non-None result (``firstresult``).

What this does not reproduce goes through pluggy's own caller: old-style ``hookwrapper``
plugins, implementations with keyword-only arguments, hooks that are not ``firstresult``, and
hook-call monitoring (``TORCHPLUG_TRACE``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pluggy


def resolve(pm: pluggy.PluginManager, name: str, monitored: bool = False) -> Callable[..., Any]:
    """A function calling hook ``name`` of ``pm`` with the hook's arguments *positionally*, in
    the order of its specification, for a plugin set that no longer changes."""
    caller = getattr(pm.hook, name)
    spec = caller.spec
    if spec is None:
        raise ValueError(f"{name} is not a hook of this plugin manager")
    every = tuple(spec.argnames)
    impls = caller.get_hookimpls()
    if (
        monitored
        or not spec.opts.get("firstresult", False)
        or not impls
        or any(i.hookwrapper or i.kwargnames for i in impls)
    ):
        return lambda *args: caller(**dict(zip(every, args, strict=True)))
    order = list(reversed(impls))  # pluggy's call order: wrappers first, then the rest
    wrappers = [_bind(i.function, tuple(i.argnames), every) for i in order if i.wrapper]
    plain = [_bind(i.function, tuple(i.argnames), every) for i in order if not i.wrapper]
    call = plain[0] if len(plain) == 1 else _first_result(plain)
    for wrapper in reversed(wrappers):  # the innermost first
        call = _wrapped(wrapper, call)
    return call


def _bind(function: Callable[..., Any], argnames: tuple[str, ...], every: tuple[str, ...]) -> Any:
    """``function`` called with the hook's arguments in spec order: as it is when it takes all
    of them in that order (the usual case, and the cheapest), else with the ones it names."""
    if argnames == every:
        return function
    positions = [every.index(a) for a in argnames]
    return lambda *args: function(*[args[i] for i in positions])


def _first_result(plain: Sequence[Callable[..., Any]]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        for function in plain:
            result = function(*args)
            if result is not None:
                return result
        return None

    return call


class _WrapFail(RuntimeError):
    """A wrapper that yields twice: raised past the other wrappers, as pluggy does."""


def _wrapped(wrapper: Callable[..., Any], inner: Callable[..., Any]) -> Callable[..., Any]:
    """``inner`` run inside one new-style wrapper: the wrapper's code before its ``yield`` runs
    first, then it receives ``inner``'s result (or exception) and returns the final one."""

    def call(*args: Any) -> Any:
        __tracebackhide__ = True
        generator = wrapper(*args)
        try:
            next(generator)
        except StopIteration:
            _wrapfail(generator, "did not yield")
        passed_on = None
        try:
            result = inner(*args)
        except _WrapFail:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the wrapper, as pluggy does
            try:
                generator.throw(exc)
            except StopIteration as stop:
                return stop.value
            except RuntimeError as error:
                if not (isinstance(exc, StopIteration) and error.__cause__ is exc):
                    raise
                generator.close()  # pluggy #544: a StopIteration goes on unchanged
                passed_on = exc
        else:
            try:
                generator.send(result)
            except StopIteration as stop:
                return stop.value
        if passed_on is not None:
            raise passed_on
        generator.close()
        _wrapfail(generator, "has second yield", _WrapFail)

    return call


def _wrapfail(generator: Any, message: str, error: type[RuntimeError] = RuntimeError) -> None:
    code = generator.gi_code
    raise error(
        f"wrap_controller at {code.co_name!r} {code.co_filename}:{code.co_firstlineno} {message}"
    )
