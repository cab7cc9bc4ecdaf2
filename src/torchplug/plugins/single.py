"""``single``: one process, one device, no process group. The smallest complete backend."""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchplug.core.cluster import ClusterInfo
from torchplug.core.engine import Engine, Runtime
from torchplug.core.registry import Option, StrategyInfo
from torchplug.core.spec import hookimpl
from torchplug.core.strategy import Strategy, default_device


class SingleDevice(Strategy):
    def __init__(self, device: str | None = None) -> None:
        self.device = torch.device(device) if device else None

    @hookimpl
    def torchplug_setup(self, engine: Engine, cluster: ClusterInfo) -> Runtime:
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
            options=(Option("device", (str, type(None)), None, "device to run on, e.g. 'cuda:1'"),),
            distributed=False,
        )
    )
