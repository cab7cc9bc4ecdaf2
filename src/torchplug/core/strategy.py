"""A base class for backends: default answers to every strategy hook, for torch.distributed.

A backend subclasses :class:`Strategy` and implements ``torchplug_setup`` (and whatever it does
differently). The defaults here are marked ``trylast`` so that any other plugin in the active set
that answers a hook takes precedence over them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchplug.core import checkpoint
from torchplug.core.errors import CheckpointError
from torchplug.core.spec import hookimpl

if TYPE_CHECKING:
    from torchplug.core.engine import Engine

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def _distributed(engine: Engine) -> bool:
    return engine.world_size > 1 and dist.is_available() and dist.is_initialized()


class Strategy:
    """Default strategy hooks: full replicas, torch.distributed collectives, full checkpoints."""

    @hookimpl(trylast=True)
    def torchplug_wrap(
        self, engine: Engine, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        return model.to(engine.device), optimizers

    @hookimpl(trylast=True)
    def torchplug_backward(
        self, engine: Engine, loss: torch.Tensor, model: torch.nn.Module | None
    ) -> bool:
        loss.backward()
        return True

    @hookimpl(trylast=True)
    def torchplug_optimizer_step(
        self,
        engine: Engine,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any] | None,
    ) -> bool:
        optimizer.step(closure) if closure is not None else optimizer.step()
        return True

    @hookimpl(trylast=True)
    def torchplug_clip_grad_norm(
        self,
        engine: Engine,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        norm_type: float,
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)

    @hookimpl(trylast=True)
    def torchplug_no_sync(
        self, engine: Engine, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @hookimpl(trylast=True)
    def torchplug_autocast(self, engine: Engine) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @hookimpl(trylast=True)
    def torchplug_reduce(self, engine: Engine, tensor: torch.Tensor, op: str) -> torch.Tensor:
        result = tensor.detach().clone()
        if op == "mean" and not result.is_floating_point():
            result = result.to(torch.get_default_dtype())
        if _distributed(engine):
            dist.all_reduce(result, op=_REDUCE_OPS[op])
            if op == "mean":
                result.div_(engine.world_size)
        return result

    @hookimpl(trylast=True)
    def torchplug_gather(self, engine: Engine, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().contiguous()
        if not _distributed(engine):
            return tensor.unsqueeze(0).clone()
        parts = [torch.empty_like(tensor) for _ in range(engine.world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts)

    @hookimpl(trylast=True)
    def torchplug_barrier(self, engine: Engine) -> bool:
        if _distributed(engine):
            dist.barrier()
        return True

    @hookimpl(trylast=True)
    def torchplug_save(self, engine: Engine, path: str, state: dict[str, Any]) -> bool:
        """Rank 0 writes the full state; every rank learns whether it succeeded."""
        error: BaseException | None = None
        if engine.is_main:
            try:
                payloads = {key: checkpoint.capture(engine.unwrap(v)) for key, v in state.items()}
                checkpoint.write(path, payloads, engine.checkpoint_header(state))
            except BaseException as exc:  # reported to the other ranks below, then re-raised
                error = exc
        failed = engine.reduce(torch.tensor(1.0 if error else 0.0, device=engine.device), "max")
        if error is not None:
            raise error
        if failed.item():
            raise CheckpointError(
                f"Rank 0 failed to write checkpoint {path}; its error is in rank 0's output. "
                f"The previous checkpoint at that path, if any, is intact."
            )
        return True

    @hookimpl(trylast=True)
    def torchplug_load(self, engine: Engine, path: str, state: dict[str, Any]) -> dict[str, Any]:
        return checkpoint.load(path, state, unwrap=engine.unwrap)
