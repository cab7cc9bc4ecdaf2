"""torchplug's built-in loggers, announced like any third-party logger plugin.

Announcing imports nothing: each factory imports its module when the logger is selected.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from torchplug.contract.spec import hookimpl
from torchplug.contract.types import LoggerInfo


def _csv(log_dir: str | os.PathLike[str]) -> object:
    from torchplug.loggers.files import CSVLogger

    return CSVLogger(log_dir)


def _jsonl(log_dir: str | os.PathLike[str]) -> object:
    from torchplug.loggers.files import JSONLLogger

    return JSONLLogger(log_dir)


def _tensorboard(log_dir: str | os.PathLike[str]) -> object:
    from torchplug.loggers.tensorboard import TensorBoardLogger

    return TensorBoardLogger(log_dir)


@hookimpl
def torchplug_register_loggers(register: Callable[[LoggerInfo], None]) -> None:
    register(LoggerInfo("csv", _csv, "metrics.csv in the log directory, one row per value"))
    register(LoggerInfo("jsonl", _jsonl, "metrics.jsonl in the log directory, one line per call"))
    register(
        LoggerInfo(
            "tensorboard",
            _tensorboard,
            "TensorBoard event files (log_dir/tensorboard)",
            requires=("tensorboard",),
            install_hint="pip install torchplug[tensorboard]",
        )
    )
