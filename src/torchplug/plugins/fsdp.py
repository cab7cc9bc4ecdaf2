"""``fsdp``: torch FSDP2 (``fully_shard`` on a device mesh). Parameters, gradients and optimizer
state are sharded across ranks; each shard unit is gathered only while it computes. The 1-D mesh
(dim ``"dp"``, every rank) is built once, when the Engine starts (``engine.mesh``), and every
``engine.setup`` of the job shards over it.

FSDP owns precision: ``precision="bf16"`` becomes a ``MixedPrecisionPolicy`` (bf16 compute and
all-gathers, fp32 gradient reduction and outputs) instead of the generic AMP wrapper.
Normalisation layers keep fp32 parameters and compute (their own units), as AMP runs them.

How FSDP2 is applied is `torchplug.plugins.sharding`'s, shared with ``tp``/``fsdp-tp``; its
helpers are re-exported here (``from torchplug.plugins.fsdp import shard_units`` keeps working).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from torchplug.contract.cluster import ClusterInfo
from torchplug.contract.spec import hookimpl
from torchplug.contract.types import Option, StrategyInfo
from torchplug.engine.engine import Engine, Runtime
from torchplug.features import memory
from torchplug.plugins import sharding
from torchplug.plugins.base import DEFAULT_TIMEOUT, DistributedStrategy, _distributed_options
from torchplug.plugins.sharding import (
    NORM_TYPES,
    finish_wrap,
    make_contiguous,
    shard_norms_in_fp32,
    shard_units,
)
from torchplug.util import capabilities

#: Names importable from here before they moved to `torchplug.plugins.sharding`.
__all__ = [
    "NORM_TYPES",
    "FSDPStrategy",
    "finish_wrap",
    "make_contiguous",
    "shard_norms_in_fp32",
    "shard_units",
    "torchplug_register_strategies",
]


class FSDPStrategy(DistributedStrategy):
    def __init__(
        self,
        process_group_backend: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        shard_classes: list[str] | tuple[str, ...] = (),
        min_params: int = 0,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
    ) -> None:
        super().__init__(process_group_backend, timeout)
        self.shard_classes = tuple(shard_classes)
        self.min_params = min_params
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload

    @hookimpl
    def torchplug_setup(self, engine: Engine, cluster: ClusterInfo) -> Runtime:
        """The process group, then the job's 1-D mesh over every rank (dim ``"dp"``)."""
        runtime = super().torchplug_setup(engine, cluster)
        return sharding.with_mesh(runtime, (runtime.world_size,), ("dp",))

    @hookimpl
    def torchplug_wrap(
        self, engine: Engine, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        names = {id(p): name for name, p in model.named_parameters()}
        if not self.cpu_offload and not any(p.is_meta for p in model.parameters()):
            model = model.to(engine.device)
        kwargs = sharding.fully_shard_kwargs(
            engine, sharding.job_mesh(engine), self.reshard_after_forward, self.cpu_offload
        )
        self.units = sharding.shard(model, kwargs, self.shard_classes, self.min_params)
        return finish_wrap(engine, model, optimizers, names, "fsdp")

    @hookimpl
    def torchplug_compile(
        self, engine: Engine, model: torch.nn.Module, options: dict[str, Any]
    ) -> torch.nn.Module:
        """Each FSDP unit compiled on its own (as torch recommends for FSDP2), else the model."""
        return sharding.compile_units(engine, model, getattr(self, "units", None), options)

    @hookimpl
    def torchplug_no_sync(
        self, engine: Engine, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[None]:
        return sharding.without_gradient_sync(model)

    @hookimpl
    def torchplug_clip_grad_norm(
        self,
        engine: Engine,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        norm_type: float,
    ) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
        return total.full_tensor() if isinstance(total, DTensor) else total


@hookimpl
def torchplug_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(
        StrategyInfo(
            name="fsdp",
            aliases=("fsdp2", "fully-sharded"),
            factory=FSDPStrategy,
            description="torch FSDP2: parameters, gradients and optimizer state sharded.",
            options=(
                *_distributed_options(),
                Option(
                    "shard_classes",
                    (list, tuple),
                    (),
                    "class names of submodules to shard as units, e.g. ['TransformerBlock']",
                ),
                Option("min_params", int, 0, "shard submodules holding at least this many params"),
                Option("reshard_after_forward", bool, True, "free gathered params after forward"),
                Option("cpu_offload", bool, False, "keep sharded params and grads on the CPU"),
            ),
            precisions=("32", "bf16"),
            owns_precision=True,
            precision_check=capabilities.gpu_check,
            shards_parameters=True,
            shards_optimizer=True,
            takes_meta_modules=True,
            memory=memory.fsdp2,
        )
    )
