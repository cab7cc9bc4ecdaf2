"""``Engine(profile=...)``: torch.profiler over chosen optimizer steps, one trace per rank.

The schedule counts optimizer steps (the ones ``optimizer.step()`` takes through the Engine):
``wait`` steps untouched, ``warmup`` steps profiled and thrown away (the profiler's own start-up
cost), then ``active`` steps recorded. Each rank then writes its trace as
``DIR/rank-N.<time>.pt.trace.json`` (torch's ``tensorboard_trace_handler``: the Chrome trace
format that TensorBoard's profiler plugin and Perfetto read) and the profiler stops, so the
rest of the run costs nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from torchplug.contract.errors import ConfigurationError

#: What ``Engine(profile={...})`` takes, with the defaults of ``profile=True``.
DEFAULTS: dict[str, Any] = {
    "wait": 1,
    "warmup": 1,
    "active": 3,
    "dir": None,  # LOG_DIR/profile
    "record_shapes": False,
    "profile_memory": False,
    "with_stack": False,
}


def options(profile: Any, log_dir: Path) -> dict[str, Any] | None:
    """The profiler's settings from ``Engine(profile=...)``: ``None``/``False`` (off), ``True``
    (the defaults) or a dict of `DEFAULTS`' keys."""
    if profile is None or profile is False:
        return None
    if profile is True:
        chosen: dict[str, Any] = {}
    elif isinstance(profile, Mapping):
        chosen = dict(profile)
    else:
        raise ConfigurationError(
            f"profile must be True, False or a dict of {sorted(DEFAULTS)}, got "
            f"{type(profile).__name__} {profile!r}. Pass e.g. profile={{'active': 5}}."
        )
    unknown = sorted(set(chosen) - set(DEFAULTS))
    if unknown:
        raise ConfigurationError(
            f"profile got unknown key(s) {unknown}; it takes {sorted(DEFAULTS)}. Fix the name."
        )
    settings = {**DEFAULTS, **chosen}
    for key in ("wait", "warmup", "active"):
        value = settings[key]
        low = 1 if key == "active" else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigurationError(
                f"profile[{key!r}] must be a whole number >= {low} (optimizer steps), got "
                f"{value!r}."
            )
    where = settings["dir"]
    if where is not None and (isinstance(where, bool) or not isinstance(where, (str, os.PathLike))):
        raise ConfigurationError(
            f"profile['dir'] must be a directory path, got {type(where).__name__} {where!r}."
        )
    settings["dir"] = Path(where) if where is not None else log_dir / "profile"
    return settings


class StepProfiler:
    """torch.profiler driven by the Engine's optimizer steps; stops once its trace is written."""

    def __init__(self, settings: dict[str, Any], rank: int, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        self.directory = settings["dir"]
        self.directory.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.steps_left = settings["wait"] + settings["warmup"] + settings["active"]
        self._profiler = profile(
            activities=activities,
            schedule=schedule(
                wait=settings["wait"],
                warmup=settings["warmup"],
                active=settings["active"],
                repeat=1,
            ),
            on_trace_ready=tensorboard_trace_handler(str(self.directory), f"rank-{rank}"),
            record_shapes=settings["record_shapes"],
            profile_memory=settings["profile_memory"],
            with_stack=settings["with_stack"],
        )
        self._profiler.start()
        self.running = True

    def step(self) -> None:
        """After an optimizer step: advance the schedule; the last step writes the trace."""
        if not self.running:
            return
        self._profiler.step()
        self.steps_left -= 1
        if self.steps_left <= 0:
            self.stop()

    def stop(self) -> None:
        """Stop (at the end of the schedule, or at ``engine.close()`` before it)."""
        if self.running:
            self.running = False
            self._profiler.stop()


@contextlib.contextmanager
def block(
    settings: dict[str, Any], rank: int, device: torch.device, barrier: Callable[[], None]
) -> Iterator[Any]:
    """`Engine.profile`: torch's profiler over one block, yielded (``prof.key_averages()``,
    ``prof.step()`` under a ``schedule``), as Accelerate's ``accelerator.profile()``. With
    ``dir``, each rank writes ``DIR/profile_<rank>.json`` (Accelerate's name: a Chrome trace)
    after the block, and the ranks leave together, as there. ``schedule`` may be a dict of
    ``torch.profiler.schedule``'s keywords (Accelerate's ``schedule_option``)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    settings = dict(settings)
    where = settings.pop("dir", None)
    if isinstance(settings.get("schedule"), Mapping):
        settings["schedule"] = schedule(**settings["schedule"])
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    settings.setdefault("activities", activities)
    try:
        profiler = profile(**settings)
    except TypeError as exc:
        raise ConfigurationError(
            f"engine.profile(...): {exc}. It takes torch.profiler.profile's keywords "
            f"(record_shapes, profile_memory, with_stack, with_flops, schedule, on_trace_ready) "
            f"and dir=... (where each rank's Chrome trace is written)."
        ) from None
    with profiler:
        yield profiler
    if where is not None:
        Path(where).mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(Path(where) / f"profile_{rank}.json"))
        barrier()
