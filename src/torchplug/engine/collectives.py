"""The Engine's collectives: reduce, gather, barrier and what is built on them.

Each function takes the Engine and does what the Engine method of the same name documents
(`Engine.reduce`, `Engine.gather`, ...): the Engine keeps the public methods and their
docstrings, and delegates here. Every collective goes through the active set's per-step hooks
(``torchplug_reduce``, ``torchplug_gather``, ``torchplug_barrier``), with the debug mode's
shape check (`torchplug.features.faults.CollectiveChecker`) first and the timeout explained
(`torchplug.features.faults.guarded`) around it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchplug.contract.errors import ConfigurationError
from torchplug.contract.types import REDUCE_OPS
from torchplug.features import faults, sharing
from torchplug.util import torchprivate

if TYPE_CHECKING:
    from torchplug.engine._typing import Engine

#: The most dimensions `gather_uneven` (``gather_for_metrics``) sends shapes for.
MAX_DIMS = 8


def debug_checker(engine: Engine) -> faults.CollectiveChecker | None:
    """``TORCHPLUG_DEBUG_COLLECTIVES=1`` on several ranks: the checker every collective
    posts its ``(op, shape, dtype)`` to first; else ``None``."""
    if faults.debug_enabled() and engine.world_size > 1 and torch.distributed.is_initialized():
        return faults.CollectiveChecker(
            torchprivate.default_store(),
            engine.rank,
            engine.world_size,
            engine.collective_timeout,
        )
    return None


def as_tensor(engine: Engine, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(engine.device)
    return torch.tensor(value, device=engine.device)


def check(engine: Engine, op: str, tensor: torch.Tensor | None) -> None:
    """Debug mode: every rank must call the same collective with the same shape/dtype."""
    if engine._checker is not None:
        if tensor is None:
            engine._checker.check(op)
        else:
            engine._checker.check(op, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


def guarded(engine: Engine, op: str, call: Callable[[], Any]) -> Any:
    timeout = engine.options.get("timeout")
    return faults.guarded(op, engine.rank, timeout, call)


def reduce(engine: Engine, tensor: torch.Tensor | float, op: str) -> torch.Tensor:
    if op not in REDUCE_OPS:
        raise ConfigurationError(
            f"Unknown reduce op {op!r}. Expected one of {', '.join(REDUCE_OPS)}."
        )
    tensor = as_tensor(engine, tensor)
    check(engine, f"reduce({op})", tensor)
    return guarded(engine, "reduce", lambda: engine._hooks.reduce(tensor, op))


def gather(engine: Engine, tensor: torch.Tensor | float) -> torch.Tensor:
    tensor = as_tensor(engine, tensor)
    check(engine, "gather", tensor)
    return guarded(engine, "gather", lambda: engine._hooks.gather(tensor))


def barrier(engine: Engine) -> None:
    check(engine, "barrier", None)
    guarded(engine, "barrier", engine._hooks.barrier)


def broadcast_object(engine: Engine, obj: Any, src: int) -> Any:
    """JSON as UTF-8 bytes in a tensor (neither pickle nor numpy), carried by the reduce hook: a
    sum to which only ``src`` contributes. So it takes the one channel every collective takes,
    whatever the backend's collectives are (torch.distributed, XLA's, a plugin's own)."""
    if engine.world_size == 1:
        return obj
    data = json.dumps(obj).encode() if engine.rank == src else b""
    size = int(reduce(engine, torch.tensor([len(data)], dtype=torch.int64), "max").item())
    payload = torch.zeros(size, dtype=torch.uint8)
    if engine.rank == src:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    total = reduce(engine, payload, "sum")  # the others add zeros: src's bytes, unchanged
    return json.loads(bytes(total.cpu().tolist()).decode())


def pad_across_processes(
    engine: Engine, tensor: torch.Tensor, dim: int, pad_index: Any, pad_first: bool
) -> torch.Tensor:
    if not -tensor.dim() <= dim < tensor.dim():
        raise ConfigurationError(
            f"pad_across_processes(dim={dim}) on a tensor of {tensor.dim()} dimensions; "
            f"expected a dim in [{-tensor.dim()}, {tensor.dim() - 1}]."
        )
    size = int(engine.reduce(float(tensor.shape[dim]), "max").item())
    return sharing.pad_to(tensor, size, dim % tensor.dim(), pad_index, pad_first)


def gather_for_metrics(engine: Engine, data: Any, padding: int | None) -> Any:
    if padding is None:
        loader = engine._last_loader() if engine._last_loader is not None else None
        padding = int(getattr(loader, "batch_padding", 0) or 0)
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise ConfigurationError(
            f"gather_for_metrics: padding={padding!r} must be a whole number of 0 or more "
            f"(rows at the end of this rank's data that are padding), or None."
        )

    def one(value: torch.Tensor) -> torch.Tensor:
        if value.dim() == 0:
            return gather_uneven(engine, value.unsqueeze(0))
        if padding:
            value = value[: max(0, value.shape[0] - padding)]
        return gather_uneven(engine, value)

    def prepare(value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return torch.tensor(value)
        if isinstance(value, dict):
            return {key: prepare(item) for key, item in value.items()}
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(prepare(v) for v in value))
        if isinstance(value, (list, tuple)):
            return type(value)(prepare(v) for v in value)
        if isinstance(value, torch.Tensor):
            return value
        raise TypeError(
            f"gather_for_metrics expects tensors or numbers (alone or in tuples, lists and "
            f"dicts), got {type(value).__name__}."
        )

    from torchplug.util.nested import map_tensors

    return map_tensors(prepare(data), one)


def gather_uneven(engine: Engine, tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate ``tensor`` from every rank along dim 0; first dimensions may differ."""
    tensor = as_tensor(engine, tensor)
    if engine.world_size == 1:
        return tensor.detach().clone()
    if tensor.dim() > MAX_DIMS:
        raise ConfigurationError(
            f"gather_for_metrics supports up to {MAX_DIMS} dimensions, got shape "
            f"{tuple(tensor.shape)}. Flatten the trailing dimensions first."
        )
    shape = torch.full((MAX_DIMS + 2,), -1, dtype=torch.int64)
    shape[0] = tensor.dim()
    shape[1 : tensor.dim() + 1] = torch.tensor(tensor.shape, dtype=torch.int64)
    shape[-1] = engine.data_parallel_rank  # ranks of one data-parallel replica hold one copy
    shapes = engine.gather(shape).cpu()
    if not bool((shapes[:, 0] == shapes[0, 0]).all()) or not bool(
        (shapes[:, 2:-1] == shapes[0, 2:-1]).all()
    ):
        seen = [tuple(int(d) for d in row[1 : int(row[0]) + 1]) for row in shapes]
        raise ConfigurationError(
            f"gather_for_metrics: the ranks' shapes differ beyond the first dimension: "
            f"{seen} (rank 0 first). Only the first dimension (the batch) may differ; make "
            f"the other dimensions equal (pad sequences to one length) before gathering."
        )
    longest = int(shapes[:, 1].max())
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor.detach()
    stacked = engine.gather(padded)
    first_of_replica: dict[int, int] = {}
    for r in range(engine.world_size):
        first_of_replica.setdefault(int(shapes[r, -1]), r)
    return torch.cat([stacked[r, : int(shapes[r, 1])] for _, r in sorted(first_of_replica.items())])


def agree(engine: Engine, flag: bool | torch.Tensor, op: str) -> bool:
    """``engine.any`` (``op="max"``) and ``engine.all`` (``op="min"``)."""
    return bool(engine.reduce(float(bool(flag)), op).item() > 0)
