"""A tiny training run that any strategy executes unchanged, and the data it trains on.

The same ``train`` runs on every rank of a multi-process strategy and, with ``strategy="single"``
and the combined batch, as the single-process reference the others must match.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

import torchplug as tp
from torchplug.testing.bodies import full_state, make_dataset, make_model

MAX_STEPS = 20


#: Full (gathered) parameters and optimizer tensors by name, whatever the strategy.
snapshot = full_state


def train(
    strategy: str = "auto",
    precision: str | None = None,
    steps: int = 10,
    global_batch: int = 16,
    lr: float = 3e-2,
    inf_at_step: int | None = None,
    save_to: str | None = None,
    load_from: str | None = None,
    first_step: int = 0,
    clip: float | None = None,
    width: int = 16,
    precision_options: dict[str, Any] | None = None,
    accumulate: int = 1,
    **options: Any,
) -> dict[str, Any]:
    """Train ``steps`` steps of AdamW on the global batch split over the ranks.

    With ``accumulate > 1`` each rank's batch is split into micro-batches whose gradients are
    accumulated under ``engine.no_sync`` before one optimizer step. ``load_from`` resumes from a
    checkpoint; ``first_step`` skips the batches the run before it trained on.
    """
    with tp.Engine(
        strategy=strategy, precision=precision, precision_options=precision_options, **options
    ) as engine:
        model = make_model(width=width)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        model, optimizer = engine.setup(model, optimizer)
        if load_from is not None:
            state = {"model": model, "optimizer": optimizer, "step": 0}
            engine.load(load_from, state)
            assert state["step"] == first_step, (state["step"], first_step)
        loader = DataLoader(
            make_dataset(MAX_STEPS * global_batch), batch_size=global_batch // engine.world_size
        )
        loader = engine.setup_dataloader(loader)
        losses, skipped, scales, checksums, norms = [], [], [], [], []
        for step, (x, y) in enumerate(loader):
            if step < first_step:
                continue
            if step >= first_step + steps:
                break
            micro = list(zip(x.chunk(accumulate), y.chunk(accumulate), strict=True))
            parts = []
            for i, (xs, ys) in enumerate(micro):
                with engine.no_sync(model, enabled=i < len(micro) - 1):
                    part = torch.nn.functional.mse_loss(model(xs), ys) / len(micro)
                    if inf_at_step == step and engine.rank == 0:
                        part = part * float("inf")
                    engine.backward(part)
                parts.append(part.detach())
            loss = torch.stack(parts).sum()
            if clip is not None:
                norms.append(engine.clip_grad_norm_(model, clip).item())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(engine.reduce(loss, "mean").item())
            skipped.append(optimizer.step_was_skipped)
            local = sum(
                (p.detach().double().sum() for p in _local(model)),
                torch.zeros((), dtype=torch.float64),
            )
            checksums.append(engine.reduce(local, "sum").item())
            scaler = next((p.scaler for p in engine.plugins if getattr(p, "scaler", None)), None)
            scales.append(scaler.get_scale() if scaler is not None else None)
        if save_to is not None:
            state = {"model": model, "optimizer": optimizer, "step": first_step + steps}
            engine.save(save_to, state)
        return {
            "losses": losses,
            "skipped": skipped,
            "scales": scales,
            "checksums": checksums,
            "norms": norms,
            "strategy": engine.strategy,
            "world_size": engine.world_size,
            **snapshot(engine, model, optimizer),
        }


def _local(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's own parameter data (its shard under a sharding strategy, once per replica)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    if params and isinstance(params[0], DTensor):
        return [p.to_local() for p in params]
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return params if rank == 0 else []
