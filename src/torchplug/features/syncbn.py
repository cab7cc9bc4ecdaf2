"""``Engine(sync_batchnorm=True)``: BatchNorm statistics over the global batch, on every device.

Data parallel gives each rank its own BatchNorm statistics, taken over its own share of the
batch. With synchronised BatchNorm the statistics are those of the whole global batch, so two
ranks of four samples train exactly like one process with eight. On GPUs (and XPU/HPU) that is
torch's own ``nn.SyncBatchNorm``; torch's refuses CPU tensors, so on the CPU torchplug uses
`GlobalBatchNorm`, built from torch's own pieces: per-channel sums, sums of squares and
counts summed over the ranks through the active set's reduce hook (the backend's collectives,
whatever they are), made differentiable by `SumOverRanks` (its backward sums the gradients over
the ranks, as the statistics' dependence on every rank's input requires).

The converted modules share the original modules' parameters and buffers (the optimizer, the
state dict's names and checkpoints are unchanged), and ``close()`` puts the original modules
back.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from torchplug.contract.errors import ConfigurationError
from torchplug.util import torchprivate

#: Batch-statistics norms (BatchNorm1d/2d/3d): what SyncBatchNorm converts.
_BATCH_NORM = torchprivate.batch_norm_base()

#: ``torchplug launch --sync-batchnorm`` sets it for the processes it starts.
SYNC_BATCHNORM_ENV = "TORCHPLUG_SYNC_BATCHNORM"


def setting(value: bool | None) -> bool:
    """The code's ``sync_batchnorm`` if given, else ``TORCHPLUG_SYNC_BATCHNORM``, else off."""
    if value is not None:
        if not isinstance(value, bool):
            raise ConfigurationError(
                f"sync_batchnorm must be True or False, got {type(value).__name__} {value!r}. "
                f"Pass sync_batchnorm=True to synchronise BatchNorm statistics over the ranks."
            )
        return value
    raw = os.environ.get(SYNC_BATCHNORM_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigurationError(
        f"{SYNC_BATCHNORM_ENV}={os.environ[SYNC_BATCHNORM_ENV]!r} is not a boolean: expected 1 or "
        f"0 (true/false). Fix or unset it."
    )


#: ``reduce(tensor, op)``: the Engine's reduce (through the active set's hook).
Reduce = Callable[[torch.Tensor, str], torch.Tensor]


class SumOverRanks(torch.autograd.Function):
    """A sum over the ranks that gradients flow through: forward and backward are each a
    ``"sum"`` reduce (the gradient of a sum over ranks is the sum of the ranks' gradients)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, reduce: Reduce) -> torch.Tensor:
        ctx.reduce = reduce
        return reduce(tensor.detach().clone(), "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.reduce(grad.contiguous().clone(), "sum"), None


class GlobalBatchNorm(_BATCH_NORM):
    """BatchNorm whose training statistics are taken over every rank's batch (any device and
    backend: the sums go through the Engine's reduce); in eval, or in a world of one, it is
    plain BatchNorm."""

    reduce: Reduce | None = None
    world_size: int = 1

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.world_size == 1 or self.reduce is None:
            return super().forward(input)
        self._check_input_dim(input)
        channels = input.size(1)
        dims = [0, *range(2, input.dim())]
        x = input.float()
        count = torch.full((1,), float(input.numel() // channels), device=input.device)
        stats = SumOverRanks.apply(torch.cat([x.sum(dims), (x * x).sum(dims), count]), self.reduce)
        total = stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels : 2 * channels] / total - mean * mean).clamp_min(0)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = (
                    self.momentum
                    if self.momentum is not None
                    else 1.0 / float(self.num_batches_tracked)
                )
                unbiased = var * total / (total - 1).clamp_min(1)
                self.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach() * factor)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape).float() + self.bias.view(shape).float()
        return out.to(input.dtype)


def _put_back(parent: torch.nn.Module, name: str, original: torch.nn.Module) -> None:
    original.train(getattr(parent, name).training)
    setattr(parent, name, original)


def convert(
    model: torch.nn.Module, device: torch.device, reduce: Reduce, world_size: int
) -> list[Callable[[], None]]:
    """Replace every BatchNorm of ``model`` (in place, sharing its tensors) by a synchronised
    one: torch's ``SyncBatchNorm`` where torch supports the device, else
    `GlobalBatchNorm` summing through ``reduce`` over ``world_size`` ranks. Returns the undo
    steps; a model whose root is a BatchNorm is refused (there is no parent to put the new
    module in)."""
    if isinstance(model, _BATCH_NORM):
        raise ConfigurationError(
            f"sync_batchnorm=True cannot convert a model that is itself a "
            f"{type(model).__name__}; wrap it in a module (e.g. nn.Sequential(bn))."
        )
    native = device.type in ("cuda", "xpu", "hpu")
    undo: list[Callable[[], None]] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, _BATCH_NORM) or isinstance(
                child, (torch.nn.SyncBatchNorm, GlobalBatchNorm)
            ):
                continue
            cls = torch.nn.SyncBatchNorm if native else GlobalBatchNorm
            new = cls.__new__(cls)
            torch.nn.Module.__init__(new)
            for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
                setattr(new, attr, getattr(child, attr))
            if native:
                new.process_group = None
            else:
                new.reduce, new.world_size = reduce, world_size
            for pname, param in child._parameters.items():  # noqa: SLF001
                new._parameters[pname] = param  # noqa: SLF001 - the same Parameter objects
            for bname, buffer in child._buffers.items():  # noqa: SLF001
                new._buffers[bname] = buffer  # noqa: SLF001
            new._non_persistent_buffers_set = set(child._non_persistent_buffers_set)  # noqa: SLF001
            new.train(child.training)
            setattr(parent, name, new)
            undo.append(lambda p=parent, n=name, c=child: _put_back(p, n, c))
    return undo
