"""``fsdp``: torch FSDP2 (``fully_shard`` on a device mesh). Parameters, gradients and optimizer
state are sharded across ranks; each shard unit is gathered only while it computes.

FSDP owns precision: ``precision="bf16"`` becomes a ``MixedPrecisionPolicy`` (bf16 compute and
all-gathers, fp32 gradient reduction and outputs) instead of the generic AMP wrapper.
Normalisation layers keep fp32 parameters and compute (their own units), as AMP runs them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchplug.core import capabilities, memory
from torchplug.core.engine import Engine
from torchplug.core.errors import ConfigurationError
from torchplug.core.registry import Option, StrategyInfo
from torchplug.core.spec import hookimpl
from torchplug.core.strategy import (
    DEFAULT_TIMEOUT,
    DistributedStrategy,
    _distributed_options,
    rebind_optimizer,
)


def shard_units(
    model: torch.nn.Module, class_names: tuple[str, ...], min_params: int
) -> list[torch.nn.Module]:
    """Submodules (not the root) to shard on their own, innermost first.

    A submodule qualifies if its class is named in ``class_names``, or if ``min_params`` > 0 and
    the parameters it holds outside already chosen units number at least ``min_params``.
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


#: Normalisation layers: under bf16 they compute in fp32, as torch's AMP runs them (a BatchNorm's
#: running statistics are fp32 buffers, which bf16 weights cannot be combined with).
NORM_TYPES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.modules.batchnorm._NormBase,  # BatchNorm*, InstanceNorm*, SyncBatchNorm
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    *((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()),
)


def shard_norms_in_fp32(model: torch.nn.Module, kwargs: dict[str, Any]) -> list[torch.nn.Module]:
    """Under bf16, each normalisation layer its own FSDP unit whose parameters stay fp32 and
    whose input is cast to fp32 (its output goes back to bf16 for the layers after it); a
    no-op in fp32. Call before the other units are sharded (innermost first)."""
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


class FSDPStrategy(DistributedStrategy):
    def __init__(
        self,
        process_group_backend: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        shard_classes: list[str] | tuple[str, ...] = (),
        min_params: int = 0,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
    ) -> None:
        super().__init__(process_group_backend, timeout)
        self.shard_classes = tuple(shard_classes)
        self.min_params = min_params
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload

    def _fully_shard_kwargs(self, engine: Engine) -> dict[str, Any]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        kwargs: dict[str, Any] = {
            "mesh": init_device_mesh(engine.device.type, (engine.world_size,)),
            "reshard_after_forward": self.reshard_after_forward,
        }
        if engine.precision == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
            )
        if self.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        return kwargs

    @hookimpl
    def torchplug_wrap(
        self, engine: Engine, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        from torch.distributed.fsdp import fully_shard

        names = {id(p): name for name, p in model.named_parameters()}
        if not self.cpu_offload and not any(p.is_meta for p in model.parameters()):
            model = model.to(engine.device)
        kwargs = self._fully_shard_kwargs(engine)
        make_contiguous(model)
        norms = shard_norms_in_fp32(model, kwargs)
        self.units = [
            u for u in shard_units(model, self.shard_classes, self.min_params) if u not in norms
        ]
        for unit in self.units:
            fully_shard(unit, **kwargs)
        self.units = norms + self.units
        # The root's parameters are needed again as soon as backward starts: resharding them
        # after forward only to all-gather them again cost an extra all-gather per step (1.2-1.4x
        # raw FSDP2's step time in `python -m benchmarks`). torch keeps the root gathered by
        # default for that reason; so does torchplug.
        fully_shard(model, **{**kwargs, "reshard_after_forward": False})
        return finish_wrap(engine, model, optimizers, names, "fsdp")

    @hookimpl
    def torchplug_compile(
        self, engine: Engine, model: torch.nn.Module, options: dict[str, Any]
    ) -> torch.nn.Module:
        """Each FSDP unit compiled on its own (as torch recommends for FSDP2), else the model."""
        for unit in getattr(self, "units", None) or [model]:
            engine.restore_on_close(unit, "_compiled_call_impl")
            unit.compile(**options)
        return model

    @hookimpl
    def torchplug_no_sync(
        self, engine: Engine, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[None]:
        return _without_gradient_sync(model)

    @hookimpl
    def torchplug_clip_grad_norm(
        self,
        engine: Engine,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        norm_type: float,
    ) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
        return total.full_tensor() if isinstance(total, DTensor) else total


def make_contiguous(model: torch.nn.Module) -> None:
    """Give non-contiguous parameters (a transposed weight, ``nn.Parameter(w.t())``) a contiguous
    layout, same values, same Parameter objects: FSDP2 refuses them ("FSDP does not support
    non-contiguous parameters yet"), while every other strategy takes them, so the same script
    would fail under fsdp only."""
    for param in model.parameters():
        if not param.is_contiguous():
            param.data = param.data.contiguous()


def finish_wrap(
    engine: Engine,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    names: dict[int, str],
    strategy: str,
) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    """What every DTensor-sharding wrap ends with: plain state dicts accepted, and optimizers
    pointed at the sharded parameters that replaced the ones they were made with."""
    _accept_full_tensors(engine, model)
    params = dict(model.named_parameters())
    for optimizer in optimizers:
        rebind_optimizer(
            optimizer, names, params, f"{strategy} replaces the model's parameters with shards"
        )
    return model, optimizers


def _accept_full_tensors(engine: Engine, model: torch.nn.Module) -> None:
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
def _without_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
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


@hookimpl
def torchplug_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(
        StrategyInfo(
            name="fsdp",
            aliases=("fsdp2", "fully-sharded"),
            factory=FSDPStrategy,
            description="torch FSDP2: parameters, gradients and optimizer state sharded.",
            options=(
                *_distributed_options(),
                Option(
                    "shard_classes",
                    (list, tuple),
                    (),
                    "class names of submodules to shard as units, e.g. ['TransformerBlock']",
                ),
                Option("min_params", int, 0, "shard submodules holding at least this many params"),
                Option("reshard_after_forward", bool, True, "free gathered params after forward"),
                Option("cpu_offload", bool, False, "keep sharded params and grads on the CPU"),
            ),
            precisions=("32", "bf16"),
            owns_precision=True,
            precision_check=capabilities.gpu_check,
            shards_parameters=True,
            shards_optimizer=True,
            takes_meta_modules=True,
            memory=memory.fsdp2,
        )
    )
