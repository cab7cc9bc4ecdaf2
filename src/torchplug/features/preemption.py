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
import weakref
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
    """One Engine's view of the notices: armed when it is made, disarmed at ``close()`` (or when
    the Engine is garbage-collected unclosed: nobody can read its flag any more)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.agreed = False
        self.armed = False
        #: The script has read ``engine.preempted``: notices are its to act on.
        self.asked = False
        self._steps_since = 0

    @classmethod
    def armed(cls, undo: list[Callable[[], None]], owner: object = None) -> Preemption:
        """A handler armed now, its removal first on ``undo`` (what ``close()`` runs) and, for
        an ``owner`` dropped without ``close()``, when it is collected."""
        notice = cls()
        if notice.arm():
            undo.insert(0, notice.disarm)
            if owner is not None:
                weakref.finalize(owner, notice.disarm)
        return notice

    def arm(self) -> bool:
        """Note NOTICES from now on. Only the main thread can set handlers; elsewhere nothing
        is armed and ``False`` is returned."""
        if not self.armed:
            self.armed = _notices.add(self)
        return self.armed

    def seen(self, any_rank: Callable[[bool], bool] | None) -> bool:
        """`Engine.preempted`: whether any rank has been sent a notice, agreed on through
        ``any_rank`` (a collective; ``None`` on one process) and kept once true."""
        self.asked = True
        if not self.agreed:
            seen = self.received is not None
            self.agreed = any_rank(seen) if any_rank is not None else seen
        return self.agreed

    def stepped(self) -> None:
        """After each optimizer step: a SIGTERM not asked about for two steps ends the process."""
        if self.received is None or not _notices.unasked(self.received, self):
            return
        self._steps_since += 1
        if self._steps_since >= 2:
            _notices.default_effect(self.received)  # two steps late

    def disarm(self) -> None:
        """Stop noting notices; a SIGTERM held for a script that never asked about it takes its
        default effect now (at ``close()`` at the latest: never lost)."""
        if not self.armed:
            return
        held = self.received if _notices.unasked(self.received, self) else None
        self.armed = False
        _notices.remove(self)
        if held is not None:
            _notices.default_effect(held)


class _Notices:
    """The one handler per notice for the whole process, shared by every armed Engine.

    Installed over what was there (the script's handler, which it calls in turn) when the first
    Engine arms, and put back when the last one disarms, but only if it is still the installed
    handler (a script that replaced it in between keeps its own). A SIGTERM is *unasked* when it
    would have ended the process without us (nothing but the default was there), the script has
    not replaced our handler since, and no Engine armed when it came has read
    ``engine.preempted``: only then is its default effect deferred rather than dropped.

    A watcher thread sees each notice as it arrives, at the C level (``signal.set_wakeup_fd``),
    even while the main thread is blocked in a collective and no Python handler can run; an
    unasked SIGTERM takes its default effect from there `GRACE` seconds later.
    """

    def __init__(self) -> None:
        self.armed: list[Preemption] = []
        #: The handler each notice had before ours (``None``: one set outside Python).
        self.outer: dict[int, Any] = {}
        #: For each notice received: the Engines armed when it came.
        self.arrivals: dict[int, list[Preemption]] = {}
        self._pipe: tuple[int, int] | None = None
        self._before = -1
        self._calling_outer = False

    # -- the handler ---------------------------------------------------------------------------

    def handle(self, number: int, frame: Any) -> None:
        self.arrivals.setdefault(number, list(self.armed))
        for notice in self.armed:
            if notice.received is None:
                notice.received = number
        outer = self.outer.get(number)
        if callable(outer):
            if not self._calling_outer:  # a script handler that chains back to us: once
                self._calling_outer = True
                try:
                    outer(number, frame)
                finally:
                    self._calling_outer = False
        elif not self.armed and outer != signal.SIG_IGN:
            self.default_effect(number)  # left installed with nobody armed: as if absent

    def add(self, notice: Preemption) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        for name in NOTICES:
            number = getattr(signal, name, None)
            if number is None:
                continue
            current = signal.getsignal(number)
            if current == self.handle or current == signal.SIG_IGN:
                continue  # ours already; or the script (or its parent) ignores it: keep that
            self.outer[number] = current
            signal.signal(number, self.handle)
        self.armed.append(notice)
        self._watch()
        return True

    def remove(self, notice: Preemption) -> None:
        with contextlib.suppress(ValueError):
            self.armed.remove(notice)
        if self.armed or threading.current_thread() is not threading.main_thread():
            return  # off the main thread (a collected Engine) the handler stays, transparent
        for number, outer in self.outer.items():
            if signal.getsignal(number) == self.handle:
                signal.signal(number, outer if outer is not None else signal.SIG_DFL)
        self.outer.clear()
        self.arrivals.clear()
        self._unwatch()

    # -- the decision ----------------------------------------------------------------------------

    def unasked(self, number: int | None, notice: Preemption | None = None) -> bool:
        """Whether SIGTERM ``number`` (seen by ``notice``, when given) still waits for its
        default effect: see the class docstring."""
        if number != signal.SIGTERM:
            return False  # SIGUSR1 is a warning: held until read
        came = self.arrivals.get(number)
        if came is None or (notice is not None and notice not in came):
            return False
        if any(n.asked for n in came) or not any(n.armed for n in came):
            return False
        if self.outer.get(number, signal.SIG_DFL) not in (signal.SIG_DFL, None):
            return False  # the script's own handler ran: the notice was its to act on
        return signal.getsignal(number) == self.handle

    def default_effect(self, number: int) -> None:
        """End the process by signal ``number`` as if no handler had been there."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(number, signal.SIG_DFL)
            signal.raise_signal(number)
            return
        # From another thread (the main one may be blocked in C): put the C-level default
        # back and send the signal again.
        import ctypes

        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(int(number), ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), number)

    # -- the watcher -----------------------------------------------------------------------------

    def _watch(self) -> None:
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
            target=self._watching, args=(read,), name="torchplug-notice", daemon=True
        ).start()

    def _unwatch(self) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._before)
        read, write = self._pipe
        self._pipe = None
        os.close(write)  # the watching thread reads end of file and leaves; it closes `read`

    def _watching(self, read: int) -> None:
        try:
            while True:
                data = os.read(read, 64)
                if not data:
                    return
                if signal.SIGTERM in data:
                    self.arrivals.setdefault(signal.SIGTERM, list(self.armed))
                    threading.Thread(
                        target=self._expire, name="torchplug-notice-grace", daemon=True
                    ).start()
        finally:
            os.close(read)

    def _expire(self) -> None:
        time.sleep(GRACE)
        if self.unasked(signal.SIGTERM):
            self.default_effect(signal.SIGTERM)


_notices = _Notices()


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
