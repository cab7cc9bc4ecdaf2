"""The Trainer's progress display on rank 0: a tqdm bar (or rich, when tqdm is missing) with
loss, samples/s and ETA on a terminal; nothing but one line per epoch elsewhere (logs, CI)."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any


def wanted(progress: bool | None, is_main: bool) -> bool:
    if not is_main:
        return False
    if progress is None:
        return sys.stderr.isatty()
    return bool(progress)


class Progress:
    """A bar over the steps of one epoch; ``update`` takes the numbers to show."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar: Any = None
        self._rich: Any = None
        self._task: Any = None
        self.kind = "none"
        if enabled:
            if importlib.util.find_spec("tqdm") is not None:
                self.kind = "tqdm"
            elif importlib.util.find_spec("rich") is not None:
                self.kind = "rich"
            else:
                self.kind = "text"

    def start(self, epoch: int, total: int | None) -> None:
        if self.kind == "tqdm":
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=f"epoch {epoch + 1}", unit="step", leave=True)
        elif self.kind == "rich":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._rich = Progress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self._rich.start()
            self._task = self._rich.add_task(f"epoch {epoch + 1}", total=total, info="")

    def update(self, loss: float, samples_per_s: float) -> None:
        info = f"loss {loss:.4f}  {samples_per_s:,.0f} samples/s"
        if self._bar is not None:
            self._bar.set_postfix_str(info, refresh=False)
            self._bar.update(1)
        elif self._rich is not None:
            self._rich.update(self._task, advance=1, info=info)

    def end(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
