"""A scheduler's notice that the job will be stopped, turned into a flag the loop can read.

SLURM, Kubernetes and ``torchplug launch`` (passing on its own SIGTERM) send SIGTERM before they
kill a job; ``srun --signal=USR1@90`` sends SIGUSR1 ahead of the time limit. ``engine.preempted``
turns either into a flag the loop reads at a step boundary, to save a checkpoint and leave within
the launcher's grace period (``torchplug launch --shutdown-timeout``, torchrun's, 30 s by
default).

The handler is armed when the Engine is made, so a notice that arrives during setup (a scheduler
that signals early, a requeue) is held for the script's first read instead of killing the
workers. A script may never read the flag, though, and SIGTERM is also how torchrun stops the
workers of a failed job, so a *SIGTERM* nobody asked about keeps its default effect, only
deferred: it ends the process at the second optimizer step after the notice with no read of
``engine.preempted`` in between, or `GRACE` seconds after it, whichever comes first (a thread
watches the signal at the C level, so a rank blocked in a collective is not spared). A SIGUSR1 is
a warning only (the scheduler stops the job itself at its time), so it is held until read. Once
the script has read ``engine.preempted``, every notice is just noted.

Ranks receive the signal at slightly different moments; a checkpoint is a collective, so the
answer is agreed on: every rank is told ``True`` at the same read once any rank saw a signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The notices handled: what schedulers send ahead of a stop. SIGINT stays Ctrl-C's.
NOTICES = ("SIGTERM", "SIGUSR1")

#: Seconds a SIGTERM the script has not asked about is held before its default effect (well
#: inside torchrun's and SLURM's 30 s between SIGTERM and SIGKILL).
GRACE = 10.0

#: Set by ``torchplug launch`` to a directory the ranks leave notes in for its summary.
STATUS_ENV = "TORCHPLUG_LAUNCH_STATUS"


class Preemption:
    """The handler for one Engine: armed when it is made, removed at ``close()``."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.agreed = False
        self.armed = False
        #: The script has read ``engine.preempted``: notices are its to act on.
        self.asked = False
        self._steps_since = 0
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
        _watcher.add(self)
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
        self.asked = True
        if not self.agreed:
            seen = self.received is not None
            self.agreed = any_rank(seen) if any_rank is not None else seen
        return self.agreed

    def defers(self, number: int) -> bool:
        """Whether signal ``number`` waits for the script rather than taking its default effect
        (at the second step, at ``close()`` or after `GRACE`): every notice once the script
        asked; before that a SIGUSR1 (a warning), and a SIGTERM only where the script set its own
        handler (which ran already)."""
        if self.asked or number != signal.SIGTERM:
            return True
        return self._previous.get(number) not in (signal.SIG_DFL, None)

    def stepped(self) -> None:
        """After each optimizer step: a SIGTERM not asked about for two steps ends the process."""
        if self.received is None or self.defers(self.received):
            return
        self._steps_since += 1
        if self._steps_since >= 2:
            self.disarm()  # which gives the signal its default effect, two steps late

    def disarm(self) -> None:
        """Put back the handlers that were there before `arm`; a SIGTERM held for a script that
        never asked about it is sent again now, to take its default effect (at ``close()`` at
        the latest, never lost)."""
        _watcher.remove(self)
        if threading.current_thread() is not threading.main_thread():
            return
        held = self.received
        if held is not None and self.defers(held):
            held = None
        for number, previous in self._previous.items():
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        self.armed = False
        if held is not None:
            signal.raise_signal(held)


class _Watcher:
    """Sees each notice as it arrives, at the C level (``signal.set_wakeup_fd``), even while the
    main thread is blocked in a collective and no Python handler can run; a SIGTERM that the
    script has not asked about `GRACE` seconds later takes its default effect from here. One
    per process, for every armed Engine."""

    def __init__(self) -> None:
        self.notices: list[Preemption] = []
        self._pipe: tuple[int, int] | None = None
        self._before = -1

    def add(self, notice: Preemption) -> None:
        self.notices.append(notice)
        if self._pipe is not None:
            return
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._before = signal.set_wakeup_fd(write, warn_on_full_buffer=False)  # main thread
        if self._before != -1:  # someone else's (an event loop): leave it theirs
            signal.set_wakeup_fd(self._before)
            os.close(read)
            os.close(write)
            return
        self._pipe = (read, write)
        threading.Thread(
            target=self._watch, args=(read,), name="torchplug-notice", daemon=True
        ).start()

    def remove(self, notice: Preemption) -> None:
        with contextlib.suppress(ValueError):
            self.notices.remove(notice)
        if self.notices or self._pipe is None:
            return
        if threading.current_thread() is not threading.main_thread():
            return
        signal.set_wakeup_fd(self._before)
        read, write = self._pipe
        self._pipe = None
        os.close(write)  # the watching thread reads end of file and leaves; it closes `read`

    def _watch(self, read: int) -> None:
        try:
            while True:
                data = os.read(read, 64)
                if not data:
                    return
                if signal.SIGTERM in data:
                    self._expire_later(signal.SIGTERM)
        finally:
            os.close(read)

    def _expire_later(self, number: int) -> None:
        noticed = list(self.notices)  # the Engines armed when it came, not those made later

        def expire() -> None:
            time.sleep(GRACE)
            if any(n.armed and not n.defers(number) for n in noticed):
                # The default effect, from outside the main thread (which may be blocked): put
                # the C-level default back and send the signal again.
                import ctypes

                libc = ctypes.CDLL(None)
                libc.signal.restype = ctypes.c_void_p
                libc.signal(int(number), ctypes.c_void_p(0))  # SIG_DFL
                os.kill(os.getpid(), number)

        threading.Thread(target=expire, name="torchplug-notice-grace", daemon=True).start()


_watcher = _Watcher()


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
