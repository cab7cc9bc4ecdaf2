"""``torchplug plugins``: what is installed, what is usable here, and why not."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns under a dashed header line."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def plugins(verbose: bool = False, modules: Sequence[str] = ()) -> int:
    """Print the strategies and precisions with their provider and status; 2 when an in-house
    plugin module of ``modules`` (``--plugin``) cannot be loaded.

    Args:
        verbose: Also each strategy's options, capabilities and hooks.
        modules: In-house plugin modules to import and register first.
    """
    from torchplug.contract.errors import TorchplugError
    from torchplug.contract.manager import STRATEGY_HOOKS, get_registry, import_plugin_module

    registry = get_registry()
    for module in modules:
        try:
            import_plugin_module(registry, module, strict=True)
        except TorchplugError as exc:
            print(f"torchplug plugins: {exc}", file=sys.stderr)
            return 2
    by_extensions = extension_answers(registry)
    rows = []
    for name, info in sorted(registry.strategies.items()):
        reason = info.unusable_reason()
        provider = info.distribution or "in-house"
        if info.version:
            provider += f" {info.version}"
        gap = unanswered_hooks(registry, info.factory, by_extensions)
        if reason is None and gap:
            blocked = blocked_defaults(registry)
            named = ", ".join(gap) if len(gap) <= 3 else f"{len(gap)} action hooks (-v names them)"
            status = f"unusable: leaves {named} unanswered" + (
                f" ({', '.join(blocked)}, the default, is blocked): remove it from "
                f"TORCHPLUG_BLOCK_PLUGINS, or answer them in the backend or a plugin"
                if blocked
                else ": answer them in the backend or a plugin"
            )
        elif reason is None:
            status = "usable"
        elif info.problem:
            status = reason  # "broken: ..."
        else:
            status = f"unusable: {reason}"
        rows.append([name, ", ".join(info.aliases) or "-", f"{provider} ({info.provider})", status])
    print(table(rows, ["strategy", "aliases", "provided by", "status"]))
    if registry.precisions:
        print()
        print(
            table(
                [
                    [p, i.name, f"{i.distribution or 'in-house'} {i.version}".strip()]
                    for p, i in sorted(registry.precisions.items())
                ],
                ["precision", "plugin", "provided by"],
            )
        )
    if registry.loggers:
        print()
        print(
            table(
                [
                    [
                        name,
                        f"{i.distribution or 'in-house'} {i.version}".strip() + f" ({i.provider})",
                        "usable" if (r := i.unusable_reason()) is None else f"unusable: {r}",
                    ]
                    for name, i in sorted(registry.loggers.items())
                ],
                ["logger", "provided by", "status"],
            )
        )
    environments = cluster_environments(registry)
    if environments:
        print()
        print(table(environments, ["cluster environment (asked in order)", "provided by", "here"]))
    if verbose:
        for name, info in sorted(registry.strategies.items()):
            print(f"\n{name}: {info.description}")
            caps = [
                c
                for c in ("shards_parameters", "shards_optimizer", "owns_precision")
                if getattr(info, c)
            ]
            caps += ["cpu"] if info.supports_cpu else []
            caps += ["cuda"] if info.supports_cuda else []
            runs = []
            for precision in info.precisions:
                why = registry.precision_unavailable(info, precision)
                runs.append(
                    precision
                    if why is None
                    else f"{precision} ({why.removeprefix(precision + ' ')})"
                )
            print(f"  capabilities: {', '.join(caps) or '-'}; precisions: {', '.join(runs)}")
            print(f"  launcher: {info.launcher}; requires: {', '.join(info.requires) or '-'}")
            if info.extends:
                print(f"  extends: {info.extends}")
            for opt in info.options:
                print(f"  option {opt.name}: {opt.type_name()} = {opt.default!r}  {opt.help}")
            hooks = hook_answers(registry, info.factory, by_extensions)
            if hooks:
                print("  hooks:")
                for hook, where in hooks:
                    print(f"    {hook}: {where}")
            elif info.factory is not None:
                print("  hooks: (made by a function: listed once an Engine creates it)")
        print("\nplugins and their hooks:")
        for plugin_name, plugin in sorted(registry.pm.list_name_plugin(), key=lambda x: str(x[0])):
            if plugin is None:  # pluggy keeps a blocked name with no plugin
                print(f"  {plugin_name}: blocked (never imported)")
                continue
            hooks = [h.name for h in registry.pm.get_hookcallers(plugin) or []]
            extension = " (extension: joins every Engine)" if set(hooks) & STRATEGY_HOOKS else ""
            print(f"  {plugin_name}{extension}: {', '.join(sorted(hooks))}")
    if registry.errors:
        print("\nplugins not loaded (or broken), and why:")
        for name, error in sorted(registry.errors.items()):
            print(f"  {name}: {error}")
    print("\nloading:")
    for line in loading_state(registry):
        print(f"  {line}")
    return 0


def backend_class(factory: object) -> type | None:
    """The class a strategy's factory makes: the factory itself, a ``functools.partial``'s or
    ``functools.wraps``' target, or the class its return annotation names; ``None`` when none
    of these says (a lambda, an unannotated function)."""
    import functools
    import inspect
    import typing

    for _ in range(8):  # partials of wrappers of ...
        if inspect.isclass(factory):
            return factory
        if isinstance(factory, functools.partial):
            factory = factory.func
        elif inspect.isclass(getattr(factory, "__wrapped__", None)):
            factory = factory.__wrapped__  # type: ignore[attr-defined]
        else:
            break
    try:
        made = typing.get_type_hints(factory).get("return")
    except Exception:  # an annotation naming what cannot be resolved here: unknown
        return None
    return made if inspect.isclass(made) else None


#: What `hook_answers` says of an action hook nothing answers (the Engine refuses to start).
UNANSWERED = "UNANSWERED"


def blocked_defaults(registry: object) -> list[str]:
    """The built-in default-answer plugins (``torch_distributed``, ``checkpoint``) blocked here."""
    from torchplug.contract.manager import DEFAULT_ANSWERS

    return sorted(DEFAULT_ANSWERS & registry.blocked)  # type: ignore[attr-defined]


def extension_answers(registry: object) -> dict[str, list[str]]:
    """Hook name -> the registered extensions answering it (not wrapping it), labelled; the
    extensions join every Engine, so this is read once for every strategy listed."""
    from torchplug.contract.manager import DEFAULT_ANSWERS, qualified_name

    pm = registry.pm  # type: ignore[attr-defined]
    answers: dict[str, list[str]] = {}
    for plugin in registry.extensions():  # type: ignore[attr-defined]
        name = pm.get_name(plugin) or qualified_name(plugin)
        label = f"{name} (the built-in default, trylast)" if name in DEFAULT_ANSWERS else name
        for caller in pm.get_hookcallers(plugin) or []:
            if any(
                i.plugin is plugin and not (i.wrapper or i.hookwrapper)
                for i in caller.get_hookimpls()
            ):
                answers.setdefault(caller.name, []).append(label)
    return answers


def hook_answers(
    registry: object, factory: object, by_extensions: dict[str, list[str]] | None = None
) -> list[tuple[str, str]]:
    """For a strategy whose backend class is known (`backend_class`): each strategy hook with
    what answers it in full precision, so an author sees what a subclass answers and what it
    leaves to others. The class (``module:qualname``) whose method answers it (what it inherits
    from `Strategy` is not an answer), else the registered extensions that do (the built-in
    default plugins among them), else, for an action hook, ``UNANSWERED`` (the Engine refuses to
    start). Empty when the class is not known: the object is known only once made.
    ``by_extensions``: `extension_answers`, when the caller lists many strategies."""
    from torchplug.contract.manager import ACTION_HOOKS, STRATEGY_HOOKS, qualified_name

    factory = backend_class(factory)
    if factory is None:
        return []
    if by_extensions is None:
        by_extensions = extension_answers(registry)
    blocked = blocked_defaults(registry)
    found = []
    for hook in sorted(STRATEGY_HOOKS):
        owner = next((c for c in factory.__mro__ if hook in vars(c)), None)
        method = vars(owner)[hook] if owner is not None else None
        if (
            method is not None
            and not getattr(method, "torchplug_inherited_default", False)
            and (
                not _wraps(method)  # a wrapper runs around the answer: it is none itself
            )
        ):
            found.append((hook, qualified_name(owner)))
        elif hook in by_extensions:
            found.append((hook, ", ".join(by_extensions[hook])))
        elif hook in ACTION_HOOKS:
            why = f" (blocked: {', '.join(blocked)})" if blocked else ""
            found.append((hook, f"{UNANSWERED}{why}"))
    return found


def _wraps(method: object) -> bool:
    """Whether ``method`` is a hook wrapper (``hookimpl(wrapper=True)``), which answers nothing."""
    from torchplug.contract.spec import PROJECT

    options = getattr(method, f"{PROJECT}_impl", None) or {}
    return bool(options.get("wrapper") or options.get("hookwrapper"))


def unanswered_hooks(
    registry: object, factory: object, by_extensions: dict[str, list[str]] | None = None
) -> list[str]:
    """The action hooks a strategy's backend class would leave unanswered in full precision
    (`hook_answers`): the Engine refuses such a strategy at start, and the listing and the
    launcher say so beforehand."""
    answers = hook_answers(registry, factory, by_extensions)
    return [hook for hook, where in answers if where.startswith(UNANSWERED)]


def cluster_environments(registry: object) -> list[list[str]]:
    """The plugins answering ``torchplug_cluster_environment``, in the order they are asked
    (the first answer wins), each with what it answers in this process's environment."""
    import os

    pm = registry.pm  # type: ignore[attr-defined]
    rows = []
    env = dict(os.environ)
    found_answer = False
    for impl in reversed(pm.hook.torchplug_cluster_environment.get_hookimpls()):
        name = pm.get_name(impl.plugin) or "?"
        distribution, version = registry.origins.get(name, ("", ""))  # type: ignore[attr-defined]
        provider = f"{distribution or 'in-house'} {version}".strip()
        try:
            answer = impl.function(env=env)
        except Exception as exc:  # a broken plugin is shown, not fatal here
            here = f"broken: {type(exc).__name__}: {exc}"[:120]
        else:
            if answer is None:
                here = "not this environment"
            elif found_answer:
                here = "would answer, but an earlier one wins"
            else:
                here = f"answers: rank {answer.rank} of {answer.world_size}" + (
                    f" ({answer.source})" if getattr(answer, "source", "") else ""
                )
                found_answer = True
        rows.append([name, provider, here])
    if not found_answer:
        rows.append(["(none answers)", "torchplug", "rank 0 of 1 (single process)"])
    return rows


def loading_state(registry: Any) -> list[str]:
    """Lines saying how plugins are loaded here (autoload, allow-list, blocks) and which
    installed plugins that hides, for ``torchplug plugins`` and ``doctor``."""
    from torchplug.contract import discovery

    autoload = (
        "off (TORCHPLUG_DISABLE_PLUGIN_AUTOLOAD=1)"
        if discovery.truthy("TORCHPLUG_DISABLE_PLUGIN_AUTOLOAD")
        else "on"
    )
    allow = ", ".join(discovery.env_list("TORCHPLUG_PLUGINS")) or "none (every installed plugin)"
    lines = [f"autoload: {autoload}", f"allow-list (TORCHPLUG_PLUGINS): {allow}"]
    if registry.blocked:
        lines.append(f"blocked: {', '.join(sorted(registry.blocked))}")
        lines += _unmatched_blocks(registry)
    lines += [f"hidden: {name}: {why}" for name, why in sorted(registry.hidden.items())]
    return lines


def _unmatched_blocks(registry: Any) -> list[str]:
    """A line for each blocked name that no plugin here has: a block names a plugin (an entry
    point's name, a built-in's, a module given to ``--plugin``), not the package providing it,
    and one naming nothing would otherwise look as if it took effect."""
    from torchplug.contract import discovery
    from torchplug.util.text import did_you_mean

    found = discovery.candidates()
    registered = {name for name, plugin in registry.pm.list_name_plugin() if plugin is not None}
    known = {c.name for c in found} | registered
    by_distribution: dict[str, list[str]] = {}
    for candidate in found:
        distribution = candidate.origin()[0]
        if distribution:
            by_distribution.setdefault(distribution.lower(), []).append(candidate.name)
    lines = []
    for name in sorted(set(registry.blocked) - known):
        provides = by_distribution.get(name.lower())
        hint = (
            f"the package {name} provides the plugin(s) {', '.join(sorted(provides))}: block those"
            if provides
            else (did_you_mean(name, known) + f" Plugin names here: {', '.join(sorted(known))}")
        ).strip()
        lines.append(f"blocked but matching no plugin: {name} ({hint})")
    return lines
