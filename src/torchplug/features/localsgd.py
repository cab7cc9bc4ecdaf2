"""``tp.LocalSGD``: Accelerate's ``LocalSGD`` block, with its semantics, on an Engine.

Inside the block the model's gradients stay on each rank (``engine.no_sync(model)`` for the whole
block); every ``local_sgd_steps`` calls of ``step()`` the parameters are replaced by their mean
over the ranks, and once more when the block ends. The count starts at zero in each block, so a
block per epoch averages at every epoch's end, as Accelerate's example does. For the same
training without a block in the script, the ``local-sgd`` strategy counts optimizer steps over
the whole run instead (docs/strategies/local-sgd.md).
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import torch

from torchplug.contract.errors import ConfigurationError


class LocalSGD:
    """``with tp.LocalSGD(engine, model, local_sgd_steps=8) as local_sgd:``, ``local_sgd.step()``.

    Args:
        engine: The Engine that set the model up.
        model: The model returned by ``engine.setup`` (a full replica on every rank).
        local_sgd_steps: ``step()`` calls between two averages of the parameters.
        enabled: ``False``: the block does nothing (gradients synchronised as usual).

    Raises:
        ConfigurationError: The model is sharded (``fsdp``, ``tp``): there is no replica to
            average; or ``local_sgd_steps`` is below 1.
    """

    def __init__(
        self, engine: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True
    ) -> None:
        if local_sgd_steps < 1:
            raise ConfigurationError(
                f"LocalSGD(local_sgd_steps={local_sgd_steps}): expected 1 or more step() calls "
                f"between two averages of the parameters."
            )
        if any(type(p).__name__ == "DTensor" for p in model.parameters()):
            raise ConfigurationError(
                f"LocalSGD averages full replicas of the model, and strategy "
                f"'{engine.strategy}' shards it. Use Engine('ddp') (or the 'local-sgd' "
                f"strategy), as Accelerate's LocalSGD runs on DDP only."
            )
        self.engine, self.model, self.local_sgd_steps = engine, model, local_sgd_steps
        self.enabled = enabled and engine.world_size > 1
        self.num_steps = 0
        self._local = contextlib.ExitStack()

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._local.enter_context(self.engine.no_sync(self.model))
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        try:
            if self.enabled and kind is None:  # not on an error: other ranks may be gone
                self.average()
        finally:
            self._local.close()

    def step(self) -> None:
        """Count a step; every ``local_sgd_steps``-th, average the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self.average()

    def average(self) -> None:
        """Replace every parameter by its mean over the ranks."""
        self.engine.barrier()
        with torch.no_grad():
            for param in self.model.parameters():
                param.data.copy_(self.engine.reduce(param.data, "mean"))
