"""One way to map a function over the tensors in nested batches, outputs and states.

Containers keep their type: dicts (and subclasses such as a Hugging Face ``ModelOutput`` or an
``OrderedDict``), namedtuples, lists and tuples come back as what they were, so a model's output
object keeps its attributes (``out.loss``) after torchplug moved or cast it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor inside it, containers rebuilt as they were.

    Args:
        value: A tensor, or containers (dict, list, tuple, namedtuple) holding tensors.
        fn: Applied to each tensor; its result takes the tensor's place.
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps the class, whatever its constructor takes
        for key, item in value.items():
            out[key] = map_tensors(item, fn)
        return out
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def cast_floating(value: Any, dtype: torch.dtype, only: tuple[torch.dtype, ...] = ()) -> Any:
    """Floating tensors in ``value`` cast to ``dtype`` (only those of ``only`` dtypes, if given).

    Args:
        value: A tensor or containers of tensors.
        dtype: The dtype to cast to.
        only: Cast only tensors of these dtypes (all floating ones when empty).
    """

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point() or (only and tensor.dtype not in only):
            return tensor
        return tensor.to(dtype)

    return map_tensors(value, cast)
