"""torchplug logger plugin for MLflow: ``Engine(loggers=["mlflow"])``,
``torchplug launch --logger mlflow``.

Announcing imports nothing; mlflow is imported when a user selects the logger. Without
``MLFLOW_TRACKING_URI`` runs go to ``./mlruns`` (MLflow's local file store, no server; the
plugin sets ``MLFLOW_ALLOW_FILE_STORE=true``, which MLflow 3 asks for). Set
``MLFLOW_TRACKING_URI`` (``sqlite:///mlflow.db``, a server) for anything else.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torchplug.plugin import LoggerInfo, hookimpl

EXPERIMENT_ENV = "TORCHPLUG_MLFLOW_EXPERIMENT"


class MLflowLogger:
    """One MLflow run for the Engine's lifetime; metrics by name and step."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        import mlflow

        self._mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 keeps the file store behind an opt-in; a local directory needs no server
            # or database, which is the point of this default.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri(Path("mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get(EXPERIMENT_ENV, "torchplug"))
        self.run = mlflow.start_run()
        mlflow.set_tag("torchplug.log_dir", str(log_dir))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._mlflow.log_metrics(dict(metrics), step=step)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._mlflow.log_params({k: str(v) for k, v in params.items()})

    def close(self) -> None:
        self._mlflow.end_run()


def _factory(log_dir: str | os.PathLike[str]) -> MLflowLogger:
    return MLflowLogger(log_dir)


@hookimpl
def torchplug_register_loggers(register: Callable[[LoggerInfo], None]) -> None:
    register(
        LoggerInfo(
            "mlflow",
            _factory,
            "an MLflow run (./mlruns unless MLFLOW_TRACKING_URI is set)",
            requires=("mlflow",),
            install_hint="pip install torchplug-mlflow",
        )
    )
