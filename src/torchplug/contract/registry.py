"""The registry of what is installed: plugins, the names they announce, and failures.

`Registry.add` registers a plugin and calls its registration hooks (one `subset_hook_caller`
per plugin: what it registers is attributed to it, and one failing plugin is recorded without
losing the others). Lookup (`Registry.strategy`, ...) answers "what is installed, what is usable
here, and why not".
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from dataclasses import dataclass, field

import pluggy

from torchplug.contract import apiversion, spec
from torchplug.contract.errors import ConfigurationError, PluginError
from torchplug.contract.types import LoggerInfo, PrecisionInfo, StrategyInfo
from torchplug.contract.validation import (
    hook_problems,
    plugin_label,
    qualified_name,
    register_checked,
)
from torchplug.util import capabilities
from torchplug.util.records import Record
from torchplug.util.text import did_you_mean

#: Built-in plugins that hold default answers (``trylast``): registered into each Engine before
#: its backend, so that any answer of the backend's comes first.
DEFAULT_ANSWERS = frozenset({"checkpoint", "torch_distributed"})

#: Hooks that make a plugin part of an Engine's active set when it is registered globally, and
#: the ones that active set must answer (declared with each hook in `torchplug.contract.spec`).
STRATEGY_HOOKS = spec.hooks_where(kind="strategy")
ACTION_HOOKS = spec.hooks_where(required=True)


@dataclass(eq=False, repr=False)
class Registry(Record):
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
    #: installed entry-point plugin -> why it was not loaded (allow-list, autoload off, blocked)
    hidden: dict[str, str] = field(default_factory=dict)

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
        broken package must not break the others). Registering a plugin that is registered
        already (the same object, or a class whose instance is) does nothing: re-running a
        notebook cell must not fail.
        """
        if inspect.isclass(plugin):
            existing = self.pm.get_plugin(name or qualified_name(plugin))
            if type(existing) is plugin:
                return self.pm.get_name(existing) or ""
            plugin = plugin()
        if self.pm.is_registered(plugin):
            return self.pm.get_name(plugin) or ""
        label = plugin_label(plugin, name)
        refusal = apiversion.incompatibility(
            getattr(plugin, apiversion.ATTRIBUTE, None), f"Plugin '{label}'"
        )
        if refusal is not None:
            raise PluginError(f"{refusal} It is not loaded.")
        if name is None:
            # named by module:qualname, not pluggy's id(), so errors and listings say which;
            # a second object of the same class (e.g. made by a factory function) gets #2, ...
            qualified = name = qualified_name(plugin)
            count = 1
            while self.pm.get_plugin(name) is not None or self.pm.is_blocked(name):
                count += 1
                name = f"{qualified}#{count}"
        elif (other := self.pm.get_plugin(name)) is not None:
            raise PluginError(
                f"Another plugin is already registered as '{name}' ({qualified_name(other)}). "
                f"Unregister it first (torchplug.unregister('{name}')), or give this one "
                f"another name (torchplug.register(plugin, name=...))."
            )
        register_checked(self.pm, plugin, name)
        plugin_name = self.pm.get_name(plugin)
        if plugin_name is None:
            raise PluginError(
                f"Plugin '{label}' is blocked (TORCHPLUG_BLOCK_PLUGINS or torchplug.block); "
                f"unblock it to register it."
            )
        self.origins[plugin_name] = origin
        self._announce(plugin_name, plugin, strict)
        return plugin_name

    def remove(self, name: str | object) -> None:
        """Unregister a plugin given by name or as the object (module, class or instance)
        registered; its strategies and precisions go with it. Unknown plugins are an error."""
        if isinstance(name, str):
            plugin = self.pm.get_plugin(name)
        elif inspect.isclass(name):
            plugin = next((p for p in self.pm.get_plugins() if type(p) is name), None)
        else:
            plugin = name if self.pm.is_registered(name) else None
        if not isinstance(name, str):
            if plugin is None:
                raise PluginError(
                    f"Plugin '{qualified_name(name)}' is not registered, so it cannot be "
                    f"unregistered. Registered: "
                    f"{', '.join(sorted(str(n) for n, _ in self.pm.list_name_plugin()))}."
                )
            name = self.pm.get_name(plugin) or ""
        if plugin is not None:
            self.pm.unregister(plugin)
        for table in (self.strategies, self.precisions, self.loggers):
            for key in [k for k, v in table.items() if v.provider == name]:
                del table[key]
        self.aliases = {a: n for a, n in self.aliases.items() if n in self.strategies}

    def _announce(self, plugin_name: str, plugin: object, strict: bool) -> None:
        distribution, version = self.origins.get(plugin_name, ("", ""))
        label = plugin_label(plugin, plugin_name)

        def expect(info: object, kind: type) -> None:
            if not isinstance(info, kind):
                raise PluginError(
                    f"Plugin '{label}' registered {info!r}; expected a "
                    f"torchplug.plugin.{kind.__name__}."
                )

        def add_strategy(info: StrategyInfo) -> None:
            expect(info, StrategyInfo)
            refusal = apiversion.incompatibility(info.api, f"Strategy '{info.name}'")
            if refusal is not None:
                raise PluginError(f"{refusal} It is not registered.")
            if info.extends:
                parent = self.canonical(info.extends)
                if parent is None:
                    raise PluginError(
                        f"Strategy '{info.name}' of plugin '{label}' extends "
                        f"'{info.extends}', which is not registered."
                        f"{did_you_mean(info.extends, sorted(self.strategies))} Name an "
                        f"installed strategy (torchplug plugins lists them)."
                    )
                info = info.inheriting(self.strategies[parent])
            if inspect.isclass(info.factory):
                problems = hook_problems(info.factory)
                if problems:
                    message = (
                        f"its class {qualified_name(info.factory)} does not match the hook "
                        f"specification: " + "; ".join(problems)
                    )
                    if strict:
                        raise PluginError(f"Strategy '{info.name}' of plugin '{label}': {message}.")
                    self.errors[plugin_name] = f"strategy '{info.name}': {message}"
                    warnings.warn(
                        f"torchplug plugin '{label}': strategy '{info.name}' is broken and "
                        f"cannot be selected: {message}",
                        stacklevel=2,
                    )
                    info = dataclasses.replace(info, problem=message)
            taken = {info.name, *info.aliases} & (set(self.strategies) | set(self.aliases))
            if taken:
                owner = self.strategies.get(self.aliases.get(min(taken), min(taken)))
                raise PluginError(
                    f"Plugin '{label}' registers strategy name(s) {sorted(taken)} already "
                    f"provided by plugin '{owner.provider if owner else '?'}'. Rename the "
                    f"strategy, or block the other plugin with TORCHPLUG_BLOCK_PLUGINS; if it is "
                    f"this plugin registered again (a re-run notebook cell made a new object), "
                    f"unregister the old one first: torchplug.unregister("
                    f"'{owner.provider if owner else '?'}')."
                )
            self.strategies[info.name] = info.with_provider(plugin_name, distribution, version)
            for alias in info.aliases:
                self.aliases[alias] = info.name

        def add_precision(info: PrecisionInfo) -> None:
            expect(info, PrecisionInfo)
            taken = sorted(set(info.precisions) & set(self.precisions))
            if taken:
                owner = self.precisions[taken[0]]
                raise PluginError(
                    f"Plugin '{label}' registers precision(s) {taken} already provided by "
                    f"plugin '{owner.provider}' ({owner.name}). Register other precisions, or "
                    f"block the other plugin with TORCHPLUG_BLOCK_PLUGINS."
                )
            for precision in info.precisions:
                self.precisions[precision] = info.with_provider(plugin_name, distribution, version)

        def add_logger(info: LoggerInfo) -> None:
            expect(info, LoggerInfo)
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
                    f"torchplug plugin '{label}' failed in {hook_name}: {exc}", stacklevel=2
                )

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

    def precision_unavailable(self, info: StrategyInfo, precision: str) -> str | None:
        """Why ``precision`` cannot run under ``info`` on this machine, or ``None`` (the one
        probe: `torchplug.util.capabilities.precision_unavailable`)."""
        return capabilities.precision_unavailable(info, precision, self.precisions)

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
        """Why ``name`` selects no strategy: near names, what is installed, what failed or is
        hidden (it may provide it), what cannot run here, and how to find out more."""
        names = sorted({*self.strategies, *self.aliases})
        reasons = {n: r for n, i in sorted(self.strategies.items()) if (r := i.unusable_reason())}
        unusable = {", ".join(n for n in reasons if reasons[n] == r): r for r in reasons.values()}
        listed = [
            ("Plugins that failed to load: ", self.errors, " ({})", "."),
            (
                "Installed plugins not loaded: ",
                self.hidden,
                " ({})",
                ": one of them may provide it.",
            ),
            ("Installed but unusable here: ", unusable, ": {}", "."),
        ]
        lines = [
            f"Unknown strategy '{name}'.{did_you_mean(name.lower(), names)}",
            f"Installed: {', '.join(self.usable_names()) or 'none'}.",
            *(
                head + "; ".join(n + shape.format(why) for n, why in sorted(found.items())) + tail
                for head, found, shape, tail in listed
                if found
            ),
        ]
        if not self.strategies:
            lines.append("No strategies are registered: are torchplug's own plugins blocked "
                         "(TORCHPLUG_BLOCK_PLUGINS, torchplug.block)? Unblock them.")  # fmt: skip
        lines.append("Run `torchplug plugins` for details, or pip install the plugin for it.")
        return " ".join(lines)

    def extensions(self) -> list[object]:
        """Registered plugins with strategy hooks of their own, which join every Engine (a
        provider's hooks run only through the objects its factories make)."""
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

    def default_answers(self) -> dict[str, object]:
        """The extensions holding torchplug's default answers (`DEFAULT_ANSWERS`), by name."""
        return {
            name: plugin
            for name, plugin in self.pm.list_name_plugin()
            if name in DEFAULT_ANSWERS and plugin is not None
        }
