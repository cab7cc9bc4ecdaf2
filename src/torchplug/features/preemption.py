"""A scheduler's notice that the job will be stopped, turned into a flag the loop can read.

SLURM, Kubernetes and ``torchplug launch`` (passing on its own SIGTERM) send SIGTERM before they
kill a job; ``srun --signal=USR1@90`` sends SIGUSR1 ahead of the time limit. By default either
ends the process at once, wherever it is. ``engine.preempted`` changes that only for a script
that asks: the first read puts a handler on those signals which just notes the signal, so the
loop can save a checkpoint at a step boundary and leave, within the launcher's grace period
(``torchplug launch --shutdown-timeout``, torchrun's, 30 s by default). A script that never
reads it keeps the default behaviour (a rank stuck in a collective still dies at once).

Ranks receive the signal at slightly different moments; a checkpoint is a collective, so the
answer is agreed on: every rank is told ``True`` at the same read once any rank saw a signal.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The notices handled: what schedulers send ahead of a stop. SIGINT stays Ctrl-C's.
NOTICES = ("SIGTERM", "SIGUSR1")

#: Set by ``torchplug launch`` to a directory the ranks leave notes in for its summary.
STATUS_ENV = "TORCHPLUG_LAUNCH_STATUS"


class Preemption:
    """The handler for one Engine: armed on first use, removed at ``close()``."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.agreed = False
        self.armed = False
        self._previous: dict[int, Any] = {}

    @classmethod
    def armed(cls, undo: list[Callable[[], None]]) -> Preemption:
        """A handler armed now, its removal first on ``undo`` (what ``close()`` runs)."""
        notice = cls()
        if notice.arm():
            undo.insert(0, notice.disarm)
        return notice

    def arm(self) -> bool:
        """Note NOTICES from now on (chaining to a handler the script had set). Only the main
        thread can set handlers; elsewhere nothing is armed and ``False`` is returned."""
        if self.armed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        for name in NOTICES:
            number = getattr(signal, name, None)
            if number is None:
                continue
            previous = signal.getsignal(number)
            if previous == signal.SIG_IGN:
                continue  # the script (or its parent) said to ignore it: keep that
            self._previous[number] = previous
            signal.signal(number, self._chain(previous))
        self.armed = True
        return True

    def _chain(self, previous: Any) -> Callable[[int, Any], None]:
        def noted(number: int, frame: Any) -> None:
            if self.received is None:
                self.received = number
            if callable(previous):
                previous(number, frame)

        return noted

    def seen(self, any_rank: Callable[[bool], bool] | None) -> bool:
        """`Engine.preempted`: whether any rank has been sent a notice, agreed on through
        ``any_rank`` (a collective; ``None`` on one process) and kept once true."""
        if not self.agreed:
            seen = self.received is not None
            self.agreed = any_rank(seen) if any_rank is not None else seen
        return self.agreed

    def disarm(self) -> None:
        """Put back the handlers that were there before `arm`."""
        if threading.current_thread() is not threading.main_thread():
            return
        for number, previous in self._previous.items():
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        self.armed = False


def signal_name(number: int | None) -> str:
    try:
        return signal.Signals(int(number)).name  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return f"signal {number}"


def note_checkpoint(path: Path, step: int) -> None:
    """Tell ``torchplug launch`` (if it started this rank) where the newest checkpoint is, so a
    stopped job's summary can name it. One small file, written atomically, at save time only."""
    directory = os.environ.get(STATUS_ENV)
    if not directory or not os.path.isdir(directory):
        return
    target = Path(directory) / "last_checkpoint"
    temporary = target.with_name(f".last_checkpoint.{os.getpid()}")
    try:
        temporary.write_text(f"{step}\n{Path(path).resolve()}\n")
        os.replace(temporary, target)
    except OSError:
        pass  # a note for a summary: never a reason to fail the save


def last_checkpoint(directory: str | os.PathLike[str]) -> tuple[int, str] | None:
    """What `note_checkpoint` left in ``directory``: (step, path), or ``None``."""
    try:
        step, path = (Path(directory) / "last_checkpoint").read_text().splitlines()[:2]
        return int(step), path
    except (OSError, ValueError):
        return None
