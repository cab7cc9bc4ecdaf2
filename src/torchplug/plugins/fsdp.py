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
import math
from collections.abc import Callable
from typing import Any

import torch

from torchplug.plugin import (
    DEFAULT_TIMEOUT,
    NORM_TYPES,
    ClusterInfo,
    ConfigurationError,
    DistributedStrategy,
    HookContext,
    MemoryEstimate,
    MemoryQuery,
    Option,
    Runtime,
    StrategyInfo,
    UnusedParameters,
    ceil_div,
    clip_largest,
    compile_units,
    finish_wrap,
    fully_shard_kwargs,
    gpu_check,
    hookimpl,
    job_mesh,
    make_contiguous,
    refuse_sharded_twice,
    shard,
    shard_norms_in_fp32,
    shard_units,
    with_mesh,
    without_gradient_sync,
)

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
        reduce_scatter_unused_params: bool = False,
        dp_replicate: int = 1,
    ) -> None:
        super().__init__(process_group_backend, timeout)
        self.dp_replicate = dp_replicate
        self.shard_classes = tuple(shard_classes)
        self.min_params = min_params
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.unused = UnusedParameters(reduce_scatter_unused_params)

    @hookimpl
    def torchplug_setup(self, engine: HookContext, cluster: ClusterInfo) -> Runtime:
        """The process group, then the job's mesh: 1-D over every rank (dim ``"dp"``), or for
        HSDP (``dp_replicate=R``) 2-D ``("dp_replicate", "dp_shard")``: each parameter sharded
        over ``world_size / R`` consecutive ranks (a node's, where the all-gathers are cheap)
        and replicated over the ``R`` groups (FSDP2's own HSDP: the gradients' reduce-scatter
        inside a group, an all-reduce across groups)."""
        runtime = super().torchplug_setup(engine, cluster)
        r, world = self.dp_replicate, runtime.world_size
        if r < 1 or world % r:
            raise ConfigurationError(
                f"fsdp's dp_replicate={r} does not divide the {world} ranks into equal shard "
                f"groups. Give a divisor of the world size (e.g. dp_replicate=2 on 4 ranks: 2 "
                f"groups of 2 shards), or 1 for plain FSDP."
            )
        if r == 1:
            return with_mesh(runtime, (world,), ("dp",))
        return with_mesh(runtime, (r, world // r), ("dp_replicate", "dp_shard"))

    @hookimpl
    def torchplug_wrap(
        self, engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        refuse_sharded_twice(model, engine.strategy)
        names = {id(p): name for name, p in model.named_parameters()}
        if not self.cpu_offload and not any(p.is_meta for p in model.parameters()):
            model = model.to(engine.device)
        kwargs = fully_shard_kwargs(
            engine, job_mesh(engine), self.reshard_after_forward, self.cpu_offload
        )
        self.units = shard(model, kwargs, self.shard_classes, self.min_params)
        self.unused.watch(model)
        return finish_wrap(engine, model, optimizers, names, "fsdp")

    @hookimpl(wrapper=True)
    def torchplug_backward(
        self, engine: HookContext, loss: torch.Tensor, model: torch.nn.Module | None
    ) -> Any:
        """Ranks that used different parameters: refused before the step (`UnusedParameters`)."""
        result = yield
        self.unused.check(engine)
        return result

    @hookimpl
    def torchplug_compile(
        self, engine: HookContext, model: torch.nn.Module, options: dict[str, Any]
    ) -> torch.nn.Module:
        """Each FSDP unit compiled on its own (as torch recommends for FSDP2), else the model."""
        return compile_units(engine, model, getattr(self, "units", None), options)

    @hookimpl
    def torchplug_no_sync(
        self, engine: HookContext, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[None]:
        return self.unused.not_syncing(without_gradient_sync(model))

    @hookimpl
    def torchplug_clip_grad_norm(
        self,
        engine: HookContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        norm_type: float,
    ) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if math.isinf(norm_type):  # torch's refuses a rank whose shards are empty
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            return clip_largest(grads, max_norm, engine.reduce)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
        return total.full_tensor() if isinstance(total, DTensor) else total


def fsdp2_shard_numel(shape: tuple[int, ...], world_size: int) -> tuple[int, int]:
    """FSDP2's dim-0 sharding of one parameter over ``world_size`` ranks: ``(padded, rank0)``
    elements, where ``padded`` is each rank's storage (dim 0 padded up to a multiple of the
    world size, so every rank's shard has ``ceil(dim0 / world_size)`` rows) and ``rank0`` the
    elements rank 0, the fullest, holds (optimizer state is made the size of the unpadded
    shard)."""
    if not shape:
        return 1, 1
    rows = ceil_div(shape[0], world_size)
    rest = math.prod(shape[1:])
    return rows * rest, min(rows, shape[0]) * rest


def fsdp2_memory(query: MemoryQuery) -> MemoryEstimate:
    """torch FSDP2 (``fully_shard``): each parameter split on dim 0 over the ranks; parameters
    and gradients stored padded, optimizer state the size of the rank's unpadded rows. Sharded
    weights and gradients stay in the parameters' dtype under bf16 (FSDP computes in bf16 and
    reduces in fp32); the gathered bf16 copies exist only around each unit's forward/backward."""
    w = query.world_size // max(1, int(query.options.get("dp_replicate", 1) or 1))
    params = grads = state = 0
    for p in query.params:
        padded, rank0 = fsdp2_shard_numel(p.shape, w)
        params += padded * p.itemsize
        grads += padded * p.itemsize
        state += query.states * rank0 * p.itemsize
    steps = query.step_bytes * len(query.params) if query.states else 0
    notes = ["each unit's parameters are all-gathered whole around its forward and backward"]
    if query.options.get("cpu_offload"):
        notes.append("cpu_offload: parameters, gradients and optimizer state are on the CPU")
    return MemoryEstimate(params, grads, state + steps, notes=tuple(notes))


@hookimpl
def torchplug_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(
        StrategyInfo(
            name="fsdp",
            aliases=("fsdp2", "fully-sharded"),
            factory=FSDPStrategy,
            description="torch FSDP2: parameters, gradients and optimizer state sharded.",
            options=(
                *DistributedStrategy.strategy_options(),
                Option(
                    "shard_classes",
                    (list, tuple),
                    (),
                    "class names of submodules to shard as units, e.g. ['TransformerBlock']",
                ),
                Option("min_params", int, 0, "shard submodules holding at least this many params"),
                Option("reshard_after_forward", bool, True, "free gathered params after forward"),
                Option("cpu_offload", bool, False, "keep sharded params and grads on the CPU"),
                UnusedParameters.OPTION,
                Option("dp_replicate", int, 1, "HSDP: replicas of the sharded model (1: FSDP)"),
            ),
            precisions=("32", "bf16"),
            owns_precision=True,
            precision_check=gpu_check,
            # a model is sharded once (refuse_sharded_twice); ranks that use different
            # parameters: right with reduce_scatter_unused_params=True, else refused
            refuses=("reuse", "rank_dependent"),
            shards_parameters=True,
            shards_optimizer=True,
            takes_meta_modules=True,
            memory=fsdp2_memory,
        )
    )
