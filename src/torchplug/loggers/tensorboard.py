"""The ``tensorboard`` logger: event files under ``log_dir/tensorboard`` through
``torch.utils.tensorboard`` (``pip install torchplug[tensorboard]``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchplug.loggers import Logger


class TensorBoardLogger(Logger):
    """Scalars for ``tensorboard --logdir LOG_DIR/tensorboard``."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.path = Path(log_dir) / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.path))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """In TensorBoard's HPARAMS tab (values other than numbers, strings and booleans as
        their text), and as a text summary."""
        plain = {
            k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in params.items()
        }
        self._writer.add_hparams(plain, {}, run_name=".")
        self._writer.add_text("hparams", "\n".join(f"{k}: {v}" for k, v in plain.items()))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
