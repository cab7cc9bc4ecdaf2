"""torchplug logger plugin for Weights & Biases: ``Engine(loggers=["wandb"])``,
``torchplug launch --logger wandb``.

Announcing imports nothing; wandb is imported when the logger first logs (on rank 0: the other
ranks never make it). The options are wandb's own environment variables, which ``wandb.init``
reads: ``WANDB_PROJECT`` (default here: ``torchplug``), ``WANDB_ENTITY``, ``WANDB_NAME`` (the run
name), ``WANDB_DIR`` (default here: the torchplug log directory, so the run files land in
``LOG_DIR/wandb/``), ``WANDB_MODE`` (``online``, ``offline``: no account, no network;
``disabled``), ``WANDB_TAGS`` (comma-separated), ``WANDB_RUN_GROUP``, ``WANDB_JOB_TYPE``,
``WANDB_NOTES``, ``WANDB_RUN_ID`` / ``WANDB_RESUME``. In code, pass a logger object instead:
``Engine(loggers=[WandbLogger(project="demo", tags=["baseline"], mode="offline")])`` (its keywords
go to ``wandb.init`` and win over the variables).

Metrics are logged with their torchplug step as the ``global_step`` key, which every chart uses as
its x axis (``define_metric``), so a step logged out of order (an eval at an earlier step) is kept
rather than dropped by wandb's own monotonic step. Hyperparameters go into the run config.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torchplug.plugin import LoggerInfo, hookimpl

#: The history key holding torchplug's step; every metric is charted against it.
STEP_KEY = "global_step"
DEFAULT_PROJECT = "torchplug"
INSTALL_HINT = "pip install wandb"


class WandbLogger:
    """One wandb run for the Engine's lifetime; metrics by name and step, hyperparameters as
    the run config.

    The run starts on the first call that needs it (``log_metrics``, ``log_hyperparams`` or
    ``run``), so an object made on every rank opens a run only where it logs (rank 0). If a wandb
    run is already active in the process (the user's own ``wandb.init``), it is used and left
    open on `close`.
    """

    def __init__(self, log_dir: str | os.PathLike[str] | None = None, **init: Any) -> None:
        self.log_dir = log_dir
        self.init = init
        self._run: Any = None
        self._owned = False

    @property
    def run(self) -> Any:
        """The ``wandb`` run (started if it was not): for what torchplug does not log (media,
        tables, artifacts)."""
        if self._run is None:
            self._start()
        return self._run

    def _start(self) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(
                f"The 'wandb' logger needs the wandb package, which is not importable here "
                f"({exc}). Install it with `{INSTALL_HINT}`."
            ) from exc
        if wandb.run is not None:
            self._run, self._owned = wandb.run, False
        else:
            kwargs: dict[str, Any] = {"project": os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT}
            where = os.environ.get("WANDB_DIR") or self.log_dir
            if where is not None:
                Path(where).mkdir(parents=True, exist_ok=True)
                kwargs["dir"] = str(where)
            kwargs.update(self.init)
            self._run, self._owned = wandb.init(**kwargs), True
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log({**metrics, STEP_KEY: step})

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Into the run config; a later call adds to (and updates) what is there."""
        self.run.config.update({k: _plain(v) for k, v in params.items()}, allow_val_change=True)

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None and self._owned:
            run.finish()


def _plain(value: Any) -> Any:
    """A value the run config can hold: as given when it is JSON, else its text."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def _factory(log_dir: str | os.PathLike[str]) -> WandbLogger:
    return WandbLogger(log_dir)


@hookimpl
def torchplug_register_loggers(register: Callable[[LoggerInfo], None]) -> None:
    register(
        LoggerInfo(
            "wandb",
            _factory,
            "a Weights & Biases run (WANDB_PROJECT, WANDB_MODE, ...; files in LOG_DIR/wandb)",
            requires=("wandb",),
            install_hint=INSTALL_HINT,
        )
    )
