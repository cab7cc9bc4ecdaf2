"""``torch_distributed``: torchplug's default answers to the strategy hooks, as a plugin.

Full replicas, torch.distributed collectives, DCP's state-dict API for checkpoints. A built-in
plugin registered like any other (its entry point ``torch_distributed``): it joins
every Engine's active set, registered before the backend, every answer marked ``trylast``, so a
backend answers only what it changes, whether or not it subclasses
[`Strategy`][torchplug.plugin.Strategy]. Blocking it
(``TORCHPLUG_BLOCK_PLUGINS=torch_distributed``) leaves those hooks to the backend; an Engine whose
active set then leaves an action hook unanswered refuses to start, naming it. This is pytest's
and tox's arrangement: the built-ins are plugins like the rest.

It lives in core because [`Strategy`][torchplug.plugin.Strategy] delegates to it (a subclass's
``super().torchplug_wrap(...)`` calls the default answer here), and it needs nothing but torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchplug.plugin import HookContext, hookimpl, move_to_device

#: The reduce ops ``engine.reduce`` accepts (checked there), as torch.distributed ops; ``mean``
#: is a sum divided by the world size.
REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def _distributed(engine: HookContext) -> bool:
    return engine.world_size > 1 and dist.is_available() and dist.is_initialized()


@hookimpl(trylast=True)
def torchplug_wrap(
    engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    """A full replica on this rank's device, the optimizers unchanged."""
    return model.to(engine.device), optimizers


@hookimpl(trylast=True)
def torchplug_place_batch(engine: HookContext, batch: Any) -> Any:
    """The batch on this rank's device (left alone on the CPU)."""
    return batch if engine.device.type == "cpu" else move_to_device(batch, engine.device)


@hookimpl(trylast=True)
def torchplug_backward(
    engine: HookContext, loss: torch.Tensor, model: torch.nn.Module | None
) -> bool:
    """``loss.backward()``."""
    loss.backward()
    return True


@hookimpl(trylast=True)
def torchplug_optimizer_step(
    engine: HookContext, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None
) -> bool:
    """``optimizer.step()`` (with the closure, if one was given)."""
    optimizer.step(closure) if closure is not None else optimizer.step()
    return True


@hookimpl(trylast=True)
def torchplug_clip_grad_norm(
    engine: HookContext,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    max_norm: float,
    norm_type: float,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the model's parameters (full replicas)."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)


@hookimpl(trylast=True)
def torchplug_no_sync(
    engine: HookContext, model: torch.nn.Module
) -> contextlib.AbstractContextManager[None]:
    """Nothing to skip: no gradient synchronisation happens outside the backend."""
    return contextlib.nullcontext()


@hookimpl(trylast=True)
def torchplug_autocast(engine: HookContext) -> contextlib.AbstractContextManager[None]:
    """Full precision: no autocast (the precision plugin answers first when one is active)."""
    return contextlib.nullcontext()


@hookimpl(trylast=True)
def torchplug_reduce(engine: HookContext, tensor: torch.Tensor, op: str) -> torch.Tensor:
    """A copy of ``tensor`` all-reduced over the default process group."""
    result = tensor.detach().clone()
    if op == "mean" and not result.is_floating_point():
        result = result.to(torch.get_default_dtype())
    if _distributed(engine):
        dist.all_reduce(result, op=REDUCE_OPS[op])
        if op == "mean":
            result.div_(engine.world_size)
    return result


@hookimpl(trylast=True)
def torchplug_gather(engine: HookContext, tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor``, stacked along a new first dimension in rank order."""
    tensor = tensor.detach().contiguous()
    if not _distributed(engine):
        return tensor.unsqueeze(0).clone()
    parts = [torch.empty_like(tensor) for _ in range(engine.world_size)]
    dist.all_gather(parts, tensor)
    return torch.stack(parts)


@hookimpl(trylast=True)
def torchplug_barrier(engine: HookContext) -> bool:
    """``dist.barrier()`` when there is more than one rank."""
    if _distributed(engine):
        dist.barrier()
    return True


@hookimpl(trylast=True)
def torchplug_broadcast(engine: HookContext, tensor: torch.Tensor, src: int) -> torch.Tensor:
    """``dist.broadcast`` over the default process group, in place (through a device copy for
    backends that take device tensors only, nccl); the tensor as it is on one rank."""
    if not _distributed(engine):
        return tensor
    with torch.no_grad():
        if dist.get_backend() not in ("gloo", "mpi") and tensor.device != engine.device:
            staged = tensor.detach().to(engine.device)
            dist.broadcast(staged, src)
            tensor.copy_(staged)
        else:
            dist.broadcast(tensor.detach(), src)
    return tensor


# -- checkpoints ----------------------------------------------------------------------------------
# The state hooks say how a backend reads and writes module and optimizer state; the defaults use
# torch.distributed.checkpoint's state-dict API, which names state by parameter name and returns
# DTensor shards for sharded modules. Backends with their own optimizer sharding (FairScale OSS)
# or tensors DCP cannot write into (XLA) answer them themselves.


@hookimpl(trylast=True)
def torchplug_reads_in_place(engine: HookContext, kind: str) -> bool:
    """True: DCP's state dicts name this rank's live tensors (or their shards)."""
    return True


@hookimpl(trylast=True)
def torchplug_model_state(engine: HookContext, model: torch.nn.Module) -> dict[str, Any]:
    """``get_model_state_dict(model)`` (DCP): full tensors, or DTensor shards when sharded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


@hookimpl(trylast=True)
def torchplug_load_model_state(
    engine: HookContext, model: torch.nn.Module, state: dict[str, Any], strict: bool
) -> bool:
    """``set_model_state_dict`` (DCP), strict as asked."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(strict=strict))
    return True


@hookimpl(trylast=True)
def torchplug_optimizer_state(
    engine: HookContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``get_optimizer_state_dict`` (DCP), keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with engine.real_optimizer_steps():  # it may take a zero step to create the state
        return get_optimizer_state_dict(model, optimizer)


@hookimpl(trylast=True)
def torchplug_load_optimizer_state(
    engine: HookContext,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
) -> bool:
    """``set_optimizer_state_dict`` (DCP)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    with engine.real_optimizer_steps():  # it may take a zero step to create the state
        set_optimizer_state_dict(model, optimizer, state)
    return True
