"""The Engine's collectives: an object that owns what they need (the typed hooks, the runtime,
the debug mode's checker, the last loader for ``gather_for_metrics``).

Each method does what the Engine method of the same name documents (`Engine.reduce`,
`Engine.gather`, ...): the Engine keeps the public methods and their docstrings and delegates
here, and the hooks' `HookContext` is handed this object, not the Engine. Every collective goes
through the active set's per-step hooks (``torchplug_reduce``, ``torchplug_gather``,
``torchplug_barrier``), with the debug mode's shape check
(`torchplug.features.faults.CollectiveChecker`) first and the timeout explained
(`torchplug.features.faults.guarded`) around it.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchplug.contract.errors import ConfigurationError
from torchplug.contract.types import REDUCE_OPS, Runtime
from torchplug.features import faults, sharing
from torchplug.util import torchprivate
from torchplug.util.nested import map_tensors

if TYPE_CHECKING:
    from torchplug.contract.context import Selection
    from torchplug.contract.hooks import Hooks

#: The most dimensions `gather_uneven` (``gather_for_metrics``) sends shapes for.
MAX_DIMS = 8


class Collectives:
    """The collectives of one Engine.

    Args:
        hooks: The Engine's typed hook façade.
        selection: The Engine's selection: its runtime (known once the backend's setup
            answered), the strategy's ``timeout`` option (for the message of a collective that
            timed out) and the collective timeout (the debug checker's).
    """

    def __init__(self, hooks: Hooks, selection: Selection) -> None:
        self._hooks = hooks
        self._selection = selection
        self._timeout = selection.options.get("timeout")
        self._collective_timeout = selection.collective_timeout
        self._checker: faults.CollectiveChecker | None = None
        self._last_loader: weakref.ref[Any] | None = None
        #: Batches handed out so far by this Engine's loaders (which batch is current).
        self.batches = 0

    @property
    def _runtime(self) -> Runtime:
        runtime = self._selection.runtime
        if runtime is None:
            raise RuntimeError(
                "A collective was called inside torchplug_setup, before the backend's setup "
                "answered who this process is. Call collectives after setup (e.g. in wrap)."
            )
        return runtime

    def start_checker(self) -> None:
        """``TORCHPLUG_DEBUG_COLLECTIVES=1`` on several ranks: every collective posts its
        ``(op, shape, dtype)`` to the checker first."""
        rt = self._runtime
        if faults.debug_enabled() and rt.world_size > 1 and torch.distributed.is_initialized():
            self._checker = faults.CollectiveChecker(
                torchprivate.default_store(), rt.rank, rt.world_size, self._collective_timeout
            )

    def note_loader(self, loader: Any) -> None:
        """The loader a batch last came from (its padding is what ``gather_for_metrics`` drops)."""
        self._last_loader = weakref.ref(loader)
        self.batches += 1

    def loader_position(self) -> tuple[int, bool]:
        """Which batch is current (a count over this Engine's loaders), and whether it is the
        last of its loader's pass."""
        loader = self._last_loader() if self._last_loader is not None else None
        return self.batches, bool(getattr(loader, "end_of_pass", False))

    def as_tensor(self, value: Any) -> torch.Tensor:
        device = self._runtime.device
        if isinstance(value, torch.Tensor):
            return value.to(device)
        return torch.tensor(value, device=device)

    def check(self, op: str, tensor: torch.Tensor | None) -> None:
        """Debug mode: every rank must call the same collective with the same shape/dtype."""
        if self._checker is not None:
            if tensor is None:
                self._checker.check(op)
            else:
                dtype = str(tensor.dtype).removeprefix("torch.")
                self._checker.check(op, tuple(tensor.shape), dtype)

    def guarded(self, op: str, call: Callable[[], Any]) -> Any:
        return faults.guarded(op, self._runtime.rank, self._timeout, call)

    def reduce(self, tensor: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        if op not in REDUCE_OPS:
            raise ConfigurationError(
                f"Unknown reduce op {op!r}. Expected one of {', '.join(REDUCE_OPS)}."
            )
        tensor = self.as_tensor(tensor)
        self.check(f"reduce({op})", tensor)
        return self.guarded("reduce", lambda: self._hooks.reduce(tensor, op))

    def gather(self, tensor: torch.Tensor | float, replicas: bool = False) -> torch.Tensor:
        tensor = self.as_tensor(tensor)
        self.check("gather", tensor)
        return self.guarded("gather", lambda: self._hooks.gather(tensor, replicas))

    def gather_all(self, data: Any, concat: bool) -> Any:
        """`Engine.gather`: every tensor (or number) of ``data``, nested in tuples, lists and
        dicts, gathered: stacked ``(world_size, *shape)``, or with ``concat`` joined along the
        first dimension (a number or 0-d tensor gives ``(world_size,)``), as Accelerate's."""
        if isinstance(data, torch.Tensor) and not concat:  # the common call: no nesting
            return self.gather(data)

        def one(tensor: torch.Tensor) -> torch.Tensor:
            stacked = self.gather(tensor)
            if not concat:
                return stacked
            return stacked.reshape(-1, *tensor.shape[1:]) if tensor.dim() else stacked.flatten()

        return map_tensors(tensors_of(data, "gather"), one)

    def reduce_all(self, data: Any, op: str) -> Any:
        """`Engine.reduce` of every tensor (or number) of ``data``, nested in containers."""
        if isinstance(data, torch.Tensor):  # the common call (a loss per step): no nesting
            return self.reduce(data, op)
        return map_tensors(tensors_of(data, "reduce"), lambda t: self.reduce(t, op))

    def gather_object(self, obj: Any) -> list[Any]:
        """`Engine.gather_object`: every rank's JSON value, in rank order (lists joined)."""
        rt = self._runtime
        values = [self.broadcast_object(obj, src) for src in range(rt.world_size)]
        if all(isinstance(v, list) for v in values):
            return [item for value in values for item in value]
        return values

    def barrier(self) -> None:
        self.check("barrier", None)
        self.guarded("barrier", self._hooks.barrier)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """JSON as UTF-8 bytes in a tensor (neither pickle nor numpy), carried by the reduce
        hook: a sum to which only ``src`` contributes. So it takes the one channel every
        collective takes, whatever the backend's collectives are (torch.distributed, XLA's, a
        plugin's own)."""
        rt = self._runtime
        if rt.world_size == 1:
            return obj
        data = json.dumps(obj).encode() if rt.rank == src else b""
        size = int(self.reduce(torch.tensor([len(data)], dtype=torch.int64), "max").item())
        payload = torch.zeros(size, dtype=torch.uint8)
        if rt.rank == src:
            payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        total = self.reduce(payload, "sum")  # the others add zeros: src's bytes, unchanged
        return json.loads(bytes(total.cpu().tolist()).decode())

    def pad_across_processes(
        self, tensor: torch.Tensor, dim: int, pad_index: Any, pad_first: bool
    ) -> torch.Tensor:
        if not -tensor.dim() <= dim < tensor.dim():
            raise ConfigurationError(
                f"pad_across_processes(dim={dim}) on a tensor of {tensor.dim()} dimensions; "
                f"expected a dim in [{-tensor.dim()}, {tensor.dim() - 1}]."
            )
        size = int(self.reduce(float(tensor.shape[dim]), "max").item())
        return sharing.pad_to(tensor, size, dim % tensor.dim(), pad_index, pad_first)

    def agree(self, flag: bool | torch.Tensor, op: str) -> bool:
        """``engine.any`` (``op="max"``) and ``engine.all`` (``op="min"``)."""
        return bool(self.reduce(float(bool(flag)), op).item() > 0)

    def gather_for_metrics(self, data: Any, padding: int | None) -> Any:
        if padding is None:
            loader = self._last_loader() if self._last_loader is not None else None
            padding = int(getattr(loader, "batch_padding", 0) or 0)
        if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
            raise ConfigurationError(
                f"gather_for_metrics: padding={padding!r} must be a whole number of 0 or more "
                f"(rows at the end of this rank's data that are padding), or None."
            )

        def one(value: torch.Tensor) -> torch.Tensor:
            if value.dim() == 0:
                return self.gather_uneven(value.unsqueeze(0))
            if padding:
                value = value[: max(0, value.shape[0] - padding)]
            return self.gather_uneven(value)

        return map_tensors(tensors_of(data, "gather_for_metrics"), one)

    def gather_uneven(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate ``tensor`` from every data-parallel replica along dim 0 (first dimensions
        may differ): over the ranks, and past them where the backend's replicas reach further
        (`torchplug_gather`'s ``replicas``)."""
        tensor = self.as_tensor(tensor)
        rt = self._runtime
        if rt.world_size == 1 and (rt.data_parallel_size or 1) == 1:
            return tensor.detach().clone()
        if tensor.dim() > MAX_DIMS:
            raise ConfigurationError(
                f"gather_for_metrics supports up to {MAX_DIMS} dimensions, got shape "
                f"{tuple(tensor.shape)}. Flatten the trailing dimensions first."
            )
        shape = torch.full((MAX_DIMS + 2,), -1, dtype=torch.int64)
        shape[0] = tensor.dim()
        shape[1 : tensor.dim() + 1] = torch.tensor(tensor.shape, dtype=torch.int64)
        # ranks of one data-parallel replica hold one copy
        shape[-1] = rt.rank if rt.data_parallel_rank is None else rt.data_parallel_rank
        shapes = self.gather(shape, replicas=True).cpu()
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
        stacked = self.gather(padded, replicas=True)
        first_of_replica: dict[int, int] = {}
        for r in range(shapes.shape[0]):
            first_of_replica.setdefault(int(shapes[r, -1]), r)
        firsts = sorted(first_of_replica.items())
        return torch.cat([stacked[r, : int(shapes[r, 1])] for _, r in firsts])


def tensors_of(data: Any, what: str) -> Any:
    """``data`` with its numbers as tensors; tensors and numbers nested in tuples (named too),
    lists and dicts; anything else is an error naming ``what`` was called."""
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return torch.tensor(data)
    if isinstance(data, dict):
        return {key: tensors_of(item, what) for key, item in data.items()}
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(tensors_of(v, what) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(tensors_of(v, what) for v in data)
    if isinstance(data, torch.Tensor):
        return data
    raise TypeError(
        f"engine.{what} expects tensors or numbers (alone or in tuples, lists and dicts), got "
        f"{type(data).__name__}. For other values (strings, lists of them) use "
        f"engine.gather_object (JSON values) or engine.broadcast_object."
    )
