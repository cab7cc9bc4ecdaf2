"""What the Engine does to a model beyond the backend's wrap, for models that stop fitting:
activation checkpointing per block, ``torch.compile``, and building parameters on the meta device
then materialising them (only each rank's shard under sharding backends).

Activation checkpointing replaces each chosen block's ``forward`` on the instance with
``torch.utils.checkpoint.checkpoint(forward, ..., use_reentrant=False)``: no wrapper module, so
parameter names, state dicts and checkpoints stay exactly those of the plain model (``close()``
puts the original ``forward`` back).

Meta-device materialisation calls each module's ``reset_parameters()`` in module order, starting
from the RNG state :meth:`Engine.init_module` saw, so a model built empty initialises to the same
numbers as one built eagerly (for models that initialise through ``reset_parameters``, as torch's
layers do). Under a sharding backend each module's full tensors exist only while that module is
initialised, then only this rank's shard is kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from torchplug.core.errors import ConfigurationError

if TYPE_CHECKING:
    from torchplug.core.engine import Engine


def compile_options(value: bool | dict[str, Any] | None) -> dict[str, Any] | None:
    """``Engine(compile=...)``: ``True`` (torch's defaults), a dict of ``torch.compile``
    arguments, or ``False``/``None`` (off)."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        allowed = {"mode", "backend", "fullgraph", "dynamic", "options", "disable"}
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ConfigurationError(
                f"Engine(compile=...) got unknown torch.compile arguments {unknown}; expected "
                f"some of {sorted(allowed)}, e.g. compile={{'mode': 'max-autotune'}}."
            )
        return dict(value)
    raise ConfigurationError(
        f"Engine(compile=...) must be True, False or a dict of torch.compile arguments, got "
        f"{type(value).__name__}."
    )


def block_classes(value: Iterable[type | str] | None) -> tuple[type | str, ...]:
    """``Engine(activation_checkpointing=[Block, "OtherBlock"])``: classes or class names."""
    if value is None:
        return ()
    if isinstance(value, (type, str)):
        value = [value]
    found = tuple(value)
    bad = [v for v in found if not isinstance(v, (type, str))]
    if bad:
        raise ConfigurationError(
            f"activation_checkpointing takes module classes or class names, got {bad!r}. Pass "
            f"e.g. activation_checkpointing=[TransformerBlock]."
        )
    return found


def _matches(module: torch.nn.Module, classes: Sequence[type | str]) -> bool:
    return any(
        isinstance(module, c) if isinstance(c, type) else type(module).__name__ == c
        for c in classes
    )


def checkpoint_activations(
    engine: Engine, model: torch.nn.Module, classes: Sequence[type | str]
) -> int:
    """Recompute each matching block's activations in backward instead of storing them."""
    import functools

    from torch.utils.checkpoint import checkpoint

    count = 0
    for module in model.modules():
        if module is model or not _matches(module, classes):
            continue
        forward = module.forward

        @functools.wraps(forward)
        def checkpointed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        engine.restore_on_close(module, "forward")
        module.forward = checkpointed
        count += 1
    if not count:
        names = sorted({type(m).__name__ for m in model.modules() if m is not model})
        wanted = [c.__name__ if isinstance(c, type) else c for c in classes]
        raise ConfigurationError(
            f"activation_checkpointing={wanted}: no submodule of {type(model).__name__} is one "
            f"of them. Its submodule classes are {names[:12]}."
        )
    return count


# -- meta-device initialisation --------------------------------------------------------------------


def is_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _own_tensors(module: torch.nn.Module) -> list[str]:
    return [
        n
        for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if t is not None
    ]


def check_initialisable(model: torch.nn.Module) -> None:
    """Every module holding tensors of its own must be able to initialise them again."""
    unable = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if _own_tensors(m) and not callable(getattr(m, "reset_parameters", None))
        }
    )
    if unable:
        raise ConfigurationError(
            f"Modules built with engine.init_module(empty=True) are initialised by their "
            f"reset_parameters(), which {unable} lack (they initialise in __init__). Give them a "
            f"reset_parameters() method, or build the model without empty=True."
        )


def materialize(
    model: torch.nn.Module, device: torch.device, rng_state: torch.Tensor | None
) -> None:
    """Allocate and initialise a meta-device model in place (sharded parameters: only this
    rank's shard is kept; each module's full tensors live only while it initialises)."""
    from torch.distributed.tensor import DTensor

    check_initialisable(model)
    model.to_empty(device=device)
    saved = torch.get_rng_state()
    if rng_state is not None:
        torch.set_rng_state(rng_state)
    try:
        for module in model.modules():
            names = _own_tensors(module)
            if not names:
                continue
            slots = {**module._parameters, **module._buffers}  # noqa: SLF001
            sharded = {n: slots[n] for n in names if isinstance(slots[n], DTensor)}
            full: dict[str, torch.Tensor] = {}
            for name, tensor in sharded.items():  # a full-size stand-in while it initialises
                stand_in = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                full[name] = stand_in
                _put(module, name, stand_in, like=tensor)
            with torch.no_grad():
                module.reset_parameters()
                for name, tensor in sharded.items():
                    tensor.to_local().copy_(_local_part(full[name], tensor))
                    _put(module, name, tensor, like=tensor)
            full.clear()
    finally:
        if rng_state is not None:
            torch.set_rng_state(saved)


def _local_part(full: torch.Tensor, like: Any) -> torch.Tensor:
    """This rank's piece of ``full`` as ``like`` (a DTensor) places it: a view where torch
    says where it lies (no copy: the full tensor is the largest thing alive), else cut by
    ``distribute_tensor``."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # a torch without it: a copy of the piece
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(
            full, like.device_mesh, like.placements, src_data_rank=None
        ).to_local()
    shape, offset = compute_local_shape_and_global_offset(
        full.shape, like.device_mesh, like.placements
    )
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def _put(module: torch.nn.Module, name: str, value: torch.Tensor, like: torch.Tensor) -> None:
    if name in module._parameters:  # noqa: SLF001
        if not isinstance(value, torch.nn.Parameter):
            value = torch.nn.Parameter(value, requires_grad=like.requires_grad)
        module._parameters[name] = value  # noqa: SLF001
    else:
        module._buffers[name] = value  # noqa: SLF001
