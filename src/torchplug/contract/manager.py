"""The one plugin manager: the process-wide registry and the calls that change it.

Built-in plugins and third-party plugins are found the same way, through the ``torchplug``
entry-point group; a built-in is simply an entry point whose distribution is torchplug itself.
In-house plugins join with one call to [`register`][torchplug.register].

This module is the façade of the plugin machinery, split by job: finding plugins and the
environment controls (``TORCHPLUG_DISABLE_PLUGIN_AUTOLOAD``, ``TORCHPLUG_PLUGINS``,
``TORCHPLUG_BLOCK_PLUGINS``, ``TORCHPLUG_PLUGIN_MODULES``) are `torchplug.contract.discovery`;
checking a plugin against the specification is `torchplug.contract.validation`; the registry of
installed names is `torchplug.contract.registry`. Every name other modules import from here
stays importable from here.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable
from typing import Any

import pluggy

from torchplug.contract import discovery, spec
from torchplug.contract.discovery import (  # noqa: F401 - re-exported: imported from here
    ENTRY_POINT_GROUP,
    MINIMAL_PLUGINS,
    OWN_DISTRIBUTION,
    PLUGIN_MODULES_ENV,
    builtin_modules,
    env_list,
    import_plugin_module,
    load_extension,
    truthy,
)
from torchplug.contract.registry import (  # noqa: F401 - re-exported: imported from here
    ACTION_HOOKS,
    DEFAULT_ANSWERS,
    STRATEGY_HOOKS,
    Registry,
)
from torchplug.contract.validation import (  # noqa: F401 - re-exported: imported from here
    hook_problems,
    hook_signature,
    plugin_label,
    qualified_name,
    register_checked,
)


class PluginManager(pluggy.PluginManager):
    """pluggy's manager, also accepting unmarked ``torchplug_*`` functions (as pytest does)."""

    def __init__(self) -> None:
        super().__init__(spec.PROJECT)
        self.add_hookspecs(spec)
        self.tracing = truthy("TORCHPLUG_TRACE")
        if self.tracing:
            self.add_hookcall_monitoring(self._trace_before, self._trace_after)

    def _label(self, impl: Any) -> str:
        name = self.get_name(impl.plugin) or ""
        return _label(impl.plugin, name)

    def _trace_before(self, hook: str, impls: list[Any], kwargs: dict[str, Any]) -> None:
        """Through pluggy's public hook-call monitoring: which plugins wrap ``hook``."""
        for impl in reversed(impls):  # pluggy calls the last registered first
            if impl.wrapper or impl.hookwrapper:
                sys.stderr.write(f"[torchplug] {hook}: wrapped by {self._label(impl)}\n")

    def _trace_after(
        self, outcome: Any, hook: str, impls: list[Any], kwargs: dict[str, Any]
    ) -> None:
        """Which plugin answered ``hook``, and with what."""
        if outcome.exception is not None:
            sys.stderr.write(f"[torchplug] {hook}: raised {outcome.exception!r}\n")
            return
        result = outcome.get_result()
        if result is None or result == []:
            return
        answering = [self._label(i) for i in reversed(impls) if not (i.wrapper or i.hookwrapper)]
        who = answering[0] if len(answering) == 1 else f"one of {', '.join(answering)}"
        wrappers = [self._label(i) for i in reversed(impls) if i.wrapper or i.hookwrapper]
        # pluggy hands the monitor the outcome of the whole call: what the wrappers returned
        around = f", final result after wrapper(s) {', '.join(wrappers)}" if wrappers else ""
        shown = repr(result)
        shown = shown if len(shown) < 60 else shown[:57] + "..."
        sys.stderr.write(f"[torchplug] {hook}: answered by {who}{around} -> {shown}\n")

    def parse_hookimpl_opts(self, plugin: object, name: str) -> Any:
        if getattr(getattr(plugin, name, None), "torchplug_inherited_default", False):
            return None  # Strategy's delegate, not overridden: torch_distributed answers
        opts = super().parse_hookimpl_opts(plugin, name)
        if (
            opts is None
            and name.startswith("torchplug_")
            and hasattr(spec, name)
            and callable(getattr(plugin, name, None))
        ):
            return {}
        return opts


def _label(plugin: object, name: str) -> str:
    kind = getattr(plugin, "__name__", None) or type(plugin).__name__
    return kind if name.isdigit() or name.startswith("_") else f"{name} ({kind})"


def new_plugin_manager() -> PluginManager:
    """A manager that knows torchplug's hook specification and nothing else."""
    return PluginManager()


#: Guards the registry: building it, register/unregister/block, reset. Reentrant, because an
#: in-house module imported while the registry is built may call torchplug.register().
_lock = threading.RLock()
_registry: Registry | None = None
#: The registry being built (plugins announcing may ask it for a parent's options).
_building: Registry | None = None
_pending_blocks: set[str] = set()


def get_registry() -> Registry:
    """The process-wide registry, built on first use (so ``import torchplug`` loads no plugin)."""
    global _registry, _building
    if _registry is None:
        with _lock:
            if _registry is None:
                pm = new_plugin_manager()
                registry = _building = Registry(pm)
                for name in {*env_list("TORCHPLUG_BLOCK_PLUGINS"), *_pending_blocks}:
                    pm.set_blocked(name)
                    registry.blocked.add(name)
                discovery.discover(registry)
                discovery.check_pending(registry)
                _registry = registry
                _building = None
                # An in-house module may call torchplug.register() on import (same thread:
                # the lock is reentrant).
                for module in env_list(PLUGIN_MODULES_ENV):
                    import_plugin_module(registry, module, strict=False)
    return _registry


def reset_registry(forget_blocks: bool = False) -> None:
    """Forget the registry so the next use rediscovers plugins (for tests and notebooks).

    Names blocked with [`block`][torchplug.block] stay blocked (they apply to the next registry too)
    unless ``forget_blocks``.
    """
    global _registry
    with _lock:
        _registry = None
        if forget_blocks:
            _pending_blocks.clear()


def register(plugin: Any, name: str | None = None) -> str:
    """Register an in-house plugin in one line; its strategies become selectable by name.

    ``plugin`` is a module, a class (instantiated with no arguments) or an object whose functions
    are marked with [`torchplug.hookimpl`][torchplug.hookimpl]. A plugin that implements strategy
    hooks itself (not only registration hooks) joins the active set of every Engine created
    afterwards.

    Args:
        plugin: A module, a class (instantiated with no arguments) or an object with
            ``@torchplug.hookimpl`` functions.
        name: The name to register it under (``None``: one derived from the plugin).

    Returns:
        The name it was registered under (for [`unregister`][torchplug.unregister]).
    """
    registry = get_registry()
    with _lock:
        return registry.add(plugin, name=name)


def unregister(name: str | object) -> None:
    """Remove a plugin registered earlier (by name, or the module/class/object registered),
    and the strategies it announced.

    Args:
        name: The name [`register`][torchplug.register] returned, or the module, class or object
            registered.
    """
    registry = get_registry()
    with _lock:
        registry.remove(name)


def registry_in_use() -> Registry:
    """The registry being built (while plugins announce), else the process-wide one."""
    return _building if _building is not None else get_registry()


def block(names: Iterable[str] | str) -> None:
    """Block plugins by name: never imported if not yet loaded, removed if they were.

    Args:
        names: A plugin name (an entry-point name such as ``"deepspeed"``) or several.
    """
    with _lock:
        for name in [names] if isinstance(names, str) else names:
            _pending_blocks.add(name)
            if _registry is not None:
                _registry.remove(name)
                _registry.pm.set_blocked(name)
                _registry.blocked.add(name)
