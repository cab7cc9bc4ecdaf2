"""The file loggers: ``csv`` (one row per metric value) and ``jsonl`` (one object per call).

Both append, so a resumed run continues the same files; neither needs a package.
"""

from __future__ import annotations

import csv
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchplug.loggers import Logger


class CSVLogger(Logger):
    """``log_dir/metrics.csv`` with the columns ``step,name,value,time`` (long format).

    One row per value keeps the file valid when later calls log other names (eval metrics,
    learning rate) than the first; pivot it with ``pandas.read_csv(...).pivot(...)``.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.path = Path(log_dir) / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file = self.path.open("a", newline="")
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(["step", "name", "value", "time"])
            self._file.flush()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        now = round(time.time(), 3)
        for name, value in metrics.items():
            self._writer.writerow([step, name, repr(float(value)), now])
        self._file.flush()

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """``log_dir/hparams.json``; a later call adds to (and updates) what is there, as the
        other loggers keep every call."""
        path = self.path.parent / "hparams.json"
        merged: dict[str, Any] = {}
        if path.is_file():
            try:
                found = json.loads(path.read_text())
                merged = found if isinstance(found, dict) else {}
            except (OSError, ValueError):
                merged = {}
        merged.update(params)
        path.write_text(json.dumps(merged, indent=2, default=str) + "\n")

    def close(self) -> None:
        self._file.close()


class JSONLLogger(Logger):
    """``log_dir/metrics.jsonl``: one JSON object per call, ``{"step": N, "time": T, ...}``."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.path = Path(log_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        record = {"step": step, "time": round(time.time(), 3), **metrics}
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._file.write(json.dumps({"hparams": dict(params)}, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
