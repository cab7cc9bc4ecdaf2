"""Finding plugins: torchplug's own, installed entry points, in-house modules.

Every plugin is found the one way: its entry point in the ``torchplug`` group. torchplug's own
(declared in its pyproject.toml as a third party declares its own) load first, then third-party
entry points, then ``check_pending``, then the ``TORCHPLUG_PLUGIN_MODULES``. The environment
controls (``TORCHPLUG_DISABLE_PLUGIN_AUTOLOAD``, ``TORCHPLUG_PLUGINS``, ``TORCHPLUG_BLOCK_PLUGINS``,
``TORCHPLUG_PLUGIN_MODULES``) are in docs/plugins.md. A plugin that fails to import is recorded
by name with its error, and the rest keep loading.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

import pluggy

from torchplug.contract.errors import PluginError
from torchplug.contract.validation import plugin_label
from torchplug.util.environ import env_list, truthy
from torchplug.util.records import Record

if TYPE_CHECKING:
    from torchplug.contract.registry import Registry

ENTRY_POINT_GROUP = "torchplug"
#: In-house plugin modules to import into every registry (``torchplug launch --plugin``).
PLUGIN_MODULES_ENV = "TORCHPLUG_PLUGIN_MODULES"
OWN_DISTRIBUTION = "torchplug"

#: torchplug's own plugins every Engine needs, loaded whatever the allow-list says (a block
#: still applies): the hooks' default answers, the checkpoint's save and load, the default strategy.
MINIMAL_PLUGINS = frozenset(
    {"torch_distributed", "checkpoint", "single", "torchrun", "environment"}
)


def _is_own(ep: metadata.EntryPoint, names: dict[int, str]) -> bool:
    """From torchplug's own distribution; ``names`` caches each distribution's name (reading it
    parses its METADATA file, and each entry point carries its distribution)."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ep.value.startswith("torchplug.")
    if id(dist) not in names:
        names[id(dist)] = dist.metadata["Name"].replace("_", "-").lower()
    return names[id(dist)] == OWN_DISTRIBUTION


@dataclass(frozen=True, eq=False, repr=False)
class Candidate(Record):
    """A plugin discovery may load: an installed entry point, torchplug's own or another
    distribution's."""

    name: str
    #: The module or ``module:attr`` it is loaded from (named when it fails to import).
    target: str
    load: Callable[[], object]
    #: From torchplug's own distribution: a built-in plugin.
    own: bool = True
    entry_point: metadata.EntryPoint | None = None

    def origin(self) -> tuple[str, str]:
        """(distribution, version) recorded for the plugin."""
        if self.own:
            from torchplug.util.version import VERSION as __version__

            return (OWN_DISTRIBUTION, __version__)
        dist = getattr(self.entry_point, "dist", None)
        return (dist.metadata["Name"], dist.version) if dist is not None else ("", "")


def candidates() -> list[Candidate]:
    """Every entry point of the ``torchplug`` group, torchplug's own first (they own their
    names), each name once. A checkout put on ``sys.path`` without being installed has no entry
    points: an error says to install it."""
    names: dict[int, str] = {}
    points = sorted(
        metadata.entry_points(group=ENTRY_POINT_GROUP),
        key=lambda ep: (not _is_own(ep, names), ep.name),  # built-ins first: they own their names
    )
    found: list[Candidate] = []
    seen: set[str] = set()
    for ep in points:
        own = _is_own(ep, names)
        if own and ep.name in seen:
            continue  # the same distribution seen twice on sys.path (an editable install)
        seen.add(ep.name)
        found.append(Candidate(ep.name, ep.value, ep.load, own, ep))
    if not any(c.own for c in found):
        raise PluginError(
            "torchplug's own plugins were not found: they are entry points of the installed "
            "torchplug distribution, and none is installed for this Python. Install torchplug "
            "(pip install torchplug, or pip install -e . in a checkout) instead of putting its "
            "source on PYTHONPATH."
        )
    return found


def builtin_modules() -> dict[str, str]:
    """torchplug's own plugins: entry-point name -> module (what ``hookdoc`` documents)."""
    return {c.name: c.target for c in candidates() if c.own}


def hidden(candidate: Candidate, registry: Registry) -> str | None:
    """Why an installed entry point is not loaded here (blocked, autoload off, not in the
    allow-list), or ``None``. torchplug's own are subject to the block and allow lists as any
    plugin is, `MINIMAL_PLUGINS` to the block list only."""
    name = candidate.name
    if name in registry.blocked or registry.pm.is_blocked(name):
        return "blocked (TORCHPLUG_BLOCK_PLUGINS or torchplug.block)"
    if not candidate.own and truthy("TORCHPLUG_DISABLE_PLUGIN_AUTOLOAD"):
        return "autoload is off (TORCHPLUG_DISABLE_PLUGIN_AUTOLOAD=1)"
    allow = set(env_list("TORCHPLUG_PLUGINS"))
    if allow and name not in allow and not (candidate.own and name in MINIMAL_PLUGINS):
        return f"not in the allow-list TORCHPLUG_PLUGINS={','.join(sorted(allow))}"
    return None


def discover(registry: Registry) -> None:
    """Load every plugin `candidates` lists, in one loop: a blocked one is never imported (an
    entry point is recorded as hidden, with the reason); one that fails to import or to
    register is recorded by name with its error and warned about, and the rest load."""
    for candidate in candidates():
        name = candidate.name
        why = hidden(candidate, registry)
        if why is not None:
            if not (candidate.own and why.startswith("blocked")):
                registry.hidden[name] = why  # (a blocked built-in is skipped without a word)
            continue
        if registry.pm.has_plugin(name):
            continue
        origin = candidate.origin()
        try:
            plugin = candidate.load()
        except Exception as exc:
            registry.errors[name] = f"{type(exc).__name__}: {exc}"
            what = "torchplug's built-in plugin" if candidate.own else "torchplug plugin"
            warnings.warn(
                f"{what} '{name}' ({candidate.target}) failed to import and is "
                f"skipped: {type(exc).__name__}: {exc}",
                stacklevel=2,
            )
            continue
        try:
            registry.add(plugin, name=name, origin=origin, strict=False)
        except PluginError as exc:
            registry.errors[name] = str(exc)
            warnings.warn(str(exc), stacklevel=2)


def check_pending(registry: Registry) -> None:
    """pluggy's check that every hookimpl matches a hook of the specification; a plugin
    that fails it is recorded and removed (one broken plugin must not break the others)."""
    try:
        registry.pm.check_pending()
    except pluggy.PluginValidationError as exc:
        name = registry.pm.get_name(exc.plugin) or str(exc.plugin)
        label = plugin_label(exc.plugin, name)
        registry.errors[name] = (
            f"{exc}. Fix the hook's name as docs/hooks.md lists them, or remove its marker."
        )
        warnings.warn(f"torchplug plugin '{label}' is skipped: {exc}", stacklevel=2)
        registry.remove(name)
        check_pending(registry)


def import_here(module: str) -> Any:
    """``import module``, the current directory first on ``sys.path`` (as ``python -m`` has)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(module)


def import_plugin_module(registry: Registry, module: str, strict: bool = True) -> None:
    """Import an in-house plugin module by name (the working directory on ``sys.path`` too)
    and register it unless importing it registered it already.

    ``strict``: raise what went wrong (``torchplug launch --plugin``); else record and warn, as
    for entry-point plugins (the processes the launcher started).
    """
    try:
        plugin = import_here(module)
        if not registry.pm.is_registered(plugin) and registry.pm.get_plugin(module) is None:
            registry.add(plugin, name=module)
    except Exception as exc:
        if strict:
            stem = module.rsplit("/", 1)[-1].removesuffix(".py")
            raise PluginError(
                f"Plugin module '{module}' could not be loaded: {type(exc).__name__}: {exc}. "
                f"Expected a module importable as `import {module}` from the current directory "
                f"({os.getcwd()}) or an installed package; check the name (a module name, "
                f"not a file path"
                + (f": --plugin {stem}" if stem != module else "")
                + ") and that it imports cleanly."
            ) from exc
        registry.errors[module] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"torchplug plugin module '{module}' ({PLUGIN_MODULES_ENV}) failed to load and is "
            f"skipped: {type(exc).__name__}: {exc}",
            stacklevel=2,
        )
