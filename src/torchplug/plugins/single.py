"""``single``: one process, one device, no process group. The smallest complete backend."""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchplug.plugin import (
    ClusterInfo,
    HookContext,
    Option,
    Runtime,
    Strategy,
    StrategyInfo,
    default_device,
    hookimpl,
    replicated,
)


def check_device(value: str | None) -> str | None:
    """Why ``value`` names no device this machine has, or ``None``."""
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        return f"is not a device name: {value!r}; expected e.g. 'cpu', 'cuda' or 'cuda:1'"
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return f"asks for {value!r}, but this machine has no CUDA device; expected 'cpu'"
        if device.index is not None and device.index >= count:
            return (
                f"asks for {value!r}, but this machine has {count} CUDA device(s); expected "
                f"an index below {count}"
            )
    elif device.type not in ("cpu", "meta") and not hasattr(torch, device.type):
        return f"asks for device type {device.type!r}, which this torch build does not know"
    return None


class SingleDevice(Strategy):
    def __init__(self, device: str | None = None) -> None:
        self.device = torch.device(device) if device else None

    @hookimpl
    def torchplug_setup(self, engine: HookContext, cluster: ClusterInfo) -> Runtime:
        device = self.device or default_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return Runtime(rank=0, world_size=1, local_rank=0, device=device)


@hookimpl
def torchplug_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(
        StrategyInfo(
            name="single",
            aliases=("single-device", "none"),
            factory=SingleDevice,
            description="One process on one device (the first GPU, else the CPU).",
            options=(
                Option(
                    "device",
                    (str, type(None)),
                    None,
                    "device to run on, e.g. 'cuda:1'",
                    validate=check_device,
                ),
            ),
            distributed=False,
            memory=replicated,
        )
    )
