"""The one plugin manager: discovery, registration, and the registry of strategy names.

Built-in plugins and third-party plugins are found the same way, through the ``torchplug``
entry-point group; a built-in is simply an entry point whose distribution is torchplug itself.
In-house plugins join with one call to :func:`register`.

Environment controls, read when the registry is first built:

``TORCHPLUG_DISABLE_PLUGIN_AUTOLOAD=1``
    load torchplug's own plugins only.
``TORCHPLUG_PLUGINS=a,b``
    allow-list of third-party entry-point plugins to load (built-ins always load).
``TORCHPLUG_BLOCK_PLUGINS=a,b``
    never import these plugins (built-ins included), like pytest's ``-p no:name``.
``TORCHPLUG_PLUGIN_MODULES=a,b``
    in-house plugin modules to import and register (``torchplug launch --plugin`` sets it).
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from torchplug.core import spec
from torchplug.core.errors import ConfigurationError, PluginError, did_you_mean
from torchplug.core.registry import LoggerInfo, PrecisionInfo, StrategyInfo

ENTRY_POINT_GROUP = "torchplug"
#: In-house plugin modules to import into every registry (``torchplug launch --plugin``).
PLUGIN_MODULES_ENV = "TORCHPLUG_PLUGIN_MODULES"
OWN_DISTRIBUTION = "torchplug"

#: torchplug's own plugins, registered from this tuple first (as tox does), then third-party
#: entry points, then pluggy's ``check_pending``. The same names stay declared as entry points
#: in pyproject.toml, where they are skipped; they own their names.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("single", "torchplug.plugins.single"),
    ("ddp", "torchplug.plugins.ddp"),
    ("fsdp", "torchplug.plugins.fsdp"),
    ("fairscale", "torchplug.plugins.fairscale"),
    ("slurm", "torchplug.plugins.slurm"),
    ("deepspeed", "torchplug.plugins.deepspeed"),
    ("xla", "torchplug.plugins.xla"),
    ("amp", "torchplug.plugins.amp"),
    ("loggers", "torchplug.loggers.builtin"),
)

#: Hooks that make a plugin part of an Engine's active set when it is registered globally.
STRATEGY_HOOKS = frozenset(
    name
    for name in dir(spec)
    if name.startswith("torchplug_")
    and name
    not in {
        "torchplug_register_strategies",
        "torchplug_register_precisions",
        "torchplug_register_loggers",
        "torchplug_cluster_environment",
        "torchplug_convert_checkpoint",
    }
)


#: Hooks an Engine's active set must answer: every strategy hook but teardown (optional).
ACTION_HOOKS = STRATEGY_HOOKS - {"torchplug_teardown"}


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


class PluginManager(pluggy.PluginManager):
    """pluggy's manager, also accepting unmarked ``torchplug_*`` functions (as pytest does)."""

    def __init__(self) -> None:
        super().__init__(spec.PROJECT)
        self.add_hookspecs(spec)
        self.tracing = _truthy("TORCHPLUG_TRACE")
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
        shown = repr(result)
        shown = shown if len(shown) < 60 else shown[:57] + "..."
        sys.stderr.write(f"[torchplug] {hook}: answered by {who} -> {shown}\n")

    def parse_hookimpl_opts(self, plugin: object, name: str) -> Any:
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


def register_checked(pm: pluggy.PluginManager, plugin: object, name: str | None = None) -> None:
    """Register ``plugin``; turn pluggy's validation errors into one naming plugin and hook."""
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        label = name or getattr(plugin, "__name__", type(plugin).__name__)
        raise PluginError(
            f"Plugin '{label}' does not follow the torchplug hook specification: {exc}. "
            f"Fix the hook's name or arguments to match torchplug.core.spec."
        ) from None
    if pm.get_name(plugin) is None:  # pm.register returns None for blocked names
        return
    unknown = [
        attr for attr in dir(plugin) if attr.startswith("torchplug_") and not hasattr(spec, attr)
    ]
    # what pluggy's check_pending would find: functions marked @hookimpl under no hook's name
    unknown += [
        c.name for c in pm.get_hookcallers(plugin) or [] if c.spec is None and c.name not in unknown
    ]
    if unknown:
        pm.unregister(plugin)
        known = [n for n in dir(spec) if n.startswith("torchplug_")]
        hints = "".join(did_you_mean(u, known) for u in unknown)
        raise PluginError(
            f"Plugin '{name or plugin}' implements unknown hook(s) {', '.join(unknown)}.{hints} "
            f"Hooks are listed in torchplug.core.spec."
        )


@dataclass
class Registry:
    """Everything installed: plugins, the strategies and precisions they announce, and failures."""

    pm: pluggy.PluginManager
    strategies: dict[str, StrategyInfo] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    precisions: dict[str, PrecisionInfo] = field(default_factory=dict)
    loggers: dict[str, LoggerInfo] = field(default_factory=dict)
    #: plugin name -> why it could not be loaded or registered
    errors: dict[str, str] = field(default_factory=dict)
    #: plugin name -> (distribution, version) for entry-point plugins
    origins: dict[str, tuple[str, str]] = field(default_factory=dict)
    blocked: set[str] = field(default_factory=set)

    # -- registration -------------------------------------------------------------------------

    def add(
        self,
        plugin: object,
        name: str | None = None,
        origin: tuple[str, str] = ("", ""),
        strict: bool = True,
    ) -> str:
        """Register ``plugin`` (a module, a class, or an object with hookimpls); return its name.

        With ``strict``, a failure in its registration hooks is raised (in-house plugins: the
        user is right there); otherwise it is recorded and warned about (installed plugins: one
        broken package must not break the others).
        """
        if inspect.isclass(plugin):
            plugin = plugin()
        register_checked(self.pm, plugin, name)
        plugin_name = self.pm.get_name(plugin)
        if plugin_name is None:
            raise PluginError(
                f"Plugin '{name}' is blocked (TORCHPLUG_BLOCK_PLUGINS or torchplug.block); "
                f"unblock it to register it."
            )
        self.origins[plugin_name] = origin
        self._announce(plugin_name, plugin, strict)
        return plugin_name

    def remove(self, name: str) -> None:
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin)
        for table in (self.strategies, self.precisions, self.loggers):
            for key in [k for k, v in table.items() if v.provider == name]:
                del table[key]
        self.aliases = {a: n for a, n in self.aliases.items() if n in self.strategies}

    def _announce(self, plugin_name: str, plugin: object, strict: bool) -> None:
        distribution, version = self.origins.get(plugin_name, ("", ""))

        def add_strategy(info: StrategyInfo) -> None:
            if not isinstance(info, StrategyInfo):
                raise PluginError(
                    f"Plugin '{plugin_name}' registered {info!r}; expected a "
                    f"torchplug.StrategyInfo."
                )
            taken = {info.name, *info.aliases} & (set(self.strategies) | set(self.aliases))
            if taken:
                owner = self.strategies.get(self.aliases.get(min(taken), min(taken)))
                raise PluginError(
                    f"Plugin '{plugin_name}' registers strategy name(s) {sorted(taken)} already "
                    f"provided by plugin '{owner.provider if owner else '?'}'. Rename the "
                    f"strategy, or block the other plugin with TORCHPLUG_BLOCK_PLUGINS."
                )
            self.strategies[info.name] = info.with_provider(plugin_name, distribution, version)
            for alias in info.aliases:
                self.aliases[alias] = info.name

        def add_precision(info: PrecisionInfo) -> None:
            if not isinstance(info, PrecisionInfo):
                raise PluginError(
                    f"Plugin '{plugin_name}' registered {info!r}; expected a "
                    f"torchplug.PrecisionInfo."
                )
            taken = sorted(set(info.precisions) & set(self.precisions))
            if taken:
                owner = self.precisions[taken[0]]
                raise PluginError(
                    f"Plugin '{plugin_name}' registers precision(s) {taken} already provided by "
                    f"plugin '{owner.provider}' ({owner.name}). Register other precisions, or "
                    f"block the other plugin with TORCHPLUG_BLOCK_PLUGINS."
                )
            for precision in info.precisions:
                self.precisions[precision] = info.with_provider(plugin_name, distribution, version)

        def add_logger(info: LoggerInfo) -> None:
            if not isinstance(info, LoggerInfo):
                raise PluginError(
                    f"Plugin '{plugin_name}' registered {info!r}; expected a torchplug.LoggerInfo."
                )
            if info.name in self.loggers:
                raise PluginError(
                    f"Plugin '{plugin_name}' registers logger '{info.name}' already provided by "
                    f"plugin '{self.loggers[info.name].provider}'. Rename the logger, or block "
                    f"the other plugin with TORCHPLUG_BLOCK_PLUGINS."
                )
            self.loggers[info.name] = info.with_provider(plugin_name, distribution, version)

        for hook_name, callback in (
            ("torchplug_register_strategies", add_strategy),
            ("torchplug_register_precisions", add_precision),
            ("torchplug_register_loggers", add_logger),
        ):
            # Through the plugin manager (tracing, blocking and hookimpl options apply), limited
            # to this plugin so that what it registers is attributed to it.
            others = [p for p in self.pm.get_plugins() if p is not plugin]
            caller = self.pm.subset_hook_caller(hook_name, remove_plugins=others)
            try:
                caller(register=callback)
            except Exception as exc:  # one broken plugin must not break the others
                if strict:
                    self.remove(plugin_name)
                    raise
                self.errors[plugin_name] = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"torchplug plugin '{plugin_name}' failed in {hook_name}: {exc}",
                    stacklevel=2,
                )

    # -- discovery ------------------------------------------------------------------------------

    def load_builtins(self) -> None:
        """torchplug's own plugins, from :data:`BUILTIN_PLUGINS` (not from entry points, so a
        source checkout without an installed distribution has them too); blocked ones are never
        imported, and one that fails to import is recorded while the rest load."""
        import importlib

        from torchplug import __version__

        for name, module in BUILTIN_PLUGINS:
            if name in self.blocked or self.pm.is_blocked(name) or self.pm.has_plugin(name):
                continue
            try:
                plugin = importlib.import_module(module)
            except Exception as exc:
                self.errors[name] = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"torchplug's built-in plugin '{name}' ({module}) failed to import and is "
                    f"skipped: {type(exc).__name__}: {exc}",
                    stacklevel=2,
                )
                continue
            try:
                self.add(plugin, name=name, origin=(OWN_DISTRIBUTION, __version__), strict=False)
            except PluginError as exc:
                self.errors[name] = str(exc)
                warnings.warn(str(exc), stacklevel=2)

    def check_pending(self) -> None:
        """pluggy's check that every hookimpl matches a hook of the specification; a plugin
        that fails it is recorded and removed (one broken plugin must not break the others)."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            name = self.pm.get_name(exc.plugin) or str(exc.plugin)
            self.errors[name] = (
                f"{exc}. Fix the hook's name to match torchplug.core.spec, or remove its marker."
            )
            warnings.warn(f"torchplug plugin '{name}' is skipped: {exc}", stacklevel=2)
            self.remove(name)
            self.check_pending()

    def load_entry_points(self) -> None:
        builtins_only = _truthy("TORCHPLUG_DISABLE_PLUGIN_AUTOLOAD")
        allow = set(_env_list("TORCHPLUG_PLUGINS"))
        points = sorted(
            metadata.entry_points(group=ENTRY_POINT_GROUP),
            key=lambda ep: (not _is_own(ep), ep.name),  # built-ins first: they own their names
        )
        for ep in points:
            own = _is_own(ep)
            if own and ep.name in dict(BUILTIN_PLUGINS):
                continue  # registered from BUILTIN_PLUGINS already (or blocked)
            if ep.name in self.blocked or self.pm.is_blocked(ep.name):
                continue
            if not own and (builtins_only or (allow and ep.name not in allow)):
                continue
            if self.pm.has_plugin(ep.name):
                continue
            dist = getattr(ep, "dist", None)
            origin = (dist.metadata["Name"], dist.version) if dist is not None else ("", "")
            try:
                plugin = ep.load()
            except Exception as exc:
                self.errors[ep.name] = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"torchplug plugin '{ep.name}' ({ep.value}) failed to import and is "
                    f"skipped: {type(exc).__name__}: {exc}",
                    stacklevel=2,
                )
                continue
            try:
                self.add(plugin, name=ep.name, origin=origin, strict=False)
            except PluginError as exc:
                self.errors[ep.name] = str(exc)
                warnings.warn(str(exc), stacklevel=2)

    # -- lookup ---------------------------------------------------------------------------------

    def canonical(self, name: str) -> str | None:
        key = name.strip().lower()
        if key in self.strategies:
            return key
        return self.aliases.get(key)

    def strategy(self, name: str) -> StrategyInfo:
        """The strategy called ``name`` (or an alias), usable here; else an error naming the fix."""
        canonical = self.canonical(name)
        if canonical is None:
            raise ConfigurationError(self.unknown_strategy_message(name))
        info = self.strategies[canonical]
        reason = info.unusable_reason()
        if reason is not None:
            raise ConfigurationError(
                f"Strategy '{info.name}' is installed but cannot run here: {reason}. "
                f"Choose a usable strategy ({', '.join(self.usable_names()) or 'none'})."
            )
        return info

    def logger(self, name: str) -> LoggerInfo:
        """The logger called ``name``, usable here; else an error naming the fix."""
        key = name.strip().lower()
        info = self.loggers.get(key)
        if info is None:
            names = sorted(self.loggers)
            raise ConfigurationError(
                f"Unknown logger '{name}'.{did_you_mean(key, names)} Installed loggers: "
                f"{', '.join(names) or 'none'}. Pick one of those, or pip install the plugin "
                f"that provides '{name}' (`torchplug plugins` lists them)."
            )
        reason = info.unusable_reason()
        if reason is not None:
            raise ConfigurationError(f"Logger '{info.name}' is installed but cannot run: {reason}.")
        return info

    def usable_names(self) -> list[str]:
        return sorted(n for n, i in self.strategies.items() if i.unusable_reason() is None)

    def unknown_strategy_message(self, name: str) -> str:
        names = sorted({*self.strategies, *self.aliases})
        lines = [f"Unknown strategy '{name}'.{did_you_mean(name.lower(), names)}"]
        lines.append(f"Installed: {', '.join(self.usable_names()) or 'none'}.")
        unusable = {n: r for n, i in sorted(self.strategies.items()) if (r := i.unusable_reason())}
        if unusable:
            lines.append(
                "Installed but unusable here: "
                + "; ".join(f"{n}: {r}" for n, r in unusable.items())
                + "."
            )
        if self.errors:
            lines.append(
                "Plugins that failed to load: "
                + "; ".join(f"{n} ({e})" for n, e in sorted(self.errors.items()))
                + "."
            )
        if not self.strategies:
            lines.append(
                "No strategies are registered at all: are torchplug's own plugins blocked "
                "(TORCHPLUG_BLOCK_PLUGINS, torchplug.block)? Unblock them."
            )
        lines.append(
            "Run `torchplug plugins` for details, or pip install the plugin that provides it."
        )
        return " ".join(lines)

    def extensions(self) -> list[object]:
        """Registered plugins that implement strategy hooks themselves: they join every Engine.

        A plugin that announces strategies or precisions is a provider, not an extension: its
        hooks run only through the objects its factories make, for the Engines that select them.
        """
        providers = {
            i.provider
            for i in (*self.strategies.values(), *self.precisions.values(), *self.loggers.values())
        }
        return [
            plugin
            for name, plugin in self.pm.list_name_plugin()
            if name not in providers
            and any(callable(getattr(plugin, h, None)) for h in STRATEGY_HOOKS)
        ]


def _is_own(ep: metadata.EntryPoint) -> bool:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ep.value.startswith("torchplug.")
    return dist.metadata["Name"].replace("_", "-").lower() == OWN_DISTRIBUTION


#: Guards the registry: building it, register/unregister/block, reset. Reentrant, because an
#: in-house module imported while the registry is built may call torchplug.register().
_lock = threading.RLock()
_registry: Registry | None = None
_pending_blocks: set[str] = set()


def get_registry() -> Registry:
    """The process-wide registry, built on first use (so ``import torchplug`` loads no plugin)."""
    global _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                pm = new_plugin_manager()
                registry = Registry(pm)
                for name in {*_env_list("TORCHPLUG_BLOCK_PLUGINS"), *_pending_blocks}:
                    pm.set_blocked(name)
                    registry.blocked.add(name)
                from torchplug.core import cluster

                registry.add(cluster, name="torchplug.cluster", origin=(OWN_DISTRIBUTION, ""))
                registry.load_builtins()
                registry.load_entry_points()
                registry.check_pending()
                _registry = registry
                # An in-house module may call torchplug.register() on import (same thread:
                # the lock is reentrant).
                for module in _env_list(PLUGIN_MODULES_ENV):
                    import_plugin_module(registry, module, strict=False)
    return _registry


def import_plugin_module(registry: Registry, module: str, strict: bool = True) -> None:
    """Import an in-house plugin module by name (the working directory on ``sys.path`` too)
    and register it unless importing it registered it already.

    ``strict``: raise what went wrong (``torchplug launch --plugin``); else record and warn, as
    for entry-point plugins (the processes the launcher started).
    """
    import importlib

    try:
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        plugin = importlib.import_module(module)
        if not registry.pm.is_registered(plugin) and registry.pm.get_plugin(module) is None:
            registry.add(plugin, name=module)
    except Exception as exc:
        if strict:
            raise PluginError(
                f"Plugin module '{module}' could not be loaded: {type(exc).__name__}: {exc}. "
                f"Check the module name (it is imported like `import {module}`, from the "
                f"current directory too) and that it imports cleanly."
            ) from exc
        registry.errors[module] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"torchplug plugin module '{module}' ({PLUGIN_MODULES_ENV}) failed to load and is "
            f"skipped: {type(exc).__name__}: {exc}",
            stacklevel=2,
        )


def reset_registry(forget_blocks: bool = False) -> None:
    """Forget the registry so the next use rediscovers plugins (for tests and notebooks).

    Names blocked with :func:`block` stay blocked (they apply to the next registry too) unless
    ``forget_blocks``.
    """
    global _registry
    with _lock:
        _registry = None
        if forget_blocks:
            _pending_blocks.clear()


def register(plugin: Any, name: str | None = None) -> str:
    """Register an in-house plugin in one line; its strategies become selectable by name.

    ``plugin`` is a module, a class (instantiated with no arguments) or an object whose functions
    are marked with :data:`torchplug.hookimpl`. A plugin that implements strategy hooks itself
    (not only registration hooks) joins the active set of every Engine created afterwards.
    """
    registry = get_registry()
    with _lock:
        return registry.add(plugin, name=name)


def unregister(name: str) -> None:
    """Remove a plugin registered earlier, and the strategies it announced."""
    registry = get_registry()
    with _lock:
        registry.remove(name)


def block(names: Iterable[str] | str) -> None:
    """Block plugins by name: never imported if not yet loaded, removed if they were."""
    with _lock:
        for name in [names] if isinstance(names, str) else names:
            _pending_blocks.add(name)
            if _registry is not None:
                _registry.remove(name)
                _registry.pm.set_blocked(name)
                _registry.blocked.add(name)
