"""Metric loggers: what ``engine.log(metrics, step)`` writes to.

A logger is chosen by name, as a strategy is (``Engine(loggers=["csv", "tensorboard"])``,
``torchplug launch --logger csv``, ``TORCHPLUG_LOGGERS=csv``), and comes from a plugin that
announces it through ``torchplug_register_loggers``. The built-ins (`builtin`) are
``csv``, ``jsonl`` and ``tensorboard``; the ``torchplug-mlflow`` and ``torchplug-wandb`` contrib
packages add ``mlflow`` and ``wandb``. A logger object is anything with
[`Logger.log_metrics`][torchplug.Logger.log_metrics] and [`Logger.close`][torchplug.Logger.close].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchplug.features.metrics import to_number  # noqa: F401 - public here since API 1.0


class Logger:
    """The interface of a logger object (subclassing it is optional: duck typing suffices).

    Made by a [`LoggerInfo`][torchplug.plugin.LoggerInfo] factory as ``factory(log_dir)`` on the
    ranks that log (rank 0 by default).
    """

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` (name -> number) at ``step``.

        Args:
            metrics: Metric names and numbers.
            step: The step they belong to.
        """
        raise NotImplementedError

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:  # noqa: B027 - optional
        """Record the run's settings once (optional).

        Args:
            params: Setting names and values (flat: nested mappings arrive as ``"a.b"`` keys).
        """

    def close(self) -> None:  # noqa: B027 - optional
        """Flush and release files (optional)."""
