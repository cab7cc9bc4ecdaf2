"""A deliberately broken backend: it sums gradients across ranks but forgets to average them."""

from __future__ import annotations

import torch
import torch.distributed as dist

import torchplug as tp
from torchplug.core.strategy import DistributedStrategy


class NoAverage(DistributedStrategy):
    @tp.hookimpl
    def torchplug_backward(self, engine, loss, model):
        loss.backward()
        for p in model.parameters() if model is not None else []:
            if p.grad is not None:
                dist.all_reduce(p.grad)  # SUM, and no division by the world size: the bug
        return True

    @tp.hookimpl
    def torchplug_wrap(self, engine, model, optimizers):
        self.model = model.to(engine.device)
        with torch.no_grad():
            for p in self.model.parameters():
                dist.broadcast(p, 0)
        return self.model, optimizers


@tp.hookimpl
def torchplug_register_strategies(register):
    register(tp.StrategyInfo(name="no-average", factory=NoAverage, description="broken on purpose"))
