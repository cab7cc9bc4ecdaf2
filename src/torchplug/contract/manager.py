"""The one plugin manager: the process-wide registry and the calls that change it
([`register`][torchplug.register], `unregister`, `block`, `reset_registry`).

Finding plugins (built-ins and third parties alike, through the ``torchplug`` entry-point group)
and the environment controls are `torchplug.contract.discovery`; checking a plugin against the
specification is `torchplug.contract.validation`; the registry is `torchplug.contract.registry`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import pluggy

from torchplug.contract import discovery, spec, validation
from torchplug.contract import registry as installed
from torchplug.contract.discovery import import_plugin_module
from torchplug.contract.registry import Registry
from torchplug.util import trace
from torchplug.util.environ import env_list, truthy

#: Names API 1.x code imports from here, answered by the module that holds them now.
_ELSEWHERE = {
    **dict.fromkeys(
        ("ENTRY_POINT_GROUP", "MINIMAL_PLUGINS", "OWN_DISTRIBUTION", "PLUGIN_MODULES_ENV")
        + ("builtin_modules",),
        discovery,
    ),
    **dict.fromkeys(("ACTION_HOOKS", "DEFAULT_ANSWERS", "STRATEGY_HOOKS"), installed),
    **dict.fromkeys(
        ("hook_problems", "hook_signature", "plugin_label", "qualified_name", "register_checked"),
        validation,
    ),
}


def __getattr__(name: str) -> Any:
    if name in _ELSEWHERE:
        return getattr(_ELSEWHERE[name], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class PluginManager(pluggy.PluginManager):
    """pluggy's manager, also accepting unmarked ``torchplug_*`` functions (as pytest does)."""

    def __init__(self) -> None:
        super().__init__(spec.PROJECT)
        self.add_hookspecs(spec)
        self.tracing = truthy("TORCHPLUG_TRACE")
        if self.tracing:
            trace.install(self)

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
                for module in env_list(discovery.PLUGIN_MODULES_ENV):
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
