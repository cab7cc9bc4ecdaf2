"""The loggers of one Engine: which ones (by name, with where the names came from), made on the
ranks that log, and ``engine.log`` routed to them.

Order, highest first: ``Engine(loggers=[...])`` > ``torchplug launch --logger NAME`` (handed to
the processes as ``TORCHPLUG_LAUNCH_LOGGERS``) > ``TORCHPLUG_LOGGERS=a,b`` > none. The directory:
``Engine(log_dir=...)`` > ``TORCHPLUG_LOG_DIR`` > ``./logs``.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torchplug.contract.errors import ConfigurationError


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1}}`` as ``{"optim.lr": 1}``: what MLflow and TensorBoard's hparams
    take (flat names to plain values)."""
    flat: dict[str, Any] = {}
    for name, value in params.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, f"{key}."))
        else:
            flat[key] = value
    return flat


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


LAUNCH_LOGGERS_ENV = "TORCHPLUG_LAUNCH_LOGGERS"
LOGGERS_ENV = "TORCHPLUG_LOGGERS"
LOG_DIR_ENV = "TORCHPLUG_LOG_DIR"
DEFAULT_LOG_DIR = "logs"


def _names(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def requested(
    code: Iterable[str | object] | str | None,
    env: Mapping[str, str] | None = None,
    from_file: Any = None,
) -> tuple[list[str | object], str]:
    """The loggers asked for (names or logger objects) and the source they came from;
    ``from_file`` is the config file's ``loggers`` setting (``Settings.file_loggers``)."""
    env = os.environ if env is None else env
    if isinstance(code, str):
        code = _names(code)
    if code is not None and list(code):
        return list(code), "code argument"
    if env.get(LAUNCH_LOGGERS_ENV):
        return list(_names(env[LAUNCH_LOGGERS_ENV])), "torchplug launch --logger"
    if env.get(LOGGERS_ENV):
        return list(_names(env[LOGGERS_ENV])), f"environment {LOGGERS_ENV}"
    if from_file is not None:
        return list(from_file.value), from_file.source
    return [], "default"


class LoggerSet:
    """The loggers of one Engine. Names are checked at once (a typo fails before training);
    the logger objects are made on the first `log`, on rank 0 (every rank for loggers that
    declare ``all_ranks``), so a rank that does not log opens no file."""

    def __init__(
        self,
        loggers: Iterable[str | object] | str | None,
        log_dir: str | os.PathLike[str] | None,
        registry: Any,
        from_file: Any = None,
    ) -> None:
        wanted, self.source = requested(loggers, from_file=from_file)
        if log_dir is not None and (
            isinstance(log_dir, bool)
            or not isinstance(log_dir, (str, os.PathLike))
            or not str(os.fspath(log_dir)).strip()
        ):
            raise ConfigurationError(
                f"log_dir must be a non-empty directory path (str or pathlib.Path), got "
                f"{type(log_dir).__name__} {log_dir!r}. Pass e.g. log_dir='logs', or leave it out "
                f"for {LOG_DIR_ENV} or ./{DEFAULT_LOG_DIR}."
            )
        self.log_dir = Path(log_dir or os.environ.get(LOG_DIR_ENV) or DEFAULT_LOG_DIR)
        self.infos: list[Any] = []
        self.objects: list[object] = []
        for item in wanted:
            if isinstance(item, str):
                try:
                    self.infos.append(registry.logger(item))
                except ConfigurationError as exc:
                    if self.source == "code argument":
                        raise
                    raise ConfigurationError(f"{exc} (The name came from {self.source}.)") from None
            elif callable(getattr(item, "log_metrics", None)):
                self.objects.append(item)
            else:
                raise ConfigurationError(
                    f"loggers: {item!r} is neither a logger name nor an object with "
                    f"log_metrics(metrics, step). Pass a name such as 'csv' (`torchplug plugins` "
                    f"lists them) or a logger object."
                )
        self._made: list[object] | None = None
        self.step = 0

    @property
    def names(self) -> list[str]:
        return [info.name for info in self.infos]

    def __bool__(self) -> bool:
        return bool(self.infos or self.objects)

    def active(self, rank: int) -> list[object]:
        """The logger objects of this rank, made on first use."""
        if self._made is None:
            made: list[object] = []
            for info in self.infos:
                if rank == 0 or info.all_ranks:
                    where = self.log_dir if rank == 0 else self.log_dir / f"rank-{rank}"
                    made.append(info.factory(where))
            self._made = made + (self.objects if rank == 0 else [])
        return self._made

    def log(self, rank: int, metrics: Mapping[str, Any], step: int | None) -> None:
        """`Engine.log`: ``metrics`` at ``step`` (``None``: the step after the last)."""
        if not isinstance(metrics, Mapping):
            raise TypeError(
                f"engine.log expects a dict of metric names to numbers, e.g. "
                f"engine.log({{'loss': 0.5}}, step=10), got {type(metrics).__name__}."
            )
        if step is None:
            step = self.step
        self.step = step + 1
        loggers = self.active(rank)
        if not loggers:
            return
        values = {str(name): to_number(str(name), value) for name, value in metrics.items()}
        for logger in loggers:
            logger.log_metrics(values, step)

    def log_hyperparams(self, rank: int, params: Mapping[str, Any]) -> None:
        """`Engine.log_hyperparams`: nested mappings flattened to ``"a.b"`` keys."""
        if not isinstance(params, Mapping):
            raise ConfigurationError(
                f"engine.log_hyperparams expects a dict of names to values, e.g. "
                f"engine.log_hyperparams({{'lr': 3e-4, 'batch_size': 32}}), got "
                f"{type(params).__name__}."
            )
        for logger in self.active(rank):
            method = getattr(logger, "log_hyperparams", None)
            if callable(method):
                method(flatten_params(params))

    def close(self) -> None:
        for logger in self._made or []:
            close = getattr(logger, "close", None)
            if callable(close):
                close()
        self._made = None


def call_callbacks(
    callbacks: Iterable[object], hook_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[Any]:
    """`Engine.call`: ``hook_name(*args, **kwargs)`` on each callback that has that method."""
    results = []
    for callback in callbacks:
        method = getattr(callback, hook_name, None)
        if method is None:
            continue
        if not callable(method):
            raise ConfigurationError(
                f"engine.call({hook_name!r}): callback {type(callback).__name__} has an "
                f"attribute {hook_name!r} that is not callable ({type(method).__name__}). "
                f"Rename it, or make it a method."
            )
        results.append(method(*args, **kwargs))
    return results
