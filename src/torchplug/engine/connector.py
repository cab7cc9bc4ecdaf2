"""Settings -> selection: which strategy and precision run, with which options and plugins.

The one place ``strategy="auto"`` is decided (`auto_strategy`): the Engine, the launcher's
and doctor's check (`torchplug.engine.config.problems`) and doctor's listing all ask it, so the
three cannot disagree. Like Fabric's ``_Connector``, this module turns resolved settings into
choices and refuses what cannot run here; the Engine then only runs what it picked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torchplug.contract import manager
from torchplug.contract.errors import ConfigurationError
from torchplug.contract.types import ClusterInfo, StrategyInfo, resolve_options
from torchplug.engine import config
from torchplug.engine.config import auto_strategy, is_auto  # noqa: F401 - re-exported


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


def strategy_options(
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
                f"plugins takes plugin objects or module names, got "
                f"{type(plugin).__name__} {plugin!r}. Pass e.g. plugins=['my_module'] or "
                f"plugins=[MyExtension()]."
            )
    active += [manager.load_extension(p) if isinstance(p, str) else p for p in plugins]
    return backend, active, resolved
