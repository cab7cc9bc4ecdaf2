"""The one plugin manager: discovery, registration, and the registry of strategy names.

Built-in plugins and third-party plugins are found the same way, through the ``torchplug``
entry-point group; a built-in is simply an entry point whose distribution is torchplug itself.
In-house plugins join with one call to [`register`][torchplug.register].

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

import dataclasses
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

from torchplug.core import apiversion, capabilities, spec
from torchplug.core.errors import ConfigurationError, PluginError, did_you_mean
from torchplug.core.registry import LoggerInfo, Option, PrecisionInfo, StrategyInfo

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
    ("tensor_parallel", "torchplug.plugins.tensor_parallel"),
    ("fairscale", "torchplug.plugins.fairscale"),
    ("slurm", "torchplug.plugins.slurm"),
    ("kubeflow", "torchplug.plugins.kubeflow"),
    ("lsf", "torchplug.plugins.lsf"),
    ("mpi", "torchplug.plugins.mpi"),
    ("deepspeed", "torchplug.plugins.deepspeed"),
    ("xla", "torchplug.plugins.xla"),
    ("amp", "torchplug.plugins.amp"),
    ("loggers", "torchplug.loggers.builtin"),
    ("checkpoint", "torchplug.checkpoint.defaults"),
)

#: Built-in plugins that hold default answers (``trylast``): registered into each Engine before
#: its backend, so that any answer of the backend's comes first.
DEFAULT_ANSWERS = frozenset({"checkpoint"})

#: Hooks that make a plugin part of an Engine's active set when it is registered globally, and
#: the ones that active set must answer (declared with each hook in `torchplug.core.spec`).
STRATEGY_HOOKS = spec.hooks_where(kind="strategy")
ACTION_HOOKS = spec.hooks_where(required=True)


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
        wrappers = [self._label(i) for i in reversed(impls) if i.wrapper or i.hookwrapper]
        # pluggy hands the monitor the outcome of the whole call: what the wrappers returned
        around = f", final result after wrapper(s) {', '.join(wrappers)}" if wrappers else ""
        shown = repr(result)
        shown = shown if len(shown) < 60 else shown[:57] + "..."
        sys.stderr.write(f"[torchplug] {hook}: answered by {who}{around} -> {shown}\n")

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


def qualified_name(plugin: object) -> str:
    """``module:qualname`` of a plugin: a module's name, a class's (or an instance's class's)
    module and qualified name; how errors and listings name a plugin that has no name."""
    if inspect.ismodule(plugin):
        return plugin.__name__
    cls = plugin if inspect.isclass(plugin) else type(plugin)
    return f"{cls.__module__}:{cls.__qualname__}"


def plugin_label(plugin: object, name: str | None = None) -> str:
    """How a plugin is named to users: its registration name (an entry point's name) when it
    has a real one, with the ``module:qualname`` it comes from."""
    qualified = qualified_name(plugin)
    if not name or name.isdigit() or name == qualified:
        return qualified
    return f"{name} ({qualified})"


def _label(plugin: object, name: str) -> str:
    kind = getattr(plugin, "__name__", None) or type(plugin).__name__
    return kind if name.isdigit() or name.startswith("_") else f"{name} ({kind})"


def new_plugin_manager() -> PluginManager:
    """A manager that knows torchplug's hook specification and nothing else."""
    return PluginManager()


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


def _argnames(function: Any, drop_first: bool) -> list[str]:
    """The arguments pluggy passes by name: those without defaults (as pluggy reads them)."""
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


def hook_problems(plugin: object) -> list[str]:
    """What in ``plugin`` (a module, class or object) does not match the hook specification:
    unknown hook names, marked functions under no hook's name, arguments the hook does not pass,
    wrappers that do not yield. Works on a class without making an instance, so a strategy's
    class is checked when it is announced, long before an Engine creates it."""
    known = sorted(n for n in dir(spec) if n.startswith("torchplug_"))
    problems = []
    for attr in sorted(dir(plugin)):
        try:
            value = inspect.getattr_static(plugin, attr)
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
        expected = _argnames(getattr(spec, attr), False)
        extra = [a for a in _argnames(function, drop_first) if a not in expected]
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

        def add_strategy(info: StrategyInfo) -> None:
            if not isinstance(info, StrategyInfo):
                raise PluginError(
                    f"Plugin '{label}' registered {info!r}; expected a torchplug.StrategyInfo."
                )
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
            if not isinstance(info, PrecisionInfo):
                raise PluginError(
                    f"Plugin '{label}' registered {info!r}; expected a torchplug.PrecisionInfo."
                )
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
                    f"torchplug plugin '{label}' failed in {hook_name}: {exc}", stacklevel=2
                )

    # -- discovery ------------------------------------------------------------------------------

    def load_builtins(self) -> None:
        """torchplug's own plugins, from `BUILTIN_PLUGINS` (not from entry points, so a
        source checkout without an installed distribution has them too); blocked ones are never
        imported, and one that fails to import is recorded while the rest load."""
        import importlib

        from torchplug.core.version import VERSION as __version__

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
            label = plugin_label(exc.plugin, name)
            self.errors[name] = (
                f"{exc}. Fix the hook's name as docs/hooks.md lists them, or remove its marker."
            )
            warnings.warn(f"torchplug plugin '{label}' is skipped: {exc}", stacklevel=2)
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
                self.hidden[ep.name] = "blocked (TORCHPLUG_BLOCK_PLUGINS or torchplug.block)"
                continue
            if not own and builtins_only:
                self.hidden[ep.name] = "autoload is off (TORCHPLUG_DISABLE_PLUGIN_AUTOLOAD=1)"
                continue
            if not own and allow and ep.name not in allow:
                self.hidden[ep.name] = (
                    f"not in the allow-list TORCHPLUG_PLUGINS={','.join(sorted(allow))}"
                )
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

    def loading_state(self) -> list[str]:
        """Lines saying how plugins are loaded here (autoload, allow-list, blocks) and which
        installed plugins that hides, for ``torchplug plugins`` and ``doctor``."""
        autoload = (
            "off (TORCHPLUG_DISABLE_PLUGIN_AUTOLOAD=1)"
            if _truthy("TORCHPLUG_DISABLE_PLUGIN_AUTOLOAD")
            else "on"
        )
        allow = ", ".join(_env_list("TORCHPLUG_PLUGINS")) or "none (every installed plugin)"
        lines = [f"autoload: {autoload}", f"allow-list (TORCHPLUG_PLUGINS): {allow}"]
        if self.blocked:
            lines.append(f"blocked: {', '.join(sorted(self.blocked))}")
        lines += [f"hidden: {name}: {why}" for name, why in sorted(self.hidden.items())]
        return lines

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
        probe: `torchplug.core.capabilities.precision_unavailable`)."""
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
        if self.hidden:
            lines.append(
                "Installed plugins not loaded: "
                + "; ".join(f"{n} ({why})" for n, why in sorted(self.hidden.items()))
                + ": one of them may provide it."
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

    def default_answers(self) -> list[object]:
        """The extensions holding torchplug's default answers (`DEFAULT_ANSWERS`)."""
        return [
            plugin
            for name, plugin in self.pm.list_name_plugin()
            if name in DEFAULT_ANSWERS and plugin is not None
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
                for name in {*_env_list("TORCHPLUG_BLOCK_PLUGINS"), *_pending_blocks}:
                    pm.set_blocked(name)
                    registry.blocked.add(name)
                from torchplug.core import cluster

                registry.add(cluster, name="torchplug.cluster", origin=(OWN_DISTRIBUTION, ""))
                registry.load_builtins()
                registry.load_entry_points()
                registry.check_pending()
                _registry = registry
                _building = None
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
            sys.path.insert(0, os.getcwd())  # as `python -m` does: the current directory first
        plugin = importlib.import_module(module)
        if not registry.pm.is_registered(plugin) and registry.pm.get_plugin(module) is None:
            registry.add(plugin, name=module)
    except Exception as exc:
        if strict:
            raise PluginError(
                f"Plugin module '{module}' could not be loaded: {type(exc).__name__}: {exc}. "
                f"Expected a module importable as `import {module}` from the current directory "
                f"({os.getcwd()}) or an installed package; check the name (a module name, "
                f"not a file path) and that it imports cleanly."
            ) from exc
        registry.errors[module] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"torchplug plugin module '{module}' ({PLUGIN_MODULES_ENV}) failed to load and is "
            f"skipped: {type(exc).__name__}: {exc}",
            stacklevel=2,
        )


def load_extension(module: str) -> object:
    """``Engine(plugins=["my_pkg.guard"])``: the module of that name (a class in it is not
    guessed: the module itself is the plugin), imported from the current directory too."""
    import importlib

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PluginError(
            f"Extension plugin module '{module}' (Engine(plugins=[...])) could not be imported: "
            f"{exc}. Expected a module importable as `import {module}` from the current "
            f"directory ({os.getcwd()}) or an installed package; or pass the plugin object."
        ) from exc


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


def options_of(strategy: str) -> tuple[Option, ...]:
    """The options a registered strategy declares, to build on in a strategy that extends it:
    ``StrategyInfo(..., options=(*tp.options_of("ddp"), Option("extra", int, 0)))``.
    (``StrategyInfo(extends="ddp")`` does this and inherits the capabilities as well.)

    Args:
        strategy: A registered strategy's name or alias.

    Returns:
        Its options, in order.
    """
    registry = _building if _building is not None else get_registry()
    canonical = registry.canonical(strategy)
    if canonical is None:
        raise PluginError(
            f"options_of({strategy!r}): no strategy of that name is registered (yet)."
            f"{did_you_mean(strategy, sorted(registry.strategies))} Name an installed strategy; "
            f"torchplug's own strategies are always registered before third-party plugins."
        )
    return registry.strategies[canonical].options


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
