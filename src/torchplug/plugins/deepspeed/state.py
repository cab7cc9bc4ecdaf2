"""DeepSpeed's partitioned model and optimizer state, as the portable layout every other strategy
writes: full fp32 tensors by parameter name, the optimizer's state per parameter name
(``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``).

Values move through DeepSpeed's own accessors (``safe_get_full_fp32_param``,
``safe_get_full_optimizer_state`` and their ``safe_set`` counterparts), which know each ZeRO
stage's partitioning; all of them are collectives, called on every rank in the same order. What
those accessors leave out lives here, in one place: the optimizer state of a fresh engine does not
exist until its first step, so loading creates it on DeepSpeed's flat fp32 partitions first.
"""

from __future__ import annotations

from typing import Any

import torch

from torchplug.plugin import CheckpointError, ConfigurationError, Deferred, some_of


def _deepspeed_version() -> str:
    import deepspeed

    return getattr(deepspeed, "__version__", "?")


def _flats(ds_optimizer: Any, optimizer: torch.optim.Optimizer) -> list[tuple[int, torch.Tensor]]:
    """``(param group index, flat fp32 partition)`` pairs: what the torch optimizer steps, so
    what its state is keyed by."""
    zero3 = getattr(ds_optimizer, "fp32_partitioned_groups_flat", None)
    if zero3 is not None:  # ZeRO-3: sub-groups, put into the param groups only while stepping
        owner = ds_optimizer.sub_group_to_group_id
        return [(owner[i], flat) for i, flat in enumerate(zero3)]
    found = [(i, p) for i, g in enumerate(optimizer.param_groups) for p in g["params"]]
    if any(p.dim() != 1 for _, p in found):
        raise CheckpointError(
            f"DeepSpeed {_deepspeed_version()} did not flatten the optimizer's parameters as "
            f"torchplug expects (ZeRO stage 1/2 or its bf16 optimizer); its optimizer state "
            f"cannot be written portably. Please report this with your DeepSpeed version."
        )
    return found


def _full_shape(param: torch.nn.Parameter) -> torch.Size:
    return getattr(param, "ds_shape", param.shape)


def _set_full(param: torch.nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
    """DeepSpeed's ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``, except
    that under ZeRO-3 this rank's partition is cut here and set with the local API: the full one
    reads past the end of a parameter whose size the world size does not divide."""
    from deepspeed import utils

    value = value.to(torch.float32)
    if not hasattr(param, "ds_id"):
        if key is None:
            utils.safe_set_full_fp32_param(param, value)
        else:
            utils.safe_set_full_optimizer_state(param, value, key)
        return
    size = param.ds_tensor.numel()
    owner = getattr(param, "_z3_optimizer", None)
    if owner is not None and hasattr(owner, "_get_param_partition_rank"):
        rank = owner._get_param_partition_rank(param)  # noqa: SLF001 - DeepSpeed has no public one
    else:
        rank = torch.distributed.get_rank()
    flat = value.flatten()[rank * size : (rank + 1) * size]
    local = torch.zeros(size, dtype=torch.float32)
    local[: flat.numel()] = flat
    if key is None:
        utils.safe_set_local_fp32_param(param, local)
    else:
        utils.safe_set_local_optimizer_state(param, local, key)


def _full_value(tensor: torch.Tensor, lowered: bool) -> torch.Tensor:
    """One state_dict entry, full and on the CPU (a collective for a partitioned parameter)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    value = None
    if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
        value = safe_get_full_fp32_param(tensor)
    if value is None:
        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
            value = tensor.detach().clone()
    value = value.detach().reshape(_full_shape(tensor)).cpu().clone()
    if lowered and value.is_floating_point():
        value = value.float()
    return value


def _full_dtype(tensor: torch.Tensor, lowered: bool) -> torch.dtype:
    """The dtype `_full_value` gives ``tensor``, known without gathering it."""
    if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
        return torch.float32  # DeepSpeed's master weights
    if lowered and tensor.dtype.is_floating_point:
        return torch.float32
    return tensor.dtype


def model_state(module: torch.nn.Module, lowered: bool) -> dict[str, Any]:
    """Every entry of ``module.state_dict()``, full and on the CPU; trainable parameters are
    DeepSpeed's fp32 master weights. ``lowered``: DeepSpeed cast the module to bf16/fp16, so the
    other floating entries go back to fp32 (the dtype the model had before setup).

    Inside a save (`Deferred.wanted`) parameters are promised, not
    gathered: the save gathers each once it knows which rank writes it, so no rank holds the
    whole model. Buffers (never partitioned, each rank's own) are taken at once."""
    defer = Deferred.wanted()
    result: dict[str, Any] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if defer and isinstance(tensor, torch.nn.Parameter):
            result[name] = Deferred(
                tuple(_full_shape(tensor)),
                _full_dtype(tensor, lowered),
                lambda tensor=tensor: _full_value(tensor, lowered),
            )
        else:
            result[name] = _full_value(tensor, lowered)
    return result


def load_model_state(module: torch.nn.Module, state: dict[str, Any], strict: bool) -> None:
    """Put full tensors by name into the module's (possibly partitioned) parameters and buffers,
    and into DeepSpeed's fp32 master weights, which would otherwise overwrite them at the next
    step."""
    import deepspeed

    live = module.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(live) - set(state)), sorted(set(state) - set(live))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"The model state does not match the model: missing {missing[:10]}, unexpected "
            f"{unexpected[:10]}. Load into the architecture that was saved, or pass strict=False."
        )
    for name, target in live.items():
        if name not in state:
            continue
        value = state[name]
        if tuple(value.shape) != tuple(_full_shape(target)):
            raise CheckpointError(
                f"Parameter {name!r} has shape {tuple(value.shape)} in the checkpoint but "
                f"{tuple(_full_shape(target))} in the model. Load into the architecture that "
                f"was saved."
            )
        with torch.no_grad():
            if isinstance(target, torch.nn.Parameter):
                with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
                    target.data.copy_(value.to(target.dtype))
                if target.requires_grad:
                    _set_full(target, value)
            else:
                target.copy_(value.to(target.dtype))


def _relink(ds_optimizer: Any) -> None:
    """ZeRO-1/2 (and DeepSpeed's bf16 optimizer): point each parameter's fragment at the current
    state tensors. DeepSpeed links them once, right after the first group steps, so with several
    parameter groups the later groups' fragments stay empty (their state did not exist yet)."""
    if hasattr(ds_optimizer, "_lazy_init_hp_params_optimizer_state"):
        # DeepSpeed's own lazy initialisation, which it offers no public call for
        ds_optimizer._hp_optimizer_states_linked = False  # noqa: SLF001
        ds_optimizer._lazy_init_hp_params_optimizer_state()  # noqa: SLF001


def _per_element(state: dict[str, Any]) -> list[str]:
    """Keys of one parameter's optimizer state that hold a value per element (``exp_avg``,
    ``momentum_buffer``); the others (``step``) are one value for the whole group."""
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)


def _copy(value: Any) -> Any:
    return value.detach().cpu().clone() if torch.is_tensor(value) else value


def optimizer_state(
    ds_optimizer: Any,
    optimizer: torch.optim.Optimizer,
    names: list[list[str]],
    params: dict[str, torch.nn.Parameter],
) -> dict[str, Any]:
    """The torch optimizer's state as if it had stepped the full fp32 parameters itself."""
    from deepspeed.utils import safe_get_full_optimizer_state

    if len(names) != len(optimizer.param_groups):
        raise CheckpointError(
            f"DeepSpeed changed the optimizer's parameter groups ({len(names)} at setup, "
            f"{len(optimizer.param_groups)} now); its state cannot be written portably."
        )
    groups = [
        {**{k: _copy(v) for k, v in group.items() if k != "params"}, "params": list(names[i])}
        for i, group in enumerate(optimizer.param_groups)
    ]
    flats = _flats(ds_optimizer, optimizer)
    states = {i: optimizer.state.get(flat) for i, flat in flats}
    if not any(states.values()):  # no step taken yet: nothing but the hyperparameters
        return {"state": {}, "param_groups": groups}
    _relink(ds_optimizer)
    defer = Deferred.wanted()

    def full(param: torch.nn.Parameter, key: str) -> torch.Tensor:
        value = safe_get_full_optimizer_state(param, key)
        return value.detach().reshape(_full_shape(param)).cpu().clone()

    result: dict[str, dict[str, Any]] = {}
    for i, group_names in enumerate(names):
        group_state = states.get(i) or {}
        keys = _per_element(group_state)
        shared = {k: v for k, v in group_state.items() if k not in keys}
        for name in group_names:
            param = params[name]
            if not param.requires_grad:
                continue
            entry = {k: _copy(v) for k, v in shared.items()}
            for key in keys:
                if defer:  # gathered by the save, one tensor at a time (see model_state)
                    dtype = group_state[key].dtype
                    entry[key] = Deferred(
                        tuple(_full_shape(param)), dtype, lambda p=param, k=key: full(p, k)
                    )
                else:
                    entry[key] = full(param, key)
            result[name] = entry
    return {"state": result, "param_groups": groups}


def load_optimizer_state(
    ds_optimizer: Any,
    optimizer: torch.optim.Optimizer,
    names: list[list[str]],
    params: dict[str, torch.nn.Parameter],
    state: dict[str, Any],
) -> None:
    """Put a portable optimizer state into DeepSpeed's partitions (creating them if the engine
    has not stepped yet)."""
    if getattr(ds_optimizer, "swap_optimizer", False):
        raise ConfigurationError(
            "Loading a portable optimizer state into DeepSpeed with the optimizer swapped to NVMe "
            "is not supported. Load with offload_optimizer='cpu' or 'none', save, and continue "
            "with NVMe from that checkpoint's native part."
        )
    saved_groups = state.get("param_groups", [])
    saved_names = [list(g.get("params", [])) for g in saved_groups]
    if saved_names != names:
        raise CheckpointError(
            f"The checkpoint's optimizer has parameter groups {_brief(saved_names)}, this one "
            f"{_brief(names)}. Build the optimizer with the same parameter groups, in the same "
            f"order, as the one that was saved."
        )
    for live, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        live.update({k: v for k, v in saved.items() if k != "params"})
    saved_state = state.get("state", {})
    flats = _flats(ds_optimizer, optimizer)
    if not saved_state:
        if any(optimizer.state.get(flat) for _, flat in flats):
            raise CheckpointError(
                "The checkpoint was saved before the optimizer's first step, but this optimizer "
                "has stepped already. Load it into a freshly set up optimizer."
            )
        return
    for i, flat in flats:
        sample = next((saved_state[n] for n in names[i] if n in saved_state), None)
        if sample is None:
            continue
        keys = _per_element(sample)
        current = optimizer.state.setdefault(flat, {})
        for key in keys:
            if not torch.is_tensor(current.get(key)) or current[key].shape != flat.shape:
                current[key] = torch.zeros_like(flat)
        for key, value in sample.items():
            if key not in keys:
                current[key] = value.clone() if torch.is_tensor(value) else value
    _relink(ds_optimizer)
    for group_names in names:
        for name in group_names:
            param = params[name]
            if not param.requires_grad or name not in saved_state:
                continue
            for key in _per_element(saved_state[name]):
                _set_full(param, saved_state[name][key], key)


def _brief(groups: list[list[str]]) -> str:
    shown = (f"[{some_of(g, 3)}]" for g in groups)
    return "[" + ", ".join(shown) + "]"
