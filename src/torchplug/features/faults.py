"""Failures that end fast and say why.

* `install_error_recorder`: an uncaught exception in a rank is written to torchrun's error
  file (``TORCHELASTIC_ERROR_FILE``, what ``@record`` does) with a precise time, so the launcher can
  name the rank that failed first and show its traceback once.
* `failing`: set when the process is going down with an exception; teardown then skips its
  barrier (the other ranks may be inside a collective that will never complete).
* `CollectiveChecker`: the debug mode (``TORCHPLUG_DEBUG_COLLECTIVES=1``, ``torchplug launch
  --debug``). Before each torchplug collective every rank posts ``(op, shape, dtype)`` to the
  process group's store and reads the others'; a rank missing or differing is named.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from torchplug.contract.errors import ConfigurationError, TorchplugError
from torchplug.util import errorfile
from torchplug.util.text import first_line

DEBUG_ENV = "TORCHPLUG_DEBUG_COLLECTIVES"
LAUNCHED_ENV = "TORCHPLUG_LAUNCHED"

#: True once an uncaught exception is on its way out of the interpreter.
failing = False


class CollectiveError(TorchplugError, RuntimeError):
    """Ranks disagree on a collective (debug mode), or a collective timed out."""

    #: A consequence of another rank's failure (a timeout, a peer gone), not a cause.
    secondary = False


class PeerGoneError(CollectiveError):
    """A collective failed because another rank stalled or went away."""

    secondary = True


#: When each exception now on its way out was first seen (by id): its rank failed then.
_seen: dict[int, float] = {}


def note(exc: BaseException) -> None:
    """Remember when ``exc`` left the user's code (teardown runs before the excepthook)."""
    _seen.setdefault(id(exc), time.time())


def is_secondary(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a consequence of another rank's failure."""
    if isinstance(exc, CollectiveError):
        return exc.secondary
    return is_timeout(exc) or is_peer_gone(exc)


# -- error files ----------------------------------------------------------------------------------


def _rank() -> str:
    return os.environ.get("RANK", "0")


def _first_on_node(error_file: Path) -> bool:
    """Whether this is the first rank of this node (this restart attempt) to fail."""
    try:
        fd = os.open(error_file.parent.parent / "torchplug-first-failure", os.O_CREAT | os.O_EXCL)
    except OSError:
        return False
    os.close(fd)
    return True


def record(exc: BaseException, tb: TracebackType | None) -> bool:
    """Write ``exc`` to torchrun's error file for this rank; return whether one was written."""
    now = _seen.get(id(exc), time.time())
    return errorfile.write(
        f"{type(exc).__name__}: {exc}", _format(exc, tb), now, secondary=is_secondary(exc)
    )


_PACKAGE = str(Path(__file__).resolve().parent.parent)


def _format(exc: BaseException, tb: TracebackType | None) -> str:
    """The traceback; for a configuration error only the user's frames (ours are noise there)."""
    if not isinstance(exc, ConfigurationError):
        return "".join(traceback.format_exception(type(exc), exc, tb))
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(_PACKAGE)]
    return (
        "Traceback (most recent call last, torchplug's own frames left out):\n"
        + "".join(traceback.format_list(frames))
        + "".join(traceback.format_exception_only(type(exc), exc))
    )


def _restarts_left() -> bool:
    try:
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < restarts
    except ValueError:
        return False


def _excepthook(
    kind: type[BaseException], exc: BaseException, tb: TracebackType | None, previous: Any
) -> None:
    global failing
    failing = True
    recorded = record(exc, tb)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    # torchplug launch prints the first failing rank's traceback in its summary; here a rank
    # says one line, unless a restart follows (no summary then) and it is the first to fail.
    launched = recorded and path and os.environ.get(LAUNCHED_ENV)
    if launched and not (_restarts_left() and _first_on_node(Path(path))):
        sys.stderr.write(
            f"[torchplug] rank {_rank()} failed: {kind.__name__}: "
            f"{first_line(exc, rest='whole in the file below')} (the error and its traceback: "
            f"{path}; torchplug launch's summary shows the first failing rank's)\n"
        )
        return
    previous(kind, exc, tb)


def install_error_recorder() -> None:
    """Route uncaught exceptions through `record` (once per process)."""
    if getattr(sys.excepthook, "torchplug_recorder", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        _excepthook(kind, exc, tb, previous)

    hook.torchplug_recorder = True  # type: ignore[attr-defined]
    sys.excepthook = hook


# -- collectives ----------------------------------------------------------------------------------


def debug_enabled(env: Any = None) -> bool:
    """Whether the collective debug mode is on (read once per Engine, at its start)."""
    value = (os.environ if env is None else env).get(DEBUG_ENV, "")
    return value.strip().lower() in {"1", "true", "yes", "on"}


def describe(op: str, shape: Sequence[int] | None, dtype: str | None) -> str:
    """``reduce(sum) on shape (3,) float32``: how a collective call is named in errors."""
    if shape is None:
        return op
    return f"{op} on shape {tuple(shape)} {dtype}"


class CollectiveChecker:
    """Compares ``(op, shape, dtype)`` across ranks before each torchplug collective."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.calls = 0

    def check(self, op: str, shape: Sequence[int] | None = None, dtype: str | None = None) -> None:
        """Raise `CollectiveError` on every rank unless all call the same collective."""
        self.calls += 1
        n = self.calls
        key = f"torchplug/debug/{n}/"
        mine = {"op": op, "shape": None if shape is None else list(shape), "dtype": dtype}
        self.store.set(f"{key}{self.rank}", json.dumps(mine))
        keys = [f"{key}{r}" for r in range(self.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except Exception:
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise CollectiveError(
                f"Rank {self.rank} called torchplug collective #{n} "
                f"({describe(op, shape, dtype)}), but rank(s) {missing} did not reach "
                f"collective #{n} within {self.timeout:g} s: they are stalled, died, or call "
                f"fewer torchplug collectives than this rank. Look at what rank(s) {missing} "
                f"were doing (their output, or py-spy dump); every rank must call the same "
                f"collectives in the same order."
            ) from None
        seen = [json.loads(self.store.get(k)) for k in keys]
        if n > 2:  # every rank has read round n - 2 before posting round n - 1
            self.store.delete_key(f"torchplug/debug/{n - 2}/{self.rank}")
        if all(s == seen[0] for s in seen):
            return
        groups: dict[str, list[int]] = {}
        for r, s in enumerate(seen):
            groups.setdefault(describe(s["op"], s["shape"], s["dtype"]), []).append(r)
        told = "; ".join(f"rank(s) {ranks} call {what}" for what, ranks in groups.items())
        raise CollectiveError(
            f"Ranks disagree on torchplug collective #{n}: {told}. Every rank must call the "
            f"same collective with the same shapes and dtypes (a mismatch hangs or returns "
            f"garbage without this check). Make the call unconditional, or pad to one shape."
        )


def is_timeout(exc: BaseException) -> bool:
    """Whether a backend error means a collective gave up waiting (torch has no type for it)."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


_PEER_GONE = (
    "connection reset",
    "connection closed",
    "broken pipe",
    "remote process exited",
    "connection refused",
    "peer",
)


def is_peer_gone(exc: BaseException) -> bool:
    """Whether a backend error means another rank closed its connection (it failed first)."""
    text = str(exc).lower()
    return any(marker in text for marker in _PEER_GONE)


def timed_out(op: str, rank: int, timeout: float | None, exc: BaseException) -> CollectiveError:
    """The error for a collective that gave up waiting for the other ranks."""
    limit = f" {timeout:g} s" if timeout else ""
    if not is_timeout(exc):
        return PeerGoneError(
            f"Rank {rank}'s engine.{op}() failed because another rank went away (it raised, "
            f"exited or was killed); that rank's error is the real cause. torch said: "
            f"{str(exc).splitlines()[0][:200]}"
        )
    return PeerGoneError(
        f"Rank {rank} waited{limit} in engine.{op}() for the other ranks, which never joined: "
        f"another rank is stalled, has died, or calls a different collective. Its error, if it "
        f"raised one, is the real cause. To name it, rerun with `torchplug launch --debug` "
        f"(TORCHPLUG_DEBUG_COLLECTIVES=1). torch said: {str(exc).splitlines()[0][:200]}"
    )


def guarded(op: str, rank: int, timeout: float | None, call: Callable[[], Any]) -> Any:
    """``call()``; a timeout inside it becomes a `CollectiveError` that says why."""
    try:
        return call()
    except CollectiveError:
        raise
    except RuntimeError as exc:
        if is_timeout(exc) or is_peer_gone(exc):
            raise timed_out(op, rank, timeout, exc) from None
        raise
