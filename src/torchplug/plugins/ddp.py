"""``ddp``: torch DistributedDataParallel. gloo on CPU, nccl on CUDA, device from LOCAL_RANK."""

from __future__ import annotations

import contextlib
import datetime
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from torchplug.core.cluster import ClusterInfo
from torchplug.core.engine import Engine, Runtime
from torchplug.core.errors import ConfigurationError
from torchplug.core.registry import Option, StrategyInfo
from torchplug.core.spec import hookimpl
from torchplug.core.strategy import Strategy
from torchplug.plugins.single import default_device


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


_DDP_DEFAULTS = {
    "find_unused_parameters": False,
    "static_graph": False,
    "gradient_as_bucket_view": False,
    "broadcast_buffers": True,
    "bucket_cap_mb": 25.0,
}


class DDPStrategy(Strategy):
    def __init__(
        self,
        process_group_backend: str | None = None,
        timeout: float = 1800.0,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        chosen = {
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "broadcast_buffers": broadcast_buffers,
            "bucket_cap_mb": bucket_cap_mb,
        }
        # Pass only what differs from DDP's defaults: names get deprecated across torch versions.
        self.ddp_kwargs = {k: v for k, v in chosen.items() if v != _DDP_DEFAULTS[k]}
        self.owns_process_group = False

    @hookimpl
    def torchplug_setup(self, engine: Engine, cluster: ClusterInfo) -> Runtime:
        device = default_device(cluster.local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            port = cluster.master_port
            if port is None:
                if cluster.world_size > 1:
                    raise ConfigurationError(
                        f"Strategy 'ddp' with world size {cluster.world_size} needs MASTER_PORT "
                        f"(and MASTER_ADDR). Start the script with `torchplug launch` or "
                        f"torchrun, which set them."
                    )
                port = free_port()
            host = cluster.master_addr
            host = f"[{host}]" if ":" in host else host
            dist.init_process_group(
                backend=self.process_group_backend or ("nccl" if device.type == "cuda" else "gloo"),
                init_method=f"tcp://{host}:{port}",
                rank=cluster.rank,
                world_size=cluster.world_size,
                timeout=datetime.timedelta(seconds=self.timeout),
            )
            self.owns_process_group = True
        return Runtime(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=cluster.local_rank,
            device=device,
            node_rank=cluster.node_rank,
        )

    @hookimpl
    def torchplug_wrap(
        self, engine: Engine, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(engine.device)
        device_ids = [engine.device.index] if engine.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs), optimizers

    @hookimpl
    def torchplug_no_sync(
        self, engine: Engine, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[None]:
        no_sync = getattr(model, "no_sync", None)
        if no_sync is None:
            raise ConfigurationError(
                f"no_sync() needs the model returned by engine.setup(), got a "
                f"{type(model).__name__}. Pass the wrapped model."
            )
        return no_sync()

    @hookimpl
    def torchplug_teardown(self, engine: Engine) -> None:
        if self.owns_process_group and dist.is_initialized():
            # The process group's C++ destructor runs later, when the DDP module is freed, and
            # joins gloo's worker threads while holding the GIL. A worker still releasing the
            # last collective's work needs the GIL too: a deadlock (seen with torch 2.13). So:
            # the barrier keeps rank 0's store up until every rank is done, and the sleep gives
            # up the GIL long enough for the workers to drop their finished work.
            dist.barrier()
            dist.destroy_process_group()
            time.sleep(0.05)
        self.owns_process_group = False


@hookimpl
def torchplug_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(
        StrategyInfo(
            name="ddp",
            aliases=("distributed-data-parallel",),
            factory=DDPStrategy,
            description="torch DistributedDataParallel: full replicas, gradients all-reduced.",
            options=(
                Option(
                    "process_group_backend",
                    (str, type(None)),
                    None,
                    "torch.distributed backend; default nccl on CUDA, gloo on CPU",
                ),
                Option("timeout", float, 1800.0, "seconds before a collective gives up"),
                Option("find_unused_parameters", bool, False, "see torch DDP"),
                Option("static_graph", bool, False, "see torch DDP"),
                Option("gradient_as_bucket_view", bool, False, "see torch DDP"),
                Option("broadcast_buffers", bool, True, "see torch DDP"),
                Option("bucket_cap_mb", float, 25.0, "see torch DDP"),
            ),
        )
    )
