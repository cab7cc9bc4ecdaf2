"""FairScale backends (`pip install torchplug[fairscale]`); fairscale is imported when chosen.

``fairscale-oss``
    optimizer state sharded with ``fairscale.optim.OSS``; gradients all-reduced by torch DDP.
``fairscale-sdp``
    OSS plus ``ShardedDataParallel``: each gradient is reduced only to the rank owning its
    optimizer shard.
``fairscale-fsdp``
    FairScale's FullyShardedDataParallel; CUDA only (unusable elsewhere, with that reason).

Checkpoints consolidate the sharded optimizer state (OSS's own consolidation) and store it by
parameter name like every other strategy, so a FairScale checkpoint loads into ``ddp``, ``fsdp`` or
``single`` and back.
"""

from __future__ import annotations

import contextlib
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torchplug.plugin import (
    DEFAULT_TIMEOUT,
    ConfigurationError,
    DDPStrategy,
    DistributedStrategy,
    HookContext,
    MemoryEstimate,
    MemoryQuery,
    Option,
    ParamSpec,
    StrategyInfo,
    hookimpl,
    replicated,
    state_bytes,
)

INSTALL = "pip install torchplug[fairscale]"


def to_oss(optimizer: torch.optim.Optimizer, engine: HookContext) -> torch.optim.Optimizer:
    """The same optimizer (class, groups, hyper-parameters) with its state sharded by OSS."""
    from fairscale.optim import OSS

    if isinstance(optimizer, OSS):
        return optimizer
    if optimizer in _TAKEN:
        raise ConfigurationError(
            "This optimizer was set up by an earlier Engine's OSS, which kept its state (the "
            "optimizer itself holds none), so a second setup would start the moments from zero "
            "without a word. Build the optimizer anew for this Engine (load a checkpoint the "
            "earlier one saved into it to carry its training on)."
        )
    if optimizer.state:
        raise ConfigurationError(
            "The optimizer has already stepped; OSS re-creates it with sharded state. Call "
            "engine.setup(model, optimizer) before the first step."
        )
    groups = [dict(g) for g in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    # defaults can hold keys the constructor does not take (AdamW: decoupled_weight_decay)
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    oss = OSS(groups, optim=type(optimizer), **defaults)
    # An LR scheduler made before setup holds the user's optimizer: let it change the groups OSS
    # reads (OSS copies lr & co. from its global groups into its shard's at every step).
    oss.torchplug_user_optimizer = weakref.ref(optimizer)
    _TAKEN.add(optimizer)
    engine.restore_on_close(optimizer, "param_groups")
    _link(oss)
    return oss


#: The user's optimizers OSS took over in this process (their state lives in OSS).
_TAKEN: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _link(oss: torch.optim.Optimizer) -> None:
    """Point the user's optimizer at the OSS groups (again after a load replaced the list)."""
    user = getattr(oss, "torchplug_user_optimizer", lambda: None)()
    if user is not None:
        user.param_groups = oss.param_groups


def _names(model: torch.nn.Module) -> dict[int, str]:
    inner = getattr(model, "module", model)
    return {id(p): name for name, p in inner.named_parameters()}


class OSSCheckpointing:
    """Optimizer state through OSS consolidation, stored by parameter name (portable)."""

    @hookimpl
    def torchplug_reads_in_place(self, engine: HookContext, kind: str) -> bool:
        # OSS holds only its shard: loading reads the full optimizer state into fresh tensors.
        return kind != "optimizer"

    @hookimpl
    def torchplug_optimizer_state(
        self, engine: HookContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        optimizer.consolidate_state_dict(recipient_rank=0)  # a collective
        box = [optimizer.state_dict() if engine.is_main else None]  # tensors: torch's own way
        torch.distributed.broadcast_object_list(box, src=0)
        full = box[0]
        names = _names(model)
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        state = {order[i]: values for i, values in full["state"].items()}
        groups = []
        for group in full["param_groups"]:
            groups.append({**group, "params": [order[i] for i in group["params"]]})
        return {"state": state, "param_groups": groups}

    @hookimpl
    def torchplug_load_optimizer_state(
        self,
        engine: HookContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
    ) -> bool:
        names = _names(model)
        index = {
            names[id(p)]: i
            for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])
        }
        try:
            full = {
                "state": {index[name]: values for name, values in state["state"].items()},
                "param_groups": [
                    {**group, "params": [index[name] for name in group["params"]]}
                    for group in state["param_groups"]
                ],
            }
        except KeyError as exc:
            raise ConfigurationError(
                f"The checkpoint's optimizer state names parameter {exc}, which this model lacks."
            ) from None
        optimizer.load_state_dict(full)
        _link(optimizer)
        return True


class OSSStrategy(OSSCheckpointing, DDPStrategy):
    @hookimpl
    def torchplug_wrap(
        self, engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        ddp_model, _ = DDPStrategy.torchplug_wrap(self, engine, model, optimizers)
        return ddp_model, [to_oss(o, engine) for o in optimizers]


class SDPStrategy(OSSCheckpointing, DistributedStrategy):
    def __init__(
        self,
        process_group_backend: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        reduce_buffer_size: int = 2**23,
    ) -> None:
        super().__init__(process_group_backend, timeout)
        self.reduce_buffer_size = reduce_buffer_size

    @hookimpl
    def torchplug_wrap(
        self, engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        from fairscale.nn.data_parallel import ShardedDataParallel

        if not optimizers and not any(p.requires_grad for p in model.parameters()):
            return model.to(engine.device), optimizers  # a frozen model: nothing to shard
        if not optimizers:
            raise ConfigurationError(
                "fairscale-sdp shards gradients by optimizer: pass the optimizer too, "
                "engine.setup(model, optimizer)."
            )
        sharded = [to_oss(o, engine) for o in optimizers]
        for optimizer in sharded:
            _keep_gradient_buffers(optimizer)
        wrapped = ShardedDataParallel(
            model.to(engine.device),
            sharded_optimizer=sharded,
            reduce_buffer_size=self.reduce_buffer_size,
        )
        return wrapped, sharded

    @hookimpl
    def torchplug_no_sync(
        self, engine: HookContext, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[None]:
        return model.no_sync()

    @hookimpl
    def torchplug_clip_grad_norm(
        self,
        engine: HookContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        norm_type: float,
    ) -> torch.Tensor:
        # Each rank holds reduced gradients only for the parameters it owns: OSS computes the
        # norm over its shard and all-reduces it, so every rank clips by the same global norm.
        optimizers = [optimizer] if optimizer is not None else engine.optimizers
        norms = [o.clip_grad_norm(max_norm, norm_type=norm_type) for o in optimizers]
        if len(norms) == 1:
            return norms[0]
        return torch.linalg.vector_norm(torch.stack(norms), ord=norm_type)

    @hookimpl
    def torchplug_model_state(self, engine: HookContext, model: torch.nn.Module) -> dict[str, Any]:
        return super().torchplug_model_state(engine, getattr(model, "module", model))

    @hookimpl
    def torchplug_load_model_state(
        self, engine: HookContext, model: torch.nn.Module, state: dict[str, Any], strict: bool
    ) -> bool:
        return super().torchplug_load_model_state(
            engine, getattr(model, "module", model), state, strict
        )


def _keep_gradient_buffers(optimizer: torch.optim.Optimizer) -> None:
    """Make ``zero_grad()`` zero gradients in place instead of setting them to None.

    The FairScale trap: ShardedDataParallel reduces gradients through buffers that each
    ``param.grad`` views. torch >= 2.0's ``zero_grad()`` sets grads to None, the next backward
    allocates fresh unreduced grads outside the buffers, and training silently uses each rank's
    local gradient. Zeroing in place keeps the views, so the reduced gradient is what steps.
    """
    original = optimizer.zero_grad

    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        original(set_to_none=False)

    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)


class FairScaleFSDPStrategy(DistributedStrategy):
    @hookimpl
    def torchplug_wrap(
        self, engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        from fairscale.nn import FullyShardedDataParallel

        if any(o.param_groups for o in optimizers):
            raise ConfigurationError(
                "fairscale-fsdp flattens the model's parameters; create the optimizer after "
                "setup: model = engine.setup(model); optimizer = Adam(model.parameters()); "
                "engine.setup(model, optimizer) is not supported for it."
            )
        return FullyShardedDataParallel(model.to(engine.device)), optimizers


def _owner_shares(query: MemoryQuery) -> list[list[ParamSpec]]:
    """FairScale OSS's partition: each parameter, in order, to the rank holding the fewest
    elements so far (whole parameters; ties to the lowest rank)."""
    sizes = [0] * query.world_size
    owned: list[list[ParamSpec]] = [[] for _ in range(query.world_size)]
    for p in query.params:
        rank = sizes.index(min(sizes))
        sizes[rank] += p.numel
        owned[rank].append(p)
    return owned


def sharded_optimizer(query: MemoryQuery) -> MemoryEstimate:
    """FairScale OSS (ZeRO-1 style): whole parameters and gradients on every rank, each
    parameter's optimizer state on one owner rank (the fullest owner counted)."""
    full = replicated(query)
    state = max(
        state_bytes(query, (p.numel for p in share), share[0].itemsize if share else 4, len(share))
        for share in _owner_shares(query)
    )
    return MemoryEstimate(full.params, full.grads, state)


def sharded_gradients(query: MemoryQuery) -> MemoryEstimate:
    """FairScale ShardedDDP + OSS: whole parameters, each parameter's optimizer state on its
    owner. With ``reduce_buffer_size=0`` a rank frees the gradients it does not own once they
    are reduced (keeping its share); with reduce buckets (the default) every gradient stays."""
    estimate = sharded_optimizer(query)
    if query.options.get("reduce_buffer_size", 1):
        note = "gradients stay whole with reduce buckets (reduce_buffer_size=0: the owned share)"
        return MemoryEstimate(estimate.params, estimate.grads, estimate.optimizer, notes=(note,))
    shares = _owner_shares(query)
    fullest = max(shares, key=lambda share: sum(p.numel for p in share))
    grads = sum(p.numel * p.itemsize for p in fullest)
    note = "gradients of parameters owned elsewhere are freed once reduced"
    return MemoryEstimate(estimate.params, grads, estimate.optimizer, notes=(note,))


@hookimpl
def torchplug_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    # OSS keeps the optimizer's state: a second Engine on the same optimizer is refused
    common: dict[str, Any] = {
        "requires": ("fairscale",),
        "install_hint": INSTALL,
        "refuses": ("reuse",),
    }
    register(
        StrategyInfo(
            name="fairscale-oss",
            aliases=("oss",),
            factory=OSSStrategy,
            description="FairScale OSS optimizer-state sharding with torch DDP.",
            memory=sharded_optimizer,
            options=(*DistributedStrategy.strategy_options(),),
            shards_optimizer=True,
            **{**common, "refuses": ("reuse", "rank_dependent")},  # DDP's unused-parameter check
        )
    )
    register(
        StrategyInfo(
            name="fairscale-sdp",
            aliases=("sharded-ddp",),
            factory=SDPStrategy,
            description="FairScale OSS + ShardedDataParallel: gradients reduced to their owner.",
            memory=sharded_gradients,
            options=(
                *DistributedStrategy.strategy_options(),
                Option("reduce_buffer_size", int, 2**23, "bucket size in elements; 0 = none"),
            ),
            shards_optimizer=True,
            **common,
        )
    )
    register(
        StrategyInfo(
            name="fairscale-fsdp",
            factory=FairScaleFSDPStrategy,
            description="FairScale FullyShardedDataParallel (CUDA only).",
            options=(*DistributedStrategy.strategy_options(),),
            shards_parameters=True,
            shards_optimizer=True,
            supports_cpu=False,  # the core refuses it on a machine without CUDA
            **common,
        )
    )
