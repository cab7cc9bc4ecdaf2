"""Metric loggers: what ``engine.log(metrics, step)`` writes to.

A logger is chosen by name, as a strategy is (``Engine(loggers=["csv", "tensorboard"])``,
``torchplug launch --logger csv``, ``TORCHPLUG_LOGGERS=csv``), and comes from a plugin that
announces it through ``torchplug_register_loggers``. The built-ins (:mod:`.builtin`) are
``csv``, ``jsonl`` and ``tensorboard``; the ``torchplug-mlflow`` contrib package adds
``mlflow``. A logger object is anything with :meth:`Logger.log_metrics` and :meth:`Logger.close`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any


class Logger:
    """The interface of a logger object (subclassing it is optional: duck typing suffices).

    Made by a :class:`~torchplug.LoggerInfo` factory as ``factory(log_dir)`` on the ranks that log
    (rank 0 by default).
    """

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` (name -> number) at ``step``."""
        raise NotImplementedError

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:  # noqa: B027 - optional
        """Record the run's settings once (optional)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Flush and release files (optional)."""


def to_number(name: str, value: Any) -> float:
    """A metric value as a float: numbers, 0-d or one-element tensors; else a clear error."""
    if hasattr(value, "detach") and hasattr(value, "numel"):
        if value.numel() != 1:
            raise TypeError(
                f"engine.log: metric {name!r} is a tensor of shape {tuple(value.shape)}; expected "
                f"one number. Log a reduced value, e.g. engine.reduce(x, 'mean').item()."
            )
        return float(value.detach().float().cpu().item())
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"engine.log: metric {name!r} is {type(value).__name__} {value!r}; expected a number or a "
        f"one-element tensor."
    )


def is_finite(value: float) -> bool:
    return math.isfinite(value)
