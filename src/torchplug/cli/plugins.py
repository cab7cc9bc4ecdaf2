"""``torchplug plugins``: what is installed, what is usable here, and why not."""

from __future__ import annotations


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns under a dashed header line."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def plugins(verbose: bool = False) -> int:
    """Print the strategies and precisions with their provider and status."""
    from torchplug.core.manager import STRATEGY_HOOKS, get_registry

    registry = get_registry()
    rows = []
    for name, info in sorted(registry.strategies.items()):
        reason = info.unusable_reason()
        provider = info.distribution or "in-house"
        if info.version:
            provider += f" {info.version}"
        rows.append(
            [
                name,
                ", ".join(info.aliases) or "-",
                f"{provider} ({info.provider})",
                "usable" if reason is None else f"unusable: {reason}",
            ]
        )
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
            print(
                f"  capabilities: {', '.join(caps) or '-'}; "
                f"precisions: {', '.join(info.precisions)}"
            )
            print(f"  launcher: {info.launcher}; requires: {', '.join(info.requires) or '-'}")
            for opt in info.options:
                print(f"  option {opt.name}: {opt.type_name()} = {opt.default!r}  {opt.help}")
        print("\nplugins and their hooks:")
        for plugin_name, plugin in sorted(registry.pm.list_name_plugin(), key=lambda x: str(x[0])):
            hooks = [h.name for h in registry.pm.get_hookcallers(plugin) or []]
            extension = " (extension: joins every Engine)" if set(hooks) & STRATEGY_HOOKS else ""
            print(f"  {plugin_name}{extension}: {', '.join(sorted(hooks))}")
    if registry.errors:
        print("\nplugins that failed to load:")
        for name, error in sorted(registry.errors.items()):
            print(f"  {name}: {error}")
    if registry.blocked:
        print(f"\nblocked: {', '.join(sorted(registry.blocked))}")
    return 0
