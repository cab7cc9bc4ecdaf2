"""A Trainer run for the tests, importable by the rank pool and runnable under torchplug launch:

torchplug launch -n 2 --strategy ddp tests/support/trainer_body.py CKPT_DIR OUT.json [KILL_AT_STEP]
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp
import torchplug.plugin as tpp


def data(n: int = 96, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return TensorDataset(x, y)


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


class Recorder:
    """Callbacks: where training started, evaluations seen, and a kill switch."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.kill_at = kill_at
        self.started_at: int | None = None
        self.evals: list[dict] = []
        self.steps = 0

    @tpp.hookimpl
    def on_train_start(self, trainer):
        self.started_at = trainer.step

    @tpp.hookimpl
    def on_step_end(self, trainer, step, loss):
        self.steps += 1
        if self.kill_at is not None and step == self.kill_at and trainer.engine.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a hard crash, after the checkpoint at step 6

    @tpp.hookimpl
    def on_eval_end(self, trainer, metrics):
        self.evals.append(dict(metrics))


def train(checkpoint_dir: str | None, kill_at: int | None = None, **extra) -> dict:
    model, optimizer = model_and_optimizer()
    recorder = Recorder(kill_at)
    trainer = tp.Trainer(
        model,
        optimizer,
        torch.nn.functional.cross_entropy,
        DataLoader(data(), batch_size=8, shuffle=True),
        DataLoader(data(21, seed=1), batch_size=4),
        max_epochs=3,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=3 if checkpoint_dir else None,
        metrics={"accuracy": tp.accuracy},
        callbacks=[recorder],
        timeout=60.0,
        **extra,
    )
    with trainer:
        result = trainer.fit()
        params = [
            p.detach().cpu().flatten() for p in trainer.engine.unwrap(trainer.model).parameters()
        ]
    return {
        **result,
        "params": torch.cat(params).tolist(),
        "started_at": recorder.started_at,
        "evals": recorder.evals,
        "steps_run": recorder.steps,
    }


def engine_loop() -> dict:
    """The same training as :func:`train`, written with the Engine by hand."""
    model, optimizer = model_and_optimizer()
    with tp.Engine(timeout=60.0) as engine:
        model, optimizer = engine.setup(model, optimizer)
        loader = engine.setup_dataloader(DataLoader(data(), batch_size=8, shuffle=True))
        for _ in range(3):
            losses = []
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                engine.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            mean = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
            last = engine.reduce(mean, "mean").item()
        params = [p.detach().cpu().flatten() for p in engine.unwrap(model).parameters()]
        return {"train_loss": last, "params": torch.cat(params).tolist()}


if __name__ == "__main__":
    checkpoints, out = sys.argv[1], sys.argv[2]
    kill = int(sys.argv[3]) if len(sys.argv) > 3 else None
    result = train(checkpoints, kill)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as handle:
            json.dump(result, handle)
