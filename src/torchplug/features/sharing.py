"""Handing each process its part of a collection, and padding tensors to one size across ranks.

What Accelerate users reach for outside a DataLoader: prompts split over the ranks for
generation, per-rank results of different lengths gathered. Parts follow the data-parallel
rank, so the ranks of one tensor-parallel group (which run one forward together) get the same.
"""

from __future__ import annotations

from typing import Any

import torch

from torchplug.contract.errors import ConfigurationError


def bounds(length: int, index: int, count: int) -> tuple[int, int]:
    """The slice ``[start, stop)`` of ``length`` items that part ``index`` of ``count`` holds:
    contiguous, the first ``length % count`` parts one item longer."""
    base, extra = divmod(length, count)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def split(items: Any, index: int, count: int, pad: bool) -> Any:
    """Part ``index`` of ``count`` of ``items`` (a list, tuple, tensor along dimension 0, or a
    dict of those, all of one length). ``pad``: every part as long as the longest, the short
    ones repeating their last item (the last of ``items`` for a part with none)."""
    if isinstance(items, dict):
        lengths = {len(v) for v in items.values() if _splittable(v)}
        bad = [k for k, v in items.items() if not _splittable(v)]
        if bad or len(lengths) > 1:
            raise ConfigurationError(
                f"split_between_processes got a dict whose values {bad or sorted(items)} are "
                f"{'not lists, tuples or tensors' if bad else 'of different lengths'}; expected "
                f"values of one length to split alike. Split them one by one, or pad them first."
            )
        return {k: split(v, index, count, pad) for k, v in items.items()}
    if not _splittable(items):
        raise ConfigurationError(
            f"split_between_processes got {type(items).__name__}; expected a list, tuple, "
            f"tensor (split along dimension 0) or a dict of those. Convert it to a list first."
        )
    start, stop = bounds(len(items), index, count)
    part = items[start:stop]
    longest = bounds(len(items), 0, count)[1]
    if not pad or len(part) == longest or len(items) == 0:
        return part
    filler = items[stop - 1 : stop] if stop > start else items[-1:]
    missing = longest - len(part)
    if isinstance(items, torch.Tensor):
        return torch.cat([part, filler.expand(missing, *filler.shape[1:])])
    return part + type(part)(filler) * missing


def _splittable(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (isinstance(value, torch.Tensor) and value.dim() > 0)


def pad_to(tensor: torch.Tensor, size: int, dim: int, value: Any, first: bool) -> torch.Tensor:
    """``tensor`` grown to ``size`` along ``dim`` with ``value`` (before it if ``first``)."""
    missing = size - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    filler = torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([filler, tensor] if first else [tensor, filler], dim=dim)
