"""``torchplug.launch(fn, *args, nprocs=N)``: run a function on N ranks from Python or a notebook.

The ranks are started by torch.distributed's elastic launcher API
(`torch.distributed.launcher.api.elastic_launch`, what ``torchrun`` runs), single node,
with a fresh rendezvous on a free local port: no home-made spawning. Inside ``fn``,
``Engine()`` sees a world of N (``strategy="auto"`` picks ``ddp``, or the ``strategy`` given
here). Rank 0's return value is returned; when a rank raises,
[`RankFailedError`][torchplug.RankFailedError] is raised here with that rank's traceback.

Processes are forked where the platform allows it and CUDA is not initialized in the caller
(what makes functions defined in a notebook cell work), else spawned (then ``fn`` must be
importable: a module-level function of a file, guarded by ``if __name__ == "__main__"``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torchplug.contract.errors import ConfigurationError, TorchplugError


class RankFailedError(TorchplugError):
    """A rank started by [`launch`][torchplug.launch] raised; the message holds its traceback.

    Args:
        message: The error message (the rank's exception and traceback).
        rank: The rank that raised.
        traceback: That rank's formatted traceback.
    """

    def __init__(self, message: str, rank: int, traceback: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback


@contextlib.contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start_method(requested: str | None) -> str:
    if requested is not None:
        if requested not in ("fork", "spawn", "forkserver"):
            raise ConfigurationError(
                f"launch: start_method={requested!r} is not one of 'fork', 'spawn', "
                f"'forkserver' (or None to choose)."
            )
        return requested
    import torch

    if "fork" in multiprocessing.get_all_start_methods() and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def _failure_story(failure: Any) -> tuple[str, str]:
    """``(one line, traceback)`` of a rank's failure from its elastic error file."""
    data = getattr(failure, "error_file_data", None) or {}
    if not data and failure.error_file and os.path.isfile(failure.error_file):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(Path(failure.error_file).read_text())
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        text = str(message.get("message", "")).strip()
        trace = str(message.get("extraInfo", {}).get("py_callstack", "")).strip()
        return text.splitlines()[0] if text else "failed", trace
    if failure.exitcode is not None and failure.exitcode < 0:
        return f"stopped by signal {failure.signal_name()}", ""
    return f"exit code {failure.exitcode}", ""


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int = 2,
    strategy: str | None = None,
    precision: str | None = None,
    max_restarts: int = 0,
    start_method: str | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` ranks of this machine; return rank 0's result.

    ``strategy``/``precision`` act as ``torchplug launch --strategy/--precision`` would for
    ``Engine()`` inside ``fn``. Results must be picklable. A rank that raises ends the run;
    the error is raised here as [`RankFailedError`][torchplug.RankFailedError] carrying that rank's
    traceback.

    Args:
        fn: The function run on every rank (under ``spawn`` it must be picklable: defined at
            module level).
        *args: Passed to ``fn``.
        nprocs: The number of ranks.
        strategy: The strategy ``Engine()`` selects inside ``fn`` (``None``: its own choice).
        precision: The precision ``Engine()`` runs inside ``fn`` (``None``: its own choice).
        max_restarts: Restart all ranks up to this many times after a failure (as ``torchplug launch
            --max-restarts``).
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"``; ``None``: fork where
            available and CUDA is not initialised yet, else spawn.
        **kwargs: Passed to ``fn``.

    Returns:
        What ``fn`` returned on rank 0.

    Raises:
        RankFailedError: A rank raised (after the restarts).
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigurationError(
            f"launch: nprocs={nprocs!r} is not a number of processes; expected a whole number "
            f"of 1 or more. Fix: e.g. torchplug.launch(fn, nprocs=2)."
        )
    if not callable(fn):
        raise TypeError(f"launch: fn must be a function to run on every rank, got {fn!r}.")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise ConfigurationError(
            "launch: this process is already part of a process group (an Engine is open, or "
            "this code runs under torchrun). Close the Engine first, or call fn directly."
        )
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from torchplug.engine import config
    from torchplug.engine.config import normalize_precision

    method = _start_method(start_method)
    config_ = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"torchplug-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=method,
    )
    target = fn
    if kwargs:
        target = functools.update_wrapper(functools.partial(fn, **kwargs), fn)
    env: dict[str, str | None] = {
        config.LAUNCH_ENV["strategy"]: strategy,
        config.LAUNCH_ENV["precision"]: None
        if precision is None
        else normalize_precision(precision),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    # The agent's own failure report and its "terminating process" notes: replaced by ours.
    quiet = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.CRITICAL)
    try:
        with _environment(env):
            results = elastic_launch(config_, target)(*args)
    except ChildFailedError as exc:
        rank, failure = min(exc.failures.items(), key=lambda item: item[1].timestamp)
        line, trace = _failure_story(failure)
        raise RankFailedError(
            f"Rank {rank} of {nprocs} failed: {line}\n\nTraceback of rank {rank}:\n"
            f"{trace or '(none recorded; its output is above)'}",
            rank,
            trace,
        ) from None
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
    return results.get(0) if isinstance(results, dict) else results
