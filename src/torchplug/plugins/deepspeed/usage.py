"""Ranks that use different parameters in one step, refused before DeepSpeed reduces anything.

ZeRO reduces a gradient when a parameter's gradient hook fires: a parameter a rank did not use
(a mixture-of-experts block that skips the experts no local token reached, a branch some ranks
take) fires nothing there, so the ranks' reductions no longer line up and the step comes out
silently wrong (ZeRO-3's per-module gathers already disagree in the forward). Nothing in
DeepSpeed counts such a parameter as a zero gradient, so the step is refused: which of the
model's modules ran a forward with gradients on each rank is agreed on with one small all-reduce
before the backward pass, and a module some ranks ran and others did not is named.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from torchplug.plugin import ConfigurationError, HookContext


class ModulesUsed:
    """Forward hooks on the model's modules that hold parameters, removed by `remove`."""

    def __init__(self, model: torch.nn.Module) -> None:
        holding = [
            (name or "<model>", module)
            for name, module in model.named_modules()
            if next(module.parameters(recurse=False), None) is not None
        ]
        self.names = [name for name, _ in holding]
        self.ran: set[int] = set()
        self.handles = [
            module.register_forward_pre_hook(functools.partial(self._ran, index))
            for index, (_, module) in enumerate(holding)
        ]

    def _ran(self, index: int, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():  # an evaluation under no_grad on some ranks is no step
            self.ran.add(index)

    def check(self, engine: HookContext) -> None:
        """Before a backward pass: refuse modules some ranks ran and others did not."""
        used = torch.zeros(len(self.names), dtype=torch.int32, device=engine.device)
        if self.ran:
            used[sorted(self.ran)] = 1
        self.ran.clear()
        counts = engine.reduce(used, "sum").tolist()
        partial = [n for n, c in zip(self.names, counts, strict=True) if 0 < c < engine.world_size]
        if partial:
            listing = ", ".join(partial[:5]) + (", ..." if len(partial) > 5 else "")
            raise ConfigurationError(
                f"{engine.strategy}: {len(partial)} module(s) ran on some ranks and not on "
                f"others in this step ({listing}): ranks that use different parameters (a "
                f"mixture of experts, a branch some ranks take). DeepSpeed reduces only the "
                f"gradients a rank produced, so the step would come out wrong and is refused. "
                f"Run every module on every rank (e.g. pass every expert a zero-size input), or "
                f"use Engine('fsdp', reduce_scatter_unused_params=True) or Engine('ddp', "
                f"find_unused_parameters=True), which count an unused parameter as a zero "
                f"gradient."
            )

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
