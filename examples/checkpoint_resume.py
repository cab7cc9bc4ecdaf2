"""Checkpoints are portable: save under one strategy and world size, resume under another.

    torchplug launch -n 2 --strategy ddp  examples/checkpoint_resume.py --dir ckpt --steps 20
    torchplug launch -n 2 --strategy fsdp examples/checkpoint_resume.py --dir ckpt --steps 40
    python examples/checkpoint_resume.py --dir ckpt --steps 60       # one process, "single"

Each run resumes from the newest complete checkpoint in ``--dir`` (``resume="latest"``), trains
to ``--steps`` and writes ``step-N`` checkpoints (model, optimizer, loader position, RNG). The
second and third runs continue where the first stopped, on another backend and world size.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="checkpoints")
    parser.add_argument("--steps", type=int, default=20, help="train until this global step")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    args = parser.parse_args()

    tp.seed_everything(0)
    engine = tp.Engine(checkpoint_dir=args.dir, resume="latest", keep_last=2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = engine.setup(model, optimizer)
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    y = x[:, :4].sum(1, keepdim=True) - x[:, 4:].sum(1, keepdim=True)
    loader = engine.setup_dataloader(
        DataLoader(TensorDataset(x, y), batch_size=32 // engine.world_size, shuffle=True)
    )
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    start = engine.resume(state)
    engine.print(
        f"{engine.strategy} on {engine.world_size} rank(s): "
        + (f"resumed at step {start}" if start is not None else "starting from scratch")
    )
    while state["step"] < args.steps:
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            state["step"] += 1
            if state["step"] % args.every == 0:
                engine.save_checkpoint(state)
                mean = engine.reduce(loss.detach(), "mean").item()
                engine.print(f"step {state['step']}  loss {mean:.4f}  (checkpoint written)")
            if state["step"] >= args.steps:
                break
    engine.close()


if __name__ == "__main__":
    main()
