"""Asynchronous saves: the state is staged in memory while training waits, then written, hashed,
fsynced and committed by a background thread while training goes on.

Why it is safe: after staging, a save needs no collective of the process group — its phases
agree through the c10d store (`Coordinator`), never the
group the training loop uses — and it reads only the staged copies, which training does not
touch. The atomic-commit and crash guarantees are the synchronous save's: the same phases run,
only on another thread. At most one save is in flight per Engine: the next save, a load, a
resume and ``close()`` wait for it first, and its failure (agreed on every rank, as a
synchronous one) is raised there.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchplug.core.errors import CheckpointError

#: The save that ``io.save`` may hand its writing to (set by ``Engine.save(async_=True)``).
_HANDOFF: contextvars.ContextVar[PendingSave | None] = contextvars.ContextVar(
    "torchplug_async_save", default=None
)


class PendingSave:
    """One save's background part: started by `start`, awaited by `wait`."""

    def __init__(self, path: str, staging: dict[str, Any] | None = None) -> None:
        self.path = path
        #: Host copies of an earlier async save of the same Engine (done: the Engine waits for
        #: one save before the next), refilled in place rather than allocated anew.
        self.staging = staging if staging is not None else {}
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._after: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._done = False

    def start(self, work: Callable[[], None]) -> None:
        def run() -> None:
            try:
                work()
                while True:  # steps queued by then(), including while these run
                    with self._lock:
                        if not self._after:
                            self._done = True
                            return
                        step = self._after.pop(0)
                    step()
            except BaseException as exc:  # noqa: BLE001 - raised in the caller at wait()
                self.error = exc
                with self._lock:
                    self._done = True

        self.thread = threading.Thread(target=run, name=f"torchplug-save {self.path}")
        self.thread.start()

    def then(self, step: Callable[[], None]) -> None:
        """Run ``step`` after the save has committed: at once if nothing is in flight or it has
        committed already, never if it failed."""
        with self._lock:
            if self.thread is not None and not self._done:
                self._after.append(step)
                return
        if self.error is None:
            step()

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> None:
        """Block until the write has committed; raise its failure as a CheckpointError."""
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            if isinstance(error, CheckpointError):
                raise CheckpointError(f"The asynchronous save of {self.path} failed: {error}")
            raise CheckpointError(
                f"The asynchronous save of {self.path} failed: {type(error).__name__}: {error}"
            ) from error


@contextlib.contextmanager
def handing_off(pending: PendingSave) -> Iterator[None]:
    """Within this block, ``io.save`` stages and hands its writing to ``pending``."""
    token = _HANDOFF.set(pending)
    try:
        yield
    finally:
        _HANDOFF.reset(token)


def taker() -> PendingSave | None:
    """The pending save to hand the write to, if the caller asked for an async save."""
    return _HANDOFF.get()


def stage(tensors: dict[str, Any], staging: dict[str, Any] | None = None) -> dict[str, Any]:
    """Copies of what will be written, so training may change the originals at once: plain
    tensors to host memory, DTensors (sharded state) as a local copy of this rank's shard.
    ``staging`` holds an earlier save's host copies: one of the same shape and dtype is filled
    in place (fresh memory costs a page fault per page, which was most of the time the loop
    waited); it then holds this save's copies for the next. Memory: one host copy of this
    rank's state stays with the Engine between async saves, as torch DCP's cached staging."""
    from torch.distributed.tensor import DTensor

    staged: dict[str, Any] = {}
    kept = staging if staging is not None else {}
    with torch.no_grad():
        for name, tensor in tensors.items():
            if isinstance(tensor, DTensor):
                staged[name] = tensor.detach().clone()
                continue
            old = kept.get(name)
            if (
                isinstance(old, torch.Tensor)
                and old.shape == tensor.shape
                and old.dtype == tensor.dtype
                and old.stride() == tensor.stride()
            ):
                staged[name] = old.copy_(tensor.detach())
            else:
                staged[name] = tensor.detach().to("cpu", copy=True)
    if staging is not None:
        staging.clear()
        staging.update({k: v for k, v in staged.items() if not isinstance(v, DTensor)})
    return staged
