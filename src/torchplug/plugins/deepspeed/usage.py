"""Ranks that use different parameters in one step, refused before DeepSpeed reduces anything.

ZeRO reduces a gradient when a parameter's gradient hook fires: a parameter a rank did not use
(a mixture-of-experts block that skips the experts no local token reached, a branch some ranks
take) fires nothing there, so the ranks' reductions no longer line up and the step comes out
silently wrong. Nothing in DeepSpeed counts such a parameter as a zero gradient, so the step is
refused: which of the model's modules ran a forward with gradients on each rank is agreed on
with one small all-reduce before the backward pass, and a module some ranks ran and others did
not is named.

ZeRO-3 goes wrong earlier: it gathers a module's parameters as the module starts, one
collective per module, so ranks that start different modules (expert 0 here, expert 1 there,
both the same shape) pair their gathers and compute with each other's weights, in the very
first forward. There the ranks agree on each module before DeepSpeed gathers it (``lockstep``):
a hook placed ahead of DeepSpeed's sends the module's position (two integers, one all-reduce),
and the end of the forward is a position too, so a rank that runs a module the others skip is
refused before any gather pairs up wrongly.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from torchplug.plugin import ConfigurationError, HookContext, some_of

_REMEDY = (
    "Run every module on every rank (e.g. pass every expert a zero-size input), or use "
    "Engine('fsdp', reduce_scatter_unused_params=True) or Engine('ddp', "
    "find_unused_parameters=True), which count an unused parameter as a zero gradient."
)


class ModulesUsed:
    """Forward hooks on the model's modules that hold parameters, removed by `remove`.

    Args:
        model: The model DeepSpeed took over.
        engine: The Engine's hook context (its ``reduce`` carries the agreement).
        lockstep: ZeRO-3: agree on each module before DeepSpeed gathers it (the hooks must be
            placed after ``deepspeed.initialize``, so that they run ahead of its own).
    """

    def __init__(self, model: torch.nn.Module, engine: HookContext, lockstep: bool) -> None:
        holding = [
            (name or "<model>", module)
            for name, module in model.named_modules()
            if next(module.parameters(recurse=False), None) is not None
        ]
        self.names = [name for name, _ in holding]
        self.engine = engine
        self.lockstep = lockstep
        self.ran: set[int] = set()
        hook = self._agree if lockstep else self._ran
        self.handles = [
            module.register_forward_pre_hook(functools.partial(hook, index), prepend=lockstep)
            for index, (_, module) in enumerate(holding)
        ]

    def _ran(self, index: int, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():  # an evaluation under no_grad on some ranks is no step
            self.ran.add(index)

    def _agree(self, index: int, module: torch.nn.Module, args: Any) -> None:
        """ZeRO-3: every rank is about to run the same module (under no_grad too: DeepSpeed
        gathers there all the same), else refused before DeepSpeed's gather."""
        engine = self.engine
        if engine.world_size == 1:
            return
        position = torch.tensor([index, -index], dtype=torch.int64, device=engine.device)
        highest, lowest = engine.reduce(position, "max").tolist()
        lowest = -lowest
        if highest != index or lowest != index:
            where = [self._where(lowest), self._where(highest)]
            raise ConfigurationError(
                f"{engine.strategy}: the ranks ran different modules at one point of the "
                f"forward ({where[0]} on some, {where[1]} on others; this rank: "
                f"{self._where(index)}): ranks that use different parameters (a mixture of "
                f"experts, a branch some ranks take). ZeRO-3 gathers each module's parameters "
                f"as it starts, so the ranks would compute with each other's weights; refused "
                f"before that gather. {_REMEDY}"
            )

    def _where(self, index: int) -> str:
        return f"module {self.names[index]!r}" if index < len(self.names) else "the backward"

    def check(self, engine: HookContext) -> None:
        """Before a backward pass: refuse modules some ranks ran and others did not."""
        if self.lockstep:  # every module agreed on already; the end of the forward too
            self._agree(len(self.names), self.engine, ())
            return
        used = torch.zeros(len(self.names), dtype=torch.int32, device=engine.device)
        if self.ran:
            used[sorted(self.ran)] = 1
        self.ran.clear()
        counts = engine.reduce(used, "sum").tolist()
        partial = [n for n, c in zip(self.names, counts, strict=True) if 0 < c < engine.world_size]
        if partial:
            listing = some_of(partial)
            raise ConfigurationError(
                f"{engine.strategy}: {len(partial)} module(s) ran on some ranks and not on "
                f"others in this step ({listing}): ranks that use different parameters (a "
                f"mixture of experts, a branch some ranks take). DeepSpeed reduces only the "
                f"gradients a rank produced, so the step would come out wrong and is refused. "
                f"{_REMEDY}"
            )

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
