"""Tensors a strategy hands to a save as a promise, produced one at a time once the save knows
which rank writes each.

Why: a ZeRO-3 rank holds a partition of the model and of the optimizer state. Gathering every
full tensor on every rank before the save decides who writes what made each rank hold the whole
model and optimizer state at once: at save time, the memory ZeRO-3 was chosen to avoid. A
strategy whose state hooks gather (a collective per tensor) may return a `Deferred`
instead of a tensor while `wanted` is true (only inside a save's capture); the save then
calls `produce`, which gathers the deferred tensors in one order on every rank and keeps
each only on the rank that writes it. A rank then holds its share of the full state plus the
one tensor being gathered. Everywhere else (``engine.full_state``, a strategy's load) the hooks
are called without deferring and return tensors as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from torchplug.contract.errors import CheckpointError

_DEFERRING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torchplug_deferring", default=False
)


class Deferred:
    """A full tensor of known shape and dtype that ``produce()`` makes (a collective: every
    rank calls it for the same tensors, in the same order).

    Args:
        shape: The full tensor's shape.
        dtype: Its dtype.
        produce: Makes the full tensor; called by the save on every rank, one tensor at a time.
    """

    __slots__ = ("dtype", "produce", "shape")

    def __init__(
        self, shape: tuple[int, ...], dtype: torch.dtype, produce: Callable[[], torch.Tensor]
    ) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.produce = produce

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def __repr__(self) -> str:
        return f"Deferred(shape={tuple(self.shape)}, dtype={self.dtype})"

    @staticmethod
    def wanted() -> bool:
        """Whether the caller of a state hook takes `Deferred` values (a save capturing): a
        state hook returns them only then, full tensors otherwise."""
        return _DEFERRING.get()


def wanted() -> bool:
    """Whether the caller of a state hook takes `Deferred` values (a save capturing)."""
    return _DEFERRING.get()


@contextlib.contextmanager
def deferring() -> Iterator[None]:
    """State hooks called inside may return `Deferred` values."""
    token = _DEFERRING.set(True)
    try:
        yield
    finally:
        _DEFERRING.reset(token)


def produce(tensors: Mapping[str, Any], mine: Mapping[str, Any]) -> dict[str, Any]:
    """``mine`` with its deferred tensors made. Every deferred tensor in ``tensors`` is produced,
    by name order (the same on every rank, whatever order each rank's state was built in), and
    kept only if it is in ``mine``: the rest is dropped before the next one is gathered."""
    kept = dict(mine)
    for name in sorted(n for n, t in tensors.items() if isinstance(t, Deferred)):
        expected = tensors[name]
        value = expected.produce()
        if tuple(value.shape) != tuple(expected.shape) or value.dtype != expected.dtype:
            raise CheckpointError(
                f"The strategy promised {name!r} as {expected!r} but produced shape "
                f"{tuple(value.shape)}, dtype {value.dtype}; this is a bug in the strategy's "
                f"state hook."
            )
        if name in kept:
            kept[name] = value  # any other is dropped here, before the next is gathered
    return kept
