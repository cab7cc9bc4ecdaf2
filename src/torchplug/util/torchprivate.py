"""Every place torchplug reads a private part of torch, kept here behind one function each so
that a torch upgrade has one module to check (``tests/util/test_torchprivate.py`` pins the torch
versions they were checked against and exercises them).

torch 2.13 has no public equivalent of any:

- the default process group's key-value store: ``torch.distributed`` creates it inside
  ``init_process_group`` (from ``init_method``, or the ``env://`` rendezvous), and only
  ``distributed_c10d._get_default_store()`` returns it. Checkpoint coordination exchanges its
  small records through it (not through collectives, so a rank that failed or hangs is reported
  instead of deadlocking the others). A group made by another library (DeepSpeed, a user's own
  ``init_process_group``) has no other handle on it.
- whether a ``GradScaler``'s ``unscale_(optimizer)`` found inf/NaN gradients, or no gradient at
  all: ``GradScaler.step`` decides it from ``_per_optimizer_states`` and calls
  ``optimizer.step()`` itself, whereas the AMP plugin must let the backend's own step run (its
  syncs and flushes) and skip only the update.
- the base classes of torch's normalisation layers (``_NormBase``: BatchNorm*, InstanceNorm*,
  SyncBatchNorm; ``_BatchNorm``: the batch-statistics ones), which no public class covers.
- a tensor's version counter (``_version``, bumped by every in-place change): how an
  asynchronous save notices a tensor changed while it was copied.
- the two marks torch's LR schedulers read (``_wrapped_by_lr_sched`` on ``optimizer.step``,
  ``_opt_called`` on the optimizer) to tell a scheduler stepped before its optimizer.
- whether a ``DistributedDataParallel``'s reducer finished this backward's reduction: DDP
  only raises at the next forward when some parameter got no gradient (its own
  ``_check_reducer_finalized``), and the ddp plugin asks right after the backward, before an
  optimizer steps on unsynchronised gradients.
- DTensor's caches of sharding decisions (one in C++, three Python ``lru_cache``), which hold
  the meshes of the job that filled them: an Engine's ``close()`` empties them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed

#: torch versions (``MAJOR.MINOR``) these adapters were checked against.
CHECKED_TORCH = ("2.9", "2.13")


def default_store() -> torch.distributed.Store:
    """The key-value store of the initialized default process group."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()  # noqa: SLF001


def found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)``, called this step, found inf/NaN gradients (as
    ``scaler.step(optimizer)`` would, to skip the update).

    Args:
        scaler: The GradScaler that unscaled this step.
        optimizer: The optimizer it unscaled.
    """
    state = scaler._per_optimizer_states[id(optimizer)]  # noqa: SLF001
    return any(v.item() for v in state["found_inf_per_device"].values())


def nothing_unscaled(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)``, called this step, found no gradient at all (every
    parameter's ``.grad`` None: the step updates nothing). Then the optimizer's unscale record is
    dropped, as ``scaler.update()`` would drop it, so that its next step unscales afresh:
    ``update()`` itself refuses a round with no gradient ("No inf checks were recorded").

    Args:
        scaler: The GradScaler that unscaled this step.
        optimizer: The optimizer it unscaled.
    """
    states = scaler._per_optimizer_states  # noqa: SLF001
    if states[id(optimizer)]["found_inf_per_device"]:
        return False
    del states[id(optimizer)]
    return True


def ddp_reduction_finished(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a ``DistributedDataParallel``) has no reduction left half done: every
    parameter it reduces got its gradient in the backward that started one, or no backward
    reached it since the last finished one. ``False`` means some parameter took part and some
    did not (DDP without ``find_unused_parameters`` would raise at the next forward), or the
    reducer cannot tell (DDP under compiled autograd's Python reducer): read the gradients then.
    One C++ call, about 0.5 µs: much cheaper than reading each parameter's ``.grad`` after a
    backward.

    Args:
        model: A ``torch.nn.parallel.DistributedDataParallel``.
    """
    reducer = getattr(model, "reducer", None)
    if reducer is None:
        raise TypeError(
            f"ddp_reduction_finished() expects a torch DistributedDataParallel (what the ddp "
            f"strategy's torchplug_wrap returns), got a {type(model).__name__}: pass the "
            f"wrapped model."
        )
    if getattr(model, "_use_python_reducer", False):
        return False  # compiled autograd's Python reducer: the C++ one sees no gradient
    try:
        reducer._check_reducer_finalized()  # noqa: SLF001
    except RuntimeError:
        return False
    return True


def norm_base() -> type[torch.nn.Module]:
    """The base class of BatchNorm*, InstanceNorm* and SyncBatchNorm (``_NormBase``)."""
    from torch.nn.modules.batchnorm import _NormBase

    return _NormBase


def batch_norm_base() -> type[torch.nn.Module]:
    """The base class of the batch-statistics norms, BatchNorm1d/2d/3d and their lazy forms
    (``_BatchNorm``): what SyncBatchNorm converts."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm


def mark_scheduler_wrapped(step: object) -> None:
    """Mark ``step`` (an optimizer's replacement ``step``) as LR-scheduler-wrapped, as torch's
    schedulers' own wrapper does (``_wrapped_by_lr_sched``), so a scheduler made before or after
    it keeps it."""
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # noqa: SLF001


def mark_optimizer_called(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer stepped: what torch's LR schedulers look for (``_opt_called``)."""
    optimizer._opt_called = True  # type: ignore[attr-defined]  # noqa: SLF001


def local_block(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A DTensor's local shard as ``(sizes, offsets)`` in the global tensor
    (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(
        tensor.shape,
        tensor.device_mesh,  # type: ignore[attr-defined]
        tensor.placements,  # type: ignore[attr-defined]
    )
    return tuple(sizes), tuple(offsets)


def narrow_by_index(tensor: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    """The view of ``tensor`` at ``offsets`` with ``sizes`` (a DCP read item's place in its
    target: ``torch.distributed._shard._utils.narrow_tensor_by_index``)."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    return narrow_tensor_by_index(tensor, offsets, sizes)


def forget_device_meshes() -> None:
    """Empty DTensor's caches of sharding decisions (an Engine's ``close()``: the last undo).

    They key on ``DeviceMesh``, whose equality ignores its process groups, and hold the meshes
    of the job that filled them. The next job in this process (an Engine after ``close()``)
    numbers its process groups from 0 again, so a decision cached for an old mesh names groups
    that now have other members (a collective among the wrong ranks: a hang) or none ("Could
    not resolve the process group registered under the name N").
    """
    import sys

    if "torch.distributed.tensor" not in sys.modules:
        return  # no DTensor made in this process: nothing cached
    import torch
    from torch.distributed.tensor import DTensor, _redistribute

    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # noqa: SLF001
    if clear_native is not None:
        clear_native()
    propagator = DTensor._op_dispatcher.sharding_propagator  # noqa: SLF001
    for cached in (
        propagator.propagate_op_sharding,
        getattr(propagator, "_propagate_tensor_meta_cached", None),
        getattr(_redistribute, "_gen_transform_infos", None),
    ):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
