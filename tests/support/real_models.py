"""A BatchNorm ResNet (support/models.py) trained, saved and loaded on the ranks: each rank's
buffers and eval logits, to compare across ranks and strategies."""

from __future__ import annotations

from typing import Any

import torch

import torchplug as tp
from support.models import images, make_resnet

EVAL_INPUT_SEED = 1234


def sgd_step(engine: tp.Engine, model: Any, optimizer: Any, x: Any, y: Any) -> torch.Tensor:
    """One plain training step on classification logits; the loss, detached."""
    loss = torch.nn.functional.cross_entropy(model(x), y)
    engine.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_bn_and_save(strategy: str, path: str, steps: int = 3) -> dict[str, Any]:
    """Each rank trains on its own batches (so its BatchNorm statistics are its own), saves,
    and reports its buffers and its eval logits."""
    with tp.Engine(strategy) as engine:
        model = make_resnet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer = engine.setup(model, optimizer)
        model.train()
        for step in range(steps):
            x, y = images(seed=100 * engine.rank + step)
            sgd_step(engine, model, optimizer, x, y)
        engine.save(path, {"model": model, "optimizer": optimizer})
        full = engine.full_state(model)["model"]
        buffers = {k: v.clone() for k, v in full.items() if "running" in k or "batches" in k}
        model.eval()
        with torch.no_grad():
            logits = model(images(EVAL_INPUT_SEED)[0])
        return {"buffers": buffers, "logits": logits, "rank": engine.rank}


def load_into(strategy: str, path: str) -> dict[str, Any]:
    with tp.Engine(strategy) as engine:
        model = make_resnet(seed=99)  # other weights and fresh statistics: all must come back
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer = engine.setup(model, optimizer)
        engine.load(path, {"model": model, "optimizer": optimizer})
        full = engine.full_state(model)["model"]
        buffers = {k: v.clone() for k, v in full.items() if "running" in k or "batches" in k}
        model.eval()
        with torch.no_grad():
            logits = model(images(EVAL_INPUT_SEED)[0])
        return {"buffers": buffers, "logits": logits}
