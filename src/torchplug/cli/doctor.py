"""``torchplug doctor``: versions, devices, cluster, every setting with its source, checked."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def doctor() -> int:
    """Print what torchplug sees; exit 1 when a resolved setting is invalid (a job would fail)."""
    import pluggy
    import torch

    import torchplug
    from torchplug.core import cluster, config
    from torchplug.core.errors import TorchplugError
    from torchplug.core.manager import get_registry

    print("versions")
    print(f"  python     {platform.python_version()} ({sys.executable})")
    print(f"  torchplug  {torchplug.__version__}")
    print(f"  torch      {torch.__version__}")
    print(f"  pluggy     {pluggy.__version__}")
    for package in ("deepspeed", "fairscale", "torch_xla", "safetensors"):
        print(f"  {package:<10} {_version(package)}")
    print("devices")
    print(f"  cpu        {os.cpu_count()} cores")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            print(f"  cuda:{i}     {torch.cuda.get_device_name(i)}")
    else:
        print("  cuda       none")
    invalid: list[str] = []
    try:
        env = cluster.detect()
    except TorchplugError as exc:
        invalid.append(f"cluster environment: {exc}")
        env = cluster.ClusterInfo(source="invalid (see below)")
    print("cluster environment")
    print(f"  detected by  {env.source}")
    for field in (
        "rank",
        "world_size",
        "local_rank",
        "node_rank",
        "num_nodes",
        "master_addr",
        "master_port",
    ):
        print(f"  {field:<12} {getattr(env, field)}")
    registry = get_registry()
    print("settings (value, and where it came from)")
    try:
        settings = config.resolve(canonical=lambda n: registry.canonical(n) or n)
    except TorchplugError as exc:
        settings = None
        invalid.append(f"settings: {exc}")
    if settings is not None:
        for name, value, source in settings.rows():
            shown = value
            if name == "strategy" and value == "auto":
                shown = f"auto -> {'ddp' if env.world_size > 1 else 'single'}"
            print(f"  {name:<10} {shown!s:<24} {source}")
        invalid += config.problems(settings, registry, env.world_size)
    print("plugins")
    print(f"  strategies usable here: {', '.join(registry.usable_names()) or 'none'}")
    for name, error in sorted(registry.errors.items()):
        print(f"  failed: {name}: {error}")
    if invalid:
        print("invalid")
        for problem in invalid:
            print(f"  {problem}")
        print(f"torchplug doctor: {len(invalid)} invalid setting(s); see 'invalid' above.")
        return 1
    return 0
