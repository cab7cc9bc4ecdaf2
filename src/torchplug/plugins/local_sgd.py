"""``local-sgd``: each rank steps on its own gradients; every ``sync_every`` optimizer steps the
ranks' parameters are averaged (Lin et al., "Don't Use Large Mini-Batches, Use Local SGD").

What Accelerate's ``accelerate.local_sgd.LocalSGD`` does around a DDP model (its ``no_sync``
for the whole run, then ``accelerator.reduce(param, "mean")`` of every parameter each
``local_sgd_steps`` calls of ``local_sgd.step()`` and once more when the block ends), as a
strategy: ``Engine("local-sgd", sync_every=8)`` or ``torchplug launch --strategy local-sgd
--option sync_every=8`` on an unchanged script. Differences: the count is of optimizer steps
(Accelerate counts ``local_sgd.step()`` calls, one per batch in its example, so the two agree
without gradient accumulation), and the last average happens at ``engine.close()``.

Lossy by design: between averages the replicas differ, so the kit checks convergence, not
parity. Checkpoints write rank 0's replica and optimizer state (every rank must answer the same
values: a checkpoint holds one copy), as Accelerate's ``save_state`` on the main process does,
so a resumed run starts all ranks from rank 0's copy (``resume_exact=False``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.distributed as dist

from torchplug.plugin import (
    DistributedStrategy,
    HookContext,
    Option,
    StrategyInfo,
    hookimpl,
)


def _positive(value: int) -> str | None:
    return None if value >= 1 else f"must be 1 or more optimizer steps, got {value}"


class LocalSGDStrategy(DistributedStrategy):
    """Local SGD: no gradient exchange; parameters averaged every ``sync_every`` steps.

    Args:
        sync_every: Optimizer steps between two averages of the parameters (Accelerate's
            ``local_sgd_steps``).
        **kwargs: `DistributedStrategy`'s options (``timeout``, ``process_group_backend``).
    """

    def __init__(self, sync_every: int = 8, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sync_every = sync_every
        self.steps = 0
        self.models: list[torch.nn.Module] = []

    @hookimpl
    def torchplug_wrap(
        self, engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        model = model.to(engine.device)  # the Engine broadcast rank 0's weights already
        self.models.append(model)
        return model, optimizers

    @hookimpl(wrapper=True)
    def torchplug_optimizer_step(
        self,
        engine: HookContext,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any] | None,
    ) -> Generator[None, bool, bool]:
        """After every ``sync_every``-th step that updated the parameters: average them."""
        stepped = yield
        if stepped is not False:
            self.steps += 1
            if self.steps % self.sync_every == 0:
                self.average()
        return stepped

    def average(self) -> None:
        """Every parameter of the models set up: the mean over the ranks, in place."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        world = dist.get_world_size()
        with torch.no_grad():
            for model in self.models:
                for param in model.parameters():
                    dist.all_reduce(param.data)
                    param.data.div_(world)

    @hookimpl(wrapper=True)
    def torchplug_model_state(
        self, engine: HookContext, model: torch.nn.Module
    ) -> Generator[None, dict[str, Any], dict[str, Any]]:
        """Rank 0's replica on every rank (a checkpoint holds one copy)."""
        return _rank_zeros((yield))

    @hookimpl(wrapper=True)
    def torchplug_optimizer_state(
        self, engine: HookContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> Generator[None, dict[str, Any], dict[str, Any]]:
        """Rank 0's optimizer state on every rank (its moments differ between ranks)."""
        return _rank_zeros((yield))

    @hookimpl
    def torchplug_teardown(self, engine: HookContext) -> None:
        """The last average, so the run ends with one model (Accelerate's at the block's end;
        skipped when the process is going down with an error: other ranks may be gone), then
        the process group goes as `DistributedStrategy`'s teardown does."""
        if not engine.failing:
            self.average()
        self.models = []
        super().torchplug_teardown(engine)


def _rank_zeros(state: Any) -> Any:
    """``state`` with every tensor replaced by a copy of rank 0's."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return state
    if isinstance(state, torch.Tensor):
        copy = state.detach().clone()
        dist.broadcast(copy, 0)
        return copy
    if isinstance(state, dict):
        return {key: _rank_zeros(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_rank_zeros(value) for value in state]
    if isinstance(state, tuple):
        return tuple(_rank_zeros(value) for value in state)
    return state


@hookimpl
def torchplug_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(
        StrategyInfo(
            name="local-sgd",
            factory=LocalSGDStrategy,
            description="Local SGD: ranks step alone, parameters averaged every sync_every steps.",
            options=(
                *DistributedStrategy.strategy_options(),
                Option(
                    "sync_every",
                    int,
                    8,
                    "optimizer steps between parameter averages",
                    validate=_positive,
                ),
            ),
            tolerance=None,  # lossy by design: the kit checks convergence
            resume_exact=False,  # a resumed run starts every rank from rank 0's replica
            deviations={
                "clipping": "each rank clips its own gradients (no gradient is exchanged), as "
                "under Accelerate's LocalSGD",
                "resume": "a checkpoint holds one replica, rank 0's: a resumed run restarts "
                "every rank from it, where the uninterrupted run kept each rank's own until "
                "the next average",
            },
        )
    )
