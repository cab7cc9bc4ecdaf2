"""A pipelined model's state under the model's own names, whichever stage holds each: what
makes a ``pp`` checkpoint portable (it loads into ``single``, ``fsdp``, another stage count).

Why gathered (each name from the lowest pipeline rank holding it, sent to every rank of the
pipeline): the portable format records one structure on every rank; a stage's tensors are
few next to a whole model only when the stages are many, and the gather holds one pipeline's
state at once. Loading needs nothing sent: every rank reads the whole state and keeps its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torchplug.plugin import ConfigurationError, map_tensors
from torchplug.plugins.pipeline.stages import Stages, like


def _cpu(value: Any) -> Any:
    """Whole tensors on the CPU (a stage sharded over dp_shard/tp gathered: every rank of the
    stage calls this on the same names)."""
    from torch.distributed.tensor import DTensor

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return tensor.detach().cpu()

    return map_tensors(value, whole)


def _everyone(stages: Stages, local: Any) -> list[Any]:
    everyone: list[Any] = [None] * stages.pp
    dist.all_gather_object(everyone, local, group=stages.group)
    return everyone


def model_state(stages: Stages) -> dict[str, Any]:
    """Every state name of the model, with the value its lowest holder has, on every rank."""
    state = stages.model.state_dict()
    if not stages.owned:  # not traced yet: every rank has the whole model
        return dict(state)
    mine = {k: _cpu(v) for k, v in state.items() if stages.owner(k) == stages.pp_rank}
    merged: dict[str, Any] = {}
    for part in _everyone(stages, mine):
        for name, value in part.items():
            merged.setdefault(name, value)
    return {k: merged[k].to(stages.device) for k in stages.layout if k in merged}


def load_model_state(stages: Stages, state: dict[str, Any], strict: bool) -> None:
    """Each rank copies the entries of the tensors it holds."""
    if strict:
        missing = sorted(set(stages.layout) - set(state))
        unexpected = sorted(set(state) - set(stages.layout))
        if missing or unexpected:
            raise ConfigurationError(
                f"The model state does not match the pipelined model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}. Load a checkpoint of this model, or pass "
                f"strict=False."
            )
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, tensor in stages.tensors():
            if name in state and stages.held_here(tensor):
                value = like(state[name], tensor)
                if isinstance(tensor, DTensor):
                    tensor.to_local().copy_(value.to_local())
                else:
                    tensor.copy_(value)


def optimizer_state(stages: Stages, local: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's state over the whole model (DCP's layout: ``state`` and
    ``param_groups`` by parameter name) from each rank's ``local`` share."""
    if not stages.owned:
        return local
    order = list(dict(stages.model.named_parameters()))
    state: dict[str, Any] = {}
    groups = [dict(g, params=set()) for g in local["param_groups"]]
    mine = {"state": _cpu(local["state"]), "groups": local["param_groups"]}
    for part in _everyone(stages, mine):
        for name, value in part["state"].items():
            state.setdefault(name, value)
        for group, theirs in zip(groups, part["groups"], strict=True):
            group["params"] |= set(theirs["params"])
    for group in groups:
        group["params"] = sorted(group["params"], key=order.index)
    return {"state": state, "param_groups": groups}


def optimizer_subset(
    stages: Stages, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> dict[str, Any]:
    """The part of a whole model's optimizer ``state`` that this rank's ``optimizer`` holds."""
    if not stages.owned:
        return state
    params = dict(stages.model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    mine = {names[id(p)] for g in optimizer.param_groups for p in g["params"]}
    return {
        "state": {
            k: {key: like(value, params[k]) for key, value in v.items()}
            for k, v in state["state"].items()
            if k in mine
        },
        "param_groups": [
            dict(g, params=[n for n in g["params"] if n in mine]) for g in state["param_groups"]
        ],
    }


__all__ = ["load_model_state", "model_state", "optimizer_state", "optimizer_subset"]
