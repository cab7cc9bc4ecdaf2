"""``torchplug doctor``: versions, devices, cluster, every setting with its source, checked."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
from importlib import metadata


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _indented(rows: list[list[str]]) -> str:
    """``rows`` as left-aligned columns, indented by two spaces (long names stay aligned)."""
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def doctor(plugins: list[str] | None = None) -> int:
    """Print what torchplug sees; exit 1 when a resolved setting is invalid (a job would fail),
    2 when an in-house ``--plugin`` module cannot be loaded."""
    import pluggy
    import torch

    import torchplug
    from torchplug.contract.errors import TorchplugError
    from torchplug.contract.manager import get_registry, import_plugin_module
    from torchplug.engine import config, connector
    from torchplug.features import metrics

    for module in plugins or ():
        try:
            import_plugin_module(get_registry(), module, strict=True)
        except TorchplugError as exc:
            print(f"torchplug doctor: {exc}", file=sys.stderr)
            return 2

    print("versions")
    versions = [
        ["python", f"{platform.python_version()} ({sys.executable})"],
        ["torchplug", torchplug.__version__],
        ["torch", torch.__version__],
        ["pluggy", pluggy.__version__],
    ]
    versions += [[p, _version(p)] for p in ("deepspeed", "fairscale", "torch_xla", "safetensors")]
    print(_indented(versions))
    print("devices")
    devices = [["cpu", f"{os.cpu_count()} cores"]]
    if torch.cuda.is_available():
        devices += [
            [f"cuda:{i}", torch.cuda.get_device_name(i)] for i in range(torch.cuda.device_count())
        ]
    else:
        devices.append(["cuda", "none"])
    print(_indented(devices))
    invalid: list[str] = []
    try:
        env = connector.detect()
    except TorchplugError as exc:
        invalid.append(f"cluster environment: {exc}")
        env = torchplug.ClusterInfo(source="invalid (see below)")
    print("cluster environment")
    print(f"  detected by  {env.source}")
    fields = ("rank", "world_size", "local_rank", "node_rank", "num_nodes")
    fields += ("master_addr", "master_port")
    print(_indented([[field, str(getattr(env, field))] for field in fields]))
    registry = get_registry()
    print("settings (value, and where it came from)")
    try:
        settings = config.resolve(canonical=lambda n: registry.canonical(n) or n)
    except TorchplugError as exc:
        settings = None
        invalid.append(f"settings: {exc}")
    if settings is not None:
        shown_settings = settings
        named = str(settings.strategy.value).strip().lower()
        if connector.is_auto(named):
            named = connector.auto_strategy(env.world_size)
        chosen = registry.canonical(named)
        if chosen is not None:  # the options in effect for the strategy these settings pick
            shown_settings = dataclasses.replace(settings)
            shown_settings.for_strategy(registry.strategies[chosen], registry.canonical)
        rows = []
        known = {o.name for info in registry.strategies.values() for o in info.options}
        ours = {o.name for o in registry.strategies[chosen].options} if chosen else set()
        unused = config.UNUSED_NOTE
        for name, value, source in shown_settings.rows():
            shown = value
            if name == "strategy" and value == "auto":
                shown = f"auto -> {connector.auto_strategy(env.world_size)}"
            option = name.removeprefix("options.") if name.startswith("options.") else None
            if option is not None and source.endswith(unused) and option not in known:
                source = source.removesuffix(unused) + "(an option of no installed strategy: "
                source += "invalid, below)"
            elif (
                chosen and option is not None and not source.endswith(unused) and option not in ours
            ):
                source += f" (not an option of {chosen}: invalid, below)"
            rows.append([name, str(shown), source])
        rows += [[key, str(s.value), s.source] for key, s in settings.file_sizes.items()]
        loggers, source = metrics.requested(None, from_file=settings.file_loggers)
        rows.append(["loggers", ", ".join(map(str, loggers)) or "none", source])
        log_dir = os.environ.get(metrics.LOG_DIR_ENV)
        rows.append(
            ["log_dir", log_dir, f"environment {metrics.LOG_DIR_ENV}"]
            if log_dir
            else ["log_dir", metrics.DEFAULT_LOG_DIR, "default (Engine(log_dir=...) wins)"]
        )
        print(_indented(rows))
        invalid += config.problems(settings, registry, env.world_size)
    print("plugins")
    print(f"  strategies usable here: {', '.join(registry.usable_names()) or 'none'}")
    from torchplug.cli.plugins import loading_state

    for line in loading_state(registry):
        print(f"  {line}")
    for name, error in sorted(registry.errors.items()):
        print(f"  not loaded: {name}: {error}")
    if invalid:
        print("invalid")
        for problem in invalid:
            print(f"  {problem}")
        print(f"torchplug doctor: {len(invalid)} invalid setting(s); see 'invalid' above.")
        return 1
    return 0
