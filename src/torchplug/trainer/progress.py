"""The Trainer's progress display on rank 0: a tqdm bar (or rich, when tqdm is missing, or a
plain one-line bar of its own with the base install, so nothing extra is needed) with loss,
samples/s and ETA on a terminal; nothing but one line per epoch elsewhere (logs, CI). A resumed
epoch's bar starts where the checkpoint left the epoch, and its ETA counts only the steps run
since, so it reaches 100 % with a right estimate."""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Mapping
from typing import Any

#: The bar packages used when installed, in order of preference; else the plain text bar.
BARS: tuple[str, ...] = ("tqdm", "rich")


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
        self._text: _TextBar | None = None
        self.kind = "none"
        if enabled:
            found = [kind for kind in BARS if importlib.util.find_spec(kind) is not None]
            self.kind = found[0] if found else "text"

    def start(self, epoch: int, total: int | None, initial: int = 0) -> None:
        """A bar for ``epoch`` of ``total`` steps, ``initial`` of them done already (resumed)."""
        if self.kind == "tqdm":
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total, initial=initial, desc=f"epoch {epoch + 1}", unit="step", leave=True
            )
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
            self._task = self._rich.add_task(
                f"epoch {epoch + 1}", total=total, completed=initial, info=""
            )
        elif self.kind == "text":
            self._text = _TextBar(epoch, total, initial)

    def update(self, loss: float, rates: Mapping[str, float] | float | None = None) -> None:
        """One step done: its loss and the rates to show (``samples_per_s``,
        ``tokens_per_s``, ``mfu``; a number is samples/s)."""
        if not isinstance(rates, Mapping):
            rates = {} if rates is None else {"samples_per_s": float(rates)}
        info = f"loss {loss:.4f}"
        if "samples_per_s" in rates:
            info += f"  {rates['samples_per_s']:,.0f} samples/s"
        if "tokens_per_s" in rates:
            info += f"  {rates['tokens_per_s']:,.0f} tokens/s"
        if "mfu" in rates:
            info += f"  MFU {100 * rates['mfu']:.1f}%"
        if self._bar is not None:
            self._bar.set_postfix_str(info, refresh=False)
            self._bar.update(1)
        elif self._rich is not None:
            self._rich.update(self._task, advance=1, info=info)
        elif self._text is not None:
            self._text.update(info)

    def end(self) -> None:
        if self._text is not None:
            self._text.close()
            self._text = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._rich is not None:
            self._rich.stop()
            self._rich = None


class _TextBar:
    """One line on stderr, rewritten in place: ``epoch 2  37/120 [31%] ETA 0:12  loss ...``."""

    def __init__(self, epoch: int, total: int | None, initial: int) -> None:
        self.epoch, self.total, self.initial, self.count = epoch, total, initial, initial
        self.started = time.perf_counter()
        self.info = ""
        self._draw()

    def update(self, info: str) -> None:
        self.count += 1
        self.info = info
        self._draw()

    def _draw(self) -> None:
        line = f"epoch {self.epoch + 1}  {self.count}"
        if self.total:
            line += f"/{self.total} [{100 * self.count // self.total:3d}%]"
            done = self.count - self.initial  # this run's steps: a resume's rate is its own
            if done > 0 and self.count < self.total:
                rate = done / max(time.perf_counter() - self.started, 1e-9)
                left = int((self.total - self.count) / rate)
                line += f" ETA {left // 60}:{left % 60:02d}"
        if self.info:
            line += f"  {self.info}"
        sys.stderr.write("\r" + line)
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()
