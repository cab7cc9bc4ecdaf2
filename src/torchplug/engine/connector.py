"""Settings -> selection: which strategy and precision run, with which options and plugins.

The one place ``strategy="auto"`` is decided (`auto_strategy`): the Engine, the launcher's
and doctor's check (`torchplug.engine.config.problems`) and doctor's listing all ask it, so the
three cannot disagree. Like Fabric's ``_Connector``, this module turns resolved settings into
choices and refuses what cannot run here; the Engine then only runs what it picked.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torchplug.contract import discovery, manager
from torchplug.contract.context import Selection
from torchplug.contract.errors import ConfigurationError, PluginError
from torchplug.contract.hooks import Hooks
from torchplug.contract.types import (
    DEFAULT_TIMEOUT,
    ClusterInfo,
    StrategyInfo,
    resolve_options,
)
from torchplug.engine import config
from torchplug.engine.config import auto_strategy, is_auto, normalize_precision  # noqa: F401 - re-exported
from torchplug.util.records import Record


def select_strategy(
    settings: config.Settings, registry: manager.Registry, cluster: ClusterInfo
) -> StrategyInfo:
    """The strategy ``settings`` name (``auto`` decided here, and recorded in ``settings`` with
    its reason), usable here and in a process of this job; else an error naming the source."""
    setting = settings.strategy
    name = str(setting.value)
    if is_auto(name):
        name = auto_strategy(cluster.world_size)
        settings.strategy = config.Setting(
            name, f"auto ({'world size ' + str(cluster.world_size)})"
        )
    try:
        info = registry.strategy(name)
    except ConfigurationError as exc:
        if setting.source == "code argument":
            raise
        raise ConfigurationError(f"{exc} (The name came from {setting.source}.)") from None
    if cluster.world_size > 1 and not info.distributed:
        raise ConfigurationError(
            f"Strategy '{info.name}' runs in one process, but this process is rank "
            f"{cluster.rank} of {cluster.world_size} ({cluster.source}). "
            f"Use a multi-process strategy such as 'ddp', or launch a single process."
        )
    return info


def check_precision(
    info: StrategyInfo, precision: str, settings: config.Settings, registry: manager.Registry
) -> None:
    """Refuse a precision the strategy does not support, or that this machine cannot run."""
    if precision not in info.precisions:
        able = ", ".join(info.precisions)
        raise ConfigurationError(
            f"Strategy '{info.name}' cannot run precision '{precision}' "
            f"(set by {settings.precision.source}); it supports {able}. Choose one of "
            f"those, or a strategy that supports '{precision}'."
        )
    unavailable = registry.precision_unavailable(info, precision)
    if unavailable is not None:
        raise ConfigurationError(
            f"Strategy '{info.name}' cannot run precision '{precision}' (set by "
            f"{settings.precision.source}) here: {unavailable}. Use another precision "
            f"(`torchplug plugins --verbose` lists what this machine runs), or a machine "
            f"that has it."
        )


def strategy_options_of(
    settings: config.Settings, registry: manager.Registry, info: StrategyInfo
) -> dict[str, Any]:
    """The selected strategy's options from every source, checked (a shared option or a
    ``[strategies.NAME]`` table that no installed strategy knows is a typo)."""
    typos = config.unknown_shared_options(settings, registry)
    typos += config.unknown_strategy_tables(settings, registry)
    if typos:
        raise ConfigurationError(typos[0])
    chosen = settings.for_strategy(info, registry.canonical)
    return info.resolve_options({name: s.value for name, s in chosen.items()})


def active_set(
    info: StrategyInfo,
    options: Mapping[str, Any],
    precision: str,
    precision_options: Mapping[str, Any] | None,
    registry: manager.Registry,
    plugins: Iterable[object],
) -> tuple[object, list[object], dict[str, Any]]:
    """``(backend, active set, precision options)``: the backend made by the strategy's
    factory, the precision plugin when the backend does not own precision, then the globally
    registered extensions and ``Engine(plugins=...)`` (module names imported)."""
    resolved: dict[str, Any] = {}
    backend = info.factory(**options)
    active: list[object] = [backend]
    if precision != "32" and not info.owns_precision:
        precision_info = registry.precisions.get(precision)
        if precision_info is None:
            raise ConfigurationError(
                f"No installed plugin provides precision '{precision}' for strategy "
                f"'{info.name}' (the 'amp' plugin normally does; is it blocked?). "
                f"Unblock it or use precision=None."
            )
        resolved = resolve_options(
            f"precision plugin '{precision_info.name}'",
            precision_info.options,
            precision_options or {},
        )
        active.append(precision_info.factory(precision, **resolved))
    elif info.owns_precision and info.precision_options:
        resolved = resolve_options(
            f"strategy '{info.name}' (precision_options)",
            info.precision_options,
            precision_options or {},
        )
    elif precision_options:
        raise ConfigurationError(
            f"precision_options were given, but strategy '{info.name}' "
            + (
                "owns precision: pass them as strategy options instead."
                if info.owns_precision
                else "runs in full precision, where no precision plugin is active: drop them "
                "or "
                "set precision='bf16'/'fp16'."
            )
        )
    active += [p for p in registry.extensions() if p not in active]
    plugins = list(plugins)  # a generator would be used up by the check below
    for plugin in plugins:
        if plugin is None or isinstance(plugin, (bool, int, float, bytes)):
            raise ConfigurationError(
                f"plugins takes plugin objects, module names or hook functions, got "
                f"{type(plugin).__name__} {plugin!r}. Pass e.g. plugins=['my_module'] or "
                f"plugins=[MyExtension()]."
            )
    for plugin in plugins:  # one already active (registered globally too) is active once
        if isinstance(plugin, str):
            loaded = load_extension(plugin)
        elif inspect.isfunction(plugin):
            loaded = HookFunction(plugin)
        else:
            loaded = plugin
        if not any(loaded is other for other in active):
            active.append(loaded)
    return backend, active, resolved


def checked_seed(seed: Any) -> int:
    """``Engine(seed=...)``: a whole number torch's generators take (0 to 2**64 - 1)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ConfigurationError(
            f"seed must be a whole number from 0 to 2**64 - 1, got {type(seed).__name__} "
            f"{seed!r}. Pass e.g. seed=0 (the default), or seed=int(your_value)."
        )
    return seed


def checked_callbacks(callbacks: Any) -> list[object]:
    """``Engine(callbacks=...)``: an iterable of objects (a single string is a mistake)."""
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Iterable):
        raise ConfigurationError(
            f"callbacks must be a list of objects with methods named after your events, got "
            f"{type(callbacks).__name__} {callbacks!r}. Pass e.g. callbacks=[MyCallback()]."
        )
    return list(callbacks)


def check_contract(hooks: Hooks, info: StrategyInfo, backend: object, missing: list[str]) -> None:
    """Refuse to start when an action hook has no answer in the active set (a backend that
    forgot one would otherwise do nothing, silently, when that hook is called); ``missing``:
    the built-in default-answer plugins that are blocked, named in the error."""
    unanswered = [
        name
        for name in sorted(manager.ACTION_HOOKS)
        if not any(not (impl.wrapper or impl.hookwrapper) for impl in hooks.implementations(name))
    ]
    if unanswered:
        raise PluginError(
            f"Strategy '{info.name}' (plugin '{info.provider or '?'}', backend "
            f"{manager.qualified_name(backend)}) leaves {len(unanswered)} hook(s) "
            f"unanswered: {', '.join(unanswered)}. Every action hook needs an answer in "
            f"the active set (docs/hooks.md)"
            + (
                f"; the built-in plugin(s) {', '.join(missing)}, which answer them by "
                f"default, are blocked: unblock them (TORCHPLUG_BLOCK_PLUGINS), or "
                f"implement these hooks in the backend."
                if missing
                else ": implement these hooks in the backend."
            )
        )


@dataclass(eq=False, repr=False)
class Connection(Record):
    """What `connect` chose for one Engine: the settings with their sources, who this process
    is, the strategy and its options, the precision, and the active set."""

    settings: config.Settings
    cluster: ClusterInfo
    info: StrategyInfo
    precision: str
    options: dict[str, Any]
    backend: object
    active: list[object]
    precision_options: dict[str, Any]
    registry: manager.Registry

    def selection(self, checkpoint_key: Any, checkpoint_timeout: float) -> Selection:
        """What the Engine's hooks read of these choices (`HookContext`)."""
        return Selection(
            self.info.name,
            self.backend,
            self.precision,
            self.precision_options,
            self.options,
            self.settings,
            self.cluster,
            checkpoint_key,
            float(self.options.get("timeout") or DEFAULT_TIMEOUT),
            checkpoint_timeout,
        )

    def plugin_manager(self) -> tuple[manager.PluginManager, list[str]]:
        """A plugin manager holding the active set, and the built-in default-answer plugins
        that are blocked (named when a hook is left unanswered).

        torchplug's default answers are registered first: pluggy calls the later-registered
        first, so any answer of the backend's or an extension's comes before them."""
        pm = manager.new_plugin_manager()
        defaults = self.registry.default_answers()
        names = {id(plugin): name for name, plugin in defaults.items()}
        for plugin in sorted(self.active, key=lambda p: id(p) not in names):
            manager.register_checked(pm, plugin, name=names.get(id(plugin)))
        return pm, sorted(manager.DEFAULT_ANSWERS - defaults.keys())


def connect(
    strategy: str,
    precision: str | int | None,
    strategy_options: Mapping[str, Any],
    precision_options: Mapping[str, Any] | None,
    plugins: Iterable[object],
) -> Connection:
    """``Engine(strategy, precision, plugins=..., precision_options=..., **options)`` as
    choices: every source of settings resolved, the strategy selected and checked against this
    process and machine, its options and the precision's checked, the backend made."""
    registry = manager.get_registry()
    settings = config.resolve(
        strategy,
        None if precision is None else str(precision),
        dict(strategy_options),
        canonical=lambda name: registry.canonical(name) or name.strip().lower(),
    )
    cluster = detect()
    info = select_strategy(settings, registry, cluster)
    chosen = normalize_precision(settings.precision.value)
    check_precision(info, chosen, settings, registry)
    options = strategy_options_of(settings, registry, info)
    backend, active, resolved = active_set(
        info, options, chosen, precision_options, registry, plugins
    )
    return Connection(settings, cluster, info, chosen, options, backend, active, resolved, registry)


def checked(info: ClusterInfo) -> ClusterInfo:
    """``info`` if its numbers are consistent; else an error naming the variable and the fix."""
    where = f"(from {info.source})"
    if info.world_size < 1:
        raise ConfigurationError(
            f"World size {info.world_size} {where} is not a number of processes; expected 1 or "
            f"more. Fix WORLD_SIZE, or unset RANK and WORLD_SIZE to run one process."
        )
    if not 0 <= info.rank < info.world_size:
        raise ConfigurationError(
            f"Rank {info.rank} {where} is outside the world of {info.world_size} processes; "
            f"expected 0 to {info.world_size - 1}. Fix RANK/WORLD_SIZE (a rank that does not "
            f"exist would wait for the others forever)."
        )
    if info.local_rank < 0 or info.node_rank < 0:
        raise ConfigurationError(
            f"Local rank {info.local_rank} / node rank {info.node_rank} {where} is negative; "
            f"expected 0 or more. Fix LOCAL_RANK/GROUP_RANK."
        )
    return info


def detect(env: Mapping[str, str] | None = None) -> ClusterInfo:
    """Ask the installed cluster-environment plugins who this process is (torchrun's own answer
    first inside its workers, ``RANK``/``WORLD_SIZE`` last: `torchplug.plugins.torchrun`);
    rank 0 of 1 when none answers. The answer is checked for consistency.

    Args:
        env: The environment to read (``os.environ`` when not given).
    """
    env = dict(os.environ if env is None else env)
    answer = manager.get_registry().pm.hook.torchplug_cluster_environment(env=env)
    return checked(answer) if answer is not None else ClusterInfo()


def load_extension(module: str) -> object:
    """``Engine(plugins=["my_pkg.guard"])``: the module of that name (a class in it is not
    guessed: the module itself is the plugin), imported from the current directory too."""
    try:
        return discovery.import_here(module)
    except ImportError as exc:
        raise PluginError(
            f"Extension plugin module '{module}' (Engine(plugins=[...])) could not be imported: "
            f"{exc}. Expected a module importable as `import {module}` from the current "
            f"directory ({os.getcwd()}) or an installed package; or pass the plugin object."
        ) from exc


class HookFunction:
    """One hook function given as a plugin (``Engine(plugins=[torchplug_backward])``), as a
    module holding only it would be: without this, pluggy would find no hook on a function
    object and the Engine would run without it, silently."""

    def __init__(self, function: Callable[..., Any]) -> None:
        name = function.__name__
        if not name.startswith("torchplug_"):
            raise ConfigurationError(
                f"plugins got the function {function.__module__}.{function.__qualname__}, which "
                f"is not a hook: a hook function is named after the hook it implements "
                f"(torchplug_backward, torchplug_optimizer_step, ...; docs/hooks.md lists them) "
                f"and decorated with @torchplug.plugin.hookimpl. Rename it, or pass the module "
                f"or object that holds your hooks."
            )
        setattr(self, name, function)
        self.__name__ = f"{function.__module__}.{function.__qualname__}"

    def __repr__(self) -> str:
        return f"<hook function {self.__name__}>"
