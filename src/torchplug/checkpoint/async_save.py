"""Asynchronous saves: the state is staged in memory, then written, hashed, fsynced and
committed by a background thread while training goes on.

Every tensor is staged before ``save`` returns: a CPU tensor is copied (into the host copies of
the Engine's last async save, refilled in place), a CUDA tensor's copy to pinned host memory is
queued on the caller's current stream (later kernels on that stream run after it; the
background thread waits for it). So the checkpoint holds exactly the state at the call whatever
changes the tensors afterwards — an optimizer step, an in-place operation, ``.data``, ``set_``,
a NumPy view — none of which a version counter sees in full (``.data`` and NumPy views move
none). The copy is a memory copy of this rank's share, a small part of a synchronous save.

Why it is safe: after staging, a save needs no collective of the process group — its phases
agree through the c10d store (`Coordinator`), never the
group the training loop uses — and it reads only the staged copies, which training does not
touch. The atomic-commit and crash guarantees are the synchronous save's: the same phases run,
only on another thread. At most one save is in flight per Engine: the next save, a load, a
resume and ``close()`` wait for it first, and its failure (agreed on every rank, as a
synchronous one) is raised there.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchplug.contract.errors import CheckpointError
from torchplug.util import errorfile

#: The save that ``io.save`` may hand its writing to (set by ``Engine.save(async_=True)``).
_HANDOFF: contextvars.ContextVar[PendingSave | None] = contextvars.ContextVar(
    "torchplug_async_save", default=None
)


#: Saves started and not waited for yet: a failure among them is reported at exit.
_UNCLAIMED: set[PendingSave] = set()


def _report_unclaimed() -> None:
    """At interpreter exit (after Python has joined the save threads; registered on import,
    so it runs after the handlers registered later): a save that failed while nobody waited
    for it (a script that never called ``close()`` or ``wait_for_save()``) must not end the
    process as a success with its checkpoint missing. Its failure is printed and the process
    exits with status 1."""
    failed = [p for p in list(_UNCLAIMED) if p.error is not None]
    if not failed:
        return
    for pending in failed:
        error = pending.error
        print(
            f"torchplug: the asynchronous save of {pending.path} failed, and the script ended "
            f"without waiting for it (engine.close(), `with Engine(...)`, or "
            f"engine.wait_for_save() raise it): "
            f"{type(error).__name__}: {error}. That checkpoint was not written; exiting with "
            f"status 1.",
            file=sys.stderr,
        )
    error = failed[0].error
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    errorfile.write(  # what torchplug launch's summary names
        f"CheckpointError: The asynchronous save of {failed[0].path} failed and the script "
        f"ended without waiting for it: {type(error).__name__}: {error}",
        trace,
        time.time(),
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


atexit.register(_report_unclaimed)


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
        _UNCLAIMED.add(self)
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
        _UNCLAIMED.discard(self)
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


def stage(
    tensors: dict[str, Any], staging: dict[str, Any] | None = None
) -> tuple[dict[str, Any], Callable[[], None]]:
    """Copies of what will be written, taken before the save returns, so training may change the
    originals at once by any path; and what the background thread calls before it reads them.

    Plain tensors go to host memory, DTensors (sharded state) as a copy of the DTensor on its
    device. A CUDA tensor is copied to pinned host memory on the current stream without
    waiting (later kernels on that stream run after the copy); the returned wait synchronizes
    with it. ``staging`` holds an earlier save's host copies: one of the same shape, dtype and
    strides is refilled in place (fresh memory costs a page fault per page, which was most of
    the time the loop waited); it then holds this save's copies for the next (`keep_only`
    drops the ones no longer saved). Memory: one host copy of this rank's state stays with the
    Engine between async saves, as torch DCP's cached staging."""
    from torch.distributed.tensor import DTensor

    staged: dict[str, Any] = {}
    kept = staging if staging is not None else {}
    queued = False
    with torch.no_grad():
        for name, tensor in tensors.items():
            if isinstance(tensor, DTensor):
                staged[name] = tensor.detach().clone()
                queued = queued or tensor.device.type == "cuda"
                continue
            if not isinstance(tensor, torch.Tensor):
                staged[name] = tensor
                continue
            cuda = tensor.device.type == "cuda"
            old = kept.get(name)
            if (
                isinstance(old, torch.Tensor)
                and old.shape == tensor.shape
                and old.dtype == tensor.dtype
                and old.stride() == tensor.stride()
                and (old.is_pinned() or not cuda)
            ):
                staged[name] = old.copy_(tensor.detach(), non_blocking=cuda)
            elif cuda:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                staged[name] = host.copy_(tensor.detach(), non_blocking=True)
            else:
                staged[name] = tensor.detach().to("cpu", copy=True)
            queued = queued or cuda
    if staging is not None:
        staging.update({k: v for k, v in staged.items() if isinstance(v, torch.Tensor)
                        and not isinstance(v, DTensor)})  # fmt: skip
    if not queued:
        return staged, lambda: None
    copied = torch.cuda.Event()
    copied.record()  # on the current stream, after the queued copies
    return staged, copied.synchronize


def keep_only(staging: dict[str, Any], names: set[str]) -> None:
    """Drop the host copies of tensors this save did not stage."""
    for name in [n for n in staging if n not in names]:
        del staging[name]
