"""The model, optimizer, scheduler and data of the ft-ddp tests' scripts, written once: the
scripts import it from their folder, the tests (their plain-PyTorch reference, the loads) by
path."""

import torch
from torch.utils.data import TensorDataset

SAMPLES = 96


def make_model() -> torch.nn.Module:
    """A small MLP with BatchNorm (its running statistics are buffers every group must agree on)."""
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16, bias=False),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 3),
    )


def make_optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
    """AdamW and a StepLR over it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)


def make_data() -> TensorDataset:
    """Inputs, labels and each sample's index (logged, to check which samples each step read)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, 6, generator=g), torch.randint(0, 3, (SAMPLES,), generator=g)
    return TensorDataset(x, y, torch.arange(SAMPLES))
