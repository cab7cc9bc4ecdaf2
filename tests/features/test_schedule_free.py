"""Issue 34 item 5: schedule-free optimizers (``schedulefree.AdamWScheduleFree``) keep one set of
weights for training and another for evaluation, switched by ``optimizer.train()`` /
``optimizer.eval()``. The optimizer ``engine.setup`` returns takes the switch on every strategy
(the user's loop, as under Accelerate's wrapper), and the Trainer calls it around each
evaluation, as Hugging Face's Trainer does; both against plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchplug as tp
import torchplug.plugin as tpp

schedulefree = pytest.importorskip("schedulefree")

ROWS, BATCH, EPOCHS = 32, 8, 2


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS, 8, generator=g)
    return x, x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(ROWS, 1, generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return schedulefree.AdamWScheduleFree(model.parameters(), lr=0.05, warmup_steps=2)


def reference() -> dict:
    """Plain PyTorch, one process, the global batch per step."""
    x, y = _data()
    model = _model()
    opt = _optimizer(model)
    losses, evals = [], []
    for _ in range(EPOCHS):
        opt.train()
        for start in range(0, ROWS, BATCH):
            loss = nn.functional.mse_loss(model(x[start : start + BATCH]), y[start : start + BATCH])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        opt.eval()
        with torch.no_grad():
            evals.append(nn.functional.mse_loss(model(x), y).item())
    return {
        "losses": losses,
        "evals": evals,
        "params": {k: v.clone() for k, v in model.state_dict().items()},
    }


def engine_loop(strategy: str) -> dict:
    """The same loop through the Engine: each rank its rows of each global batch."""
    x, y = _data()
    with tp.Engine(strategy, timeout=120.0) as engine:
        model, opt = engine.setup(*(lambda m: (m, _optimizer(m)))(_model()))
        share = BATCH // engine.world_size
        losses, evals = [], []
        for _ in range(EPOCHS):
            opt.train()
            for start in range(0, ROWS, BATCH):
                rows = slice(start + engine.rank * share, start + (engine.rank + 1) * share)
                loss = nn.functional.mse_loss(model(x[rows]), y[rows])
                engine.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(engine.reduce(loss.detach(), "mean").item())
            opt.eval()
            with torch.no_grad():
                evals.append(nn.functional.mse_loss(model(x), y).item())
        params = engine.full_state(model)["model"]
    return {"losses": losses, "evals": evals, "params": params}


def _close(result: dict, expected: dict) -> None:
    assert result["losses"] == pytest.approx(expected["losses"], abs=1e-5)
    assert result["evals"] == pytest.approx(expected["evals"], abs=1e-5)
    for name, value in expected["params"].items():
        torch.testing.assert_close(result["params"][name], value, atol=1e-5, rtol=0)


def test_the_switch_matters():
    """The evaluation weights differ from the training ones (else the tests below prove nothing):
    the same run evaluated without ``eval()`` scores otherwise."""
    expected = reference()
    x, y = _data()
    model = _model()
    opt = _optimizer(model)
    opt.train()
    for _ in range(EPOCHS):
        for start in range(0, ROWS, BATCH):
            nn.functional.mse_loss(
                model(x[start : start + BATCH]), y[start : start + BATCH]
            ).backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        in_train_mode = nn.functional.mse_loss(model(x), y).item()
    assert abs(in_train_mode - expected["evals"][-1]) > 1e-4, (in_train_mode, expected["evals"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_optimizer_setup_returns_takes_the_train_eval_switch(ranks, strategy):
    expected = reference()
    for result in ranks.run(engine_loop, strategy, timeout=300):
        _close(result, expected)


def test_the_trainer_evaluates_with_the_evaluation_weights_and_trains_on():
    x, y = _data()
    expected = reference()
    model = _model()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    evals = []

    class Record:
        @tpp.hookimpl
        def on_eval_end(self, trainer, metrics):
            evals.append(metrics["eval_loss"])

    with tp.Trainer(
        model,
        _optimizer(model),
        nn.functional.mse_loss,
        loader,
        eval_data=torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=ROWS
        ),
        strategy="single",
        max_epochs=EPOCHS,
        callbacks=[Record()],
        progress=False,
    ) as trainer:
        trainer.fit()
        params = trainer.engine.full_state(trainer.model)["model"]
    assert evals == pytest.approx(expected["evals"], abs=1e-6)
    for name, value in expected["params"].items():
        torch.testing.assert_close(params[name], value, atol=1e-6, rtol=0)
