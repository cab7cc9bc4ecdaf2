"""Models with what the kit's MLP lacks: BatchNorm buffers (float running statistics and an int64
``num_batches_tracked``), residual blocks and convolutions. Written here because PyPI's
torchvision is built for the CUDA torch and does not import beside the CPU build."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus the input."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


class SmallResNet(nn.Module):
    """A resnet18-shaped network for 3x8x8 images and 10 classes, small enough for CPU ranks."""

    def __init__(self, channels: int = 8, blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
        )
        self.blocks = nn.Sequential(*(Block(channels) for _ in range(blocks)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def make_resnet(seed: int = 0) -> SmallResNet:
    torch.manual_seed(seed)
    return SmallResNet()


def images(seed: int, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of images and labels that depends on ``seed`` only (each rank its own)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, 8, 8, generator=generator) * (1 + seed % 3)
    y = torch.randint(0, 10, (batch,), generator=generator)
    return x, y


class SelfInitialising(torch.nn.Module):
    """A model with a model-wide ``init_weights()`` (torchtitan's pattern), called after it is
    built; the layers' own ``reset_parameters()`` numbers are replaced."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.down = nn.Linear(16, 4)

    def init_weights(self) -> None:
        for layer in (self.up, self.down):
            nn.init.trunc_normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.norm(self.up(x))))


def self_initialising_eager() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = SelfInitialising()
    model.init_weights()
    return model.state_dict()
