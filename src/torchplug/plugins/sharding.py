"""What the DTensor-sharding strategies share: the job's device mesh, how FSDP2 is applied to a
model, and how a sharded wrap ends.

Why a module of functions: ``fsdp`` and ``tp``/``fsdp-tp`` are different backends that happen to
apply FSDP2 the same way. ``TensorParallelStrategy`` used to subclass ``FSDPStrategy`` to reach
this code, and so inherited FSDP's hooks and attributes (its ``cpu_offload``, ``min_params``, its
mesh built per wrap) whether it meant to or not. Both now subclass ``DistributedStrategy`` and
call these functions, as torchtitan's parallelisms are functions applied over one mesh per job.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchplug.plugin import (
    ConfigurationError,
    HookContext,
    Option,
    PluginError,
    Runtime,
    norm_base,
    rebind_optimizer,
    some_of,
)

NORM_TYPES: tuple[type[torch.nn.Module], ...] = (
    norm_base(),  # BatchNorm*, InstanceNorm*, SyncBatchNorm
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    *((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()),
)
"""Normalisation layers: under bf16 they compute in fp32, as torch's AMP runs them (a
BatchNorm's running statistics are fp32 buffers, which bf16 weights cannot be combined with)."""


def with_mesh(
    runtime: Runtime, shape: tuple[int, ...], names: tuple[str, ...], **changes: Any
) -> Runtime:
    """``runtime`` (and ``changes``) with the job's device mesh, built here once per job.

    Called by a strategy's ``torchplug_setup`` once the process group exists: building the mesh
    takes every rank (a 2-D mesh creates a process group per dim), so it belongs with the setup
    every rank runs together, not with each ``engine.setup(model)``, and every model of the job
    then shards over the same mesh (``engine.mesh``).

    Args:
        runtime: What setup answers so far.
        shape: The mesh's shape.
        names: Its dimensions' names.
        **changes: Other `Runtime` fields to change.
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(runtime.device.type, shape, mesh_dim_names=names)
    return dataclasses.replace(runtime, mesh=mesh, **changes)


def job_mesh(engine: HookContext) -> Any:
    """The device mesh the strategy's setup built (``engine.mesh``); a subclass whose own
    ``torchplug_setup`` forgot it is told so, instead of failing inside torch.

    Args:
        engine: The hook's context.
    """
    mesh = engine.mesh
    if mesh is None:
        raise PluginError(
            f"Strategy '{engine.strategy}' shards on a device mesh, but its torchplug_setup "
            f"returned a Runtime without one. Return with_mesh(runtime, ...) (or call "
            f"the parent's torchplug_setup) so that every wrap uses the job's mesh."
        )
    return mesh


def fully_shard_kwargs(
    engine: HookContext, mesh: Any, reshard_after_forward: bool, cpu_offload: bool = False
) -> dict[str, Any]:
    """``fully_shard``'s keyword arguments over ``mesh``: bf16 becomes FSDP2's own
    ``MixedPrecisionPolicy`` (bf16 compute and all-gathers, fp32 gradient reduction and outputs),
    ``cpu_offload`` its ``CPUOffloadPolicy``.

    Args:
        engine: The hook's context (precision, device).
        mesh: The device mesh (or the data-parallel part of it).
        reshard_after_forward: Free the gathered parameters after each unit's forward.
        cpu_offload: Keep parameters, gradients and optimizer state on the CPU.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if engine.precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
        )
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs


def shard_units(
    model: torch.nn.Module, class_names: tuple[str, ...], min_params: int
) -> list[torch.nn.Module]:
    """Submodules (not the root) to shard on their own, innermost first.

    A submodule qualifies if its class is named in ``class_names``, or if ``min_params`` > 0 and
    the parameters it holds outside already chosen units number at least ``min_params``.

    Args:
        model: The model.
        class_names: Submodule class names to make units of (empty: by size).
        min_params: Without class names: a submodule with at least this many parameters is a unit.
    """
    chosen: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module, is_root: bool) -> int:
        free = sum(visit(child, False) for child in module.children())
        free += sum(p.numel() for p in module.parameters(recurse=False))
        by_class = type(module).__name__ in class_names
        by_size = min_params > 0 and free >= min_params
        if not is_root and free and (by_class or by_size):
            chosen.append(module)
            return 0
        return free

    visit(model, True)
    return chosen


def shard_norms_in_fp32(model: torch.nn.Module, kwargs: dict[str, Any]) -> list[torch.nn.Module]:
    """Under bf16, each normalisation layer its own FSDP unit whose parameters stay fp32 and
    whose input is cast to fp32 (its output goes back to bf16 for the layers after it); a
    no-op in fp32. Call before the other units are sharded (innermost first).

    Args:
        model: The model to shard.
        kwargs: ``fully_shard``'s keyword arguments (`fully_shard_kwargs`), bf16's mixed precision
            among them.
    """
    policy = kwargs.get("mp_policy")
    if policy is None or policy.param_dtype in (None, torch.float32):
        return []
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fp32 = MixedPrecisionPolicy(
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        output_dtype=policy.param_dtype,
        cast_forward_inputs=True,
    )
    norms = [
        m
        for m in model.modules()
        if m is not model and isinstance(m, NORM_TYPES) and any(True for _ in m.parameters())
    ]
    for norm in norms:
        fully_shard(norm, **{**kwargs, "mp_policy": fp32})
    return norms


def make_contiguous(model: torch.nn.Module) -> None:
    """Give non-contiguous parameters (a transposed weight, ``nn.Parameter(w.t())``) a contiguous
    layout, same values, same Parameter objects: FSDP2 refuses them ("FSDP does not support
    non-contiguous parameters yet"), while every other strategy takes them, so the same script
    would fail under fsdp only.

    Args:
        model: The model whose parameters are checked.
    """
    for param in model.parameters():
        if not param.is_contiguous():
            param.data = param.data.contiguous()


class UnusedParameters:
    """Ranks that use different parameters in one step (a mixture of experts, a branch some
    ranks take) under FSDP2, which reduce-scatters only the gradients a rank has: the ranks'
    buffers no longer line up and the averages come out silently wrong
    (pytorch/pytorch#158719). After each backward that reduced gradients, one small all-reduce
    of which parameters have a gradient; a parameter some ranks have one for and others not is
    refused before the optimizer steps, naming the option that makes it right: ``zero_fill``
    (FSDP2's ``set_reduce_scatter_unused_params``) counts it as a zero gradient on the ranks
    that did not use it, as DDP's ``find_unused_parameters`` does.

    Args:
        zero_fill: The strategy's ``reduce_scatter_unused_params`` option.
    """

    OPTION = Option(
        "reduce_scatter_unused_params",
        bool,
        False,
        "ranks that use different parameters (MoE): a parameter a rank did not use counts as a "
        "zero gradient there (else such a step is refused)",
    )

    def __init__(self, zero_fill: bool) -> None:
        self.zero_fill = zero_fill
        self.params: list[tuple[str, torch.nn.Parameter]] = []
        self.syncing = True

    def watch(self, model: torch.nn.Module) -> None:
        """Check ``model`` after each backward from now on.

        Args:
            model: A model sharded with FSDP2 (``fully_shard`` applied).
        """
        if self.zero_fill:  # every rank reduce-scatters every gradient: nothing to check
            model.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
            return
        self.params += list(model.named_parameters())

    @contextlib.contextmanager
    def not_syncing(self, inner: contextlib.AbstractContextManager[None]) -> Iterator[None]:
        """``inner``, noting that no gradient is reduced meanwhile (nothing to check).

        Args:
            inner: The backend's ``no_sync`` context.
        """
        self.syncing = False
        try:
            with inner:
                yield
        finally:
            self.syncing = True

    def check(self, engine: HookContext) -> None:
        """After a backward pass: refuse a parameter with a gradient on some ranks only.

        Args:
            engine: The hook's context (its ``reduce`` agrees on the counts).
        """
        if not self.syncing or not self.params:
            return
        trainable = [(name, p) for name, p in self.params if p.requires_grad]
        has = [p.grad is not None for _, p in trainable]
        counts = engine.reduce(torch.tensor(has, dtype=torch.int32, device=engine.device), "sum")
        partial = [
            name
            for (name, _), count in zip(trainable, counts.tolist(), strict=True)
            if 0 < count < engine.world_size
        ]
        if partial:
            listing = some_of(partial)
            raise ConfigurationError(
                f"{engine.strategy}: {len(partial)} parameter(s) got a gradient on some ranks "
                f"and none on others in this step ({listing}): ranks that use different "
                f"parameters (a mixture of experts, a branch some ranks take). FSDP would "
                f"average them wrongly, so the step is refused. Pass "
                f"Engine('{engine.strategy}', reduce_scatter_unused_params=True) (torchplug "
                f"launch --option reduce_scatter_unused_params=true): a parameter a rank did "
                f"not use then counts as a zero gradient there, as DDP's "
                f"find_unused_parameters does."
            )


def refuse_sharded_twice(model: torch.nn.Module, strategy: str) -> None:
    """Refuse a model whose parameters are DTensors already: sharded by an earlier Engine (or by
    the script), which ``fully_shard`` and ``parallelize_module`` cannot apply to again.

    Args:
        model: The model given to ``engine.setup``.
        strategy: The strategy's name, for the message.
    """
    from torch.distributed.tensor import DTensor

    sharded = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if sharded:
        raise ConfigurationError(
            f"'{strategy}' cannot set up this model: its parameters are sharded already "
            f"({some_of(sharded, 3)} are DTensors), by "
            f"an earlier Engine's setup or by the script, and a module is sharded once. Give "
            f"this Engine a model built anew (load a checkpoint the earlier Engine saved into "
            f"it to carry its training on)."
        )


def shard(
    model: torch.nn.Module, kwargs: dict[str, Any], class_names: tuple[str, ...], min_params: int
) -> list[torch.nn.Module]:
    """Apply FSDP2 to ``model`` with ``kwargs``: fp32 norm units, the chosen units innermost
    first, then the root. Returns the units (norms first), which ``compile_units`` compiles.

    Args:
        model: The model to shard.
        kwargs: ``fully_shard``'s keyword arguments (`fully_shard_kwargs`).
        class_names: Submodule class names to make units of (empty: by size).
        min_params: Without class names: a submodule with at least this many parameters is a unit.
    """
    from torch.distributed.fsdp import fully_shard

    make_contiguous(model)
    norms = shard_norms_in_fp32(model, kwargs)
    units = [u for u in shard_units(model, class_names, min_params) if u not in norms]
    for unit in units:
        fully_shard(unit, **kwargs)
    # The root's parameters are needed again as soon as backward starts: resharding them
    # after forward only to all-gather them again cost an extra all-gather per step (1.2-1.4x
    # raw FSDP2's step time in `python -m benchmarks`). torch keeps the root gathered by
    # default for that reason; so does torchplug.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    model.register_forward_hook(_reshard_after_inference)
    return norms + units


def _reshard_after_inference(model: torch.nn.Module, args: Any, output: Any) -> None:
    """After a forward without gradients (evaluation), free what stayed gathered (the root,
    or every unit with ``reshard_after_forward=False``): no backward comes to free it, and the
    next forward would compute with those gathered copies as they were, missing any change
    made to the shards in between (a schedule-free optimizer's ``train()``/``eval()``
    switch, an EMA swap, ``engine.load``)."""
    if torch.is_grad_enabled():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def compile_units(
    engine: HookContext,
    model: torch.nn.Module,
    units: list[torch.nn.Module] | None,
    options: dict[str, Any],
) -> torch.nn.Module:
    """Each FSDP unit compiled on its own (as torch recommends for FSDP2), else the model;
    ``close()`` undoes it.

    Args:
        engine: The hook's context.
        model: The sharded model.
        units: The units sharded on their own (``None``: compile the model whole).
        options: ``torch.compile``'s keyword arguments.
    """
    for unit in units or [model]:
        engine.restore_on_close(unit, "_compiled_call_impl")
        unit.compile(**options)
    return model


def finish_wrap(
    engine: HookContext,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    names: dict[int, str],
    strategy: str,
) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    """What every DTensor-sharding wrap ends with: plain state dicts accepted, and optimizers
    pointed at the sharded parameters that replaced the ones they were made with.

    Args:
        engine: The hook's context.
        model: The sharded model.
        optimizers: The optimizers made on the unsharded parameters.
        names: Old parameters' ids -> their names.
        strategy: The strategy's name, for messages.
    """
    _accept_full_tensors(engine, model)
    params = dict(model.named_parameters())
    for optimizer in optimizers:
        rebind_optimizer(
            optimizer, names, params, f"{strategy} replaces the model's parameters with shards"
        )
    return model, optimizers


def _accept_full_tensors(engine: HookContext, model: torch.nn.Module) -> None:
    """Let ``model.load_state_dict`` take a plain (unsharded) state dict, as the user's own
    ``torch.save(model.state_dict())`` under any other strategy writes it: each plain tensor
    given for a sharded entry is cut into this rank's shard locally (no communication; every
    rank passes the whole tensor, as with plain PyTorch). ``close()`` restores the method."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    native = model.load_state_dict

    def load_state_dict(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        live = model.state_dict()
        converted = {}
        for name, value in state_dict.items():
            target = live.get(name)
            if isinstance(target, DTensor) and not isinstance(value, DTensor):
                value = distribute_tensor(
                    value.to(target.device),
                    target.device_mesh,
                    target.placements,
                    src_data_rank=None,
                )
            converted[name] = value
        return native(converted, *args, **kwargs)

    engine.restore_on_close(model, "load_state_dict")
    model.load_state_dict = load_state_dict  # type: ignore[method-assign]


@contextlib.contextmanager
def without_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """``engine.no_sync`` over FSDP2: the model's ``set_requires_gradient_sync(False)`` inside.

    Args:
        model: The FSDP2 model.
    """
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is None:
        raise ConfigurationError(
            f"no_sync() needs the model returned by engine.setup(), got a "
            f"{type(model).__name__}. Pass the wrapped model."
        )
    setter(False)
    try:
        yield
    finally:
        setter(True)


def clip_largest(
    grads: list[torch.Tensor],
    max_norm: float,
    reduce: Callable[[torch.Tensor, str], torch.Tensor],
) -> torch.Tensor:
    """``clip_grad_norm_(norm_type=inf)`` over sharded gradients: the largest absolute value
    of every rank's local shards (a rank whose shards are empty contributes nothing: torch's
    own inf-norm refuses an empty tensor), agreed with a ``"max"`` reduce, then each local shard
    scaled by ``min(1, max_norm / (largest + 1e-6))`` as torch scales. A replicated value counts
    once whatever its copies: the largest value does not depend on how often it is held.

    Args:
        grads: The gradients (DTensors or plain tensors).
        max_norm: The largest total norm the gradients may have.
        reduce: The Engine's reduce (``engine.reduce`` of the hook's context).

    Returns:
        The total (inf) norm before clipping, the same on every rank.
    """
    from torch.distributed.tensor import DTensor

    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    peaks = [t.detach().abs().max().float() for t in local if t.numel()]
    device = local[0].device if local else torch.device("cpu")
    mine = torch.stack(peaks).max() if peaks else torch.zeros((), device=device)
    total = reduce(mine, "max")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for tensor in local:
        tensor.detach().mul_(coef.to(tensor.device, tensor.dtype))
    return total


def plan_matches(name: str, pattern: str) -> bool:
    """Whether submodule ``name`` matches a tensor-parallel plan's ``pattern``: ``*`` stands
    for one name, as torch's ``parallelize_module`` and Hugging Face's plans read it.

    Args:
        name: A submodule's name, as ``model.named_modules()`` gives it (``layers.0.fc``).
        pattern: A plan's key (``layers.*.fc``).
    """
    import fnmatch

    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(
        fnmatch.fnmatchcase(a, b) for a, b in zip(parts, wanted, strict=True)
    )


def plan_split(style: Any) -> str | None:
    """How a plan entry splits a layer's weight: ``"col"`` (by output features), ``"row"`` (by
    input features) or ``None`` (left whole: replicate, sequence, or a string it does not know),
    for torch's and Hugging Face's strings and torch's Colwise/RowwiseParallel styles.

    Args:
        style: A plan's value (``"colwise"``, ``"embedding_rowwise"``, a ``ParallelStyle``).
    """
    if isinstance(style, str):
        if style in ("colwise", "colwise_gather_output", "colwise_rep", "embedding_colwise"):
            return "col"
        if style in ("rowwise", "rowwise_split_input", "rowwise_rep", "embedding_rowwise"):
            return "row"
        return None
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(style, ColwiseParallel):
        return "col"
    if isinstance(style, RowwiseParallel):
        return "row"
    return None
