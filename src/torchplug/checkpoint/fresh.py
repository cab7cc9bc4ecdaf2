"""A never-stepped optimizer stays never-stepped when its state is read, saved or loaded.

torch's distributed state-dict API creates an optimizer's state before reading it, with one
step of zero gradients at lr 0 (``get_optimizer_state_dict``). For a never-stepped optimizer
that step counts: AdamW's next real step would be its second, with another bias correction,
and a checkpoint would say "stepped once". Reading the state from `read_optimizer_state`
undoes it: the optimizer is left as it was (no state, its groups' values as before) and the
state read is that of a fresh optimizer (``"state": {}``), which is what
``optimizer.state_dict()`` gives and what loads back as a fresh optimizer (`is_fresh`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch


def read_optimizer_state(optimizer: Any, read: Callable[[], Any]) -> Any:
    """``read()`` (a strategy's ``torchplug_optimizer_state``), leaving a never-stepped
    ``optimizer`` never stepped. A read that creates no state is returned as it is."""
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict) or state:
        return read()
    groups = [
        {
            k: v.clone() if isinstance(v, torch.Tensor) else copy.copy(v)
            for k, v in g.items()
            if k != "params"
        }
        for g in optimizer.param_groups
    ]
    payload = read()
    if not optimizer.state:
        return payload  # nothing was created (a stateless optimizer, or a reader that never steps)
    optimizer.state.clear()
    for group, before in zip(optimizer.param_groups, groups, strict=True):
        for key, value in before.items():
            now = group.get(key)
            if isinstance(now, torch.Tensor) and isinstance(value, torch.Tensor):
                now.copy_(value)  # in place: a scheduler may hold the tensor
            else:
                group[key] = value
    if isinstance(payload, Mapping) and isinstance(payload.get("state"), Mapping):
        payload = {**payload, "state": {}}
    return payload


def is_fresh(saved: Any) -> bool:
    """Whether a saved optimizer entry (its skeleton) is a never-stepped optimizer's."""
    return isinstance(saved, Mapping) and saved.get("state") == {}


def without_state(live: Any) -> Any:
    """A live optimizer state without its per-parameter state: what is read in place when a
    fresh optimizer's entry is loaded (the load then leaves the optimizer fresh)."""
    if isinstance(live, Mapping) and "state" in live:
        return {k: v for k, v in live.items() if k != "state"}
    return live
