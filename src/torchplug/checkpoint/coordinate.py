"""How ranks agree during a save or a load, so that a failure anywhere ends it everywhere.

Each phase ends with an exchange through the process group's key-value store (not a collective):
every rank posts a small JSON record (its error, or what it produced) and reads every other
rank's. A rank that fails posts its error and goes on to the exchange like the others, so no rank
waits in a collective that another will never join; a rank that never arrives (a save called
inside ``if engine.is_main:``, a dead rank) is named after a timeout instead of hanging. Nothing
here pickles, and nothing needs numpy.
"""

from __future__ import annotations

import datetime
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from torchplug.checkpoint.files import describe_os_error
from torchplug.contract.errors import CheckpointError
from torchplug.util import torchprivate

#: The number of saves and loads begun in this process: the same on every rank as long as every
#: rank calls them (a save that some ranks never called is taken back, see ``_absent``).
_SEQUENCE = [0]
_INTERRUPTS = (KeyboardInterrupt, SystemExit)
#: The first phase of every save and load: every rank arrives (and starts its part).
ARRIVING = "starting"
#: How often a rank that waits for the others says so.
NOTICE_EVERY = 30.0


def error_text(exc: BaseException) -> str:
    """The useful message of an exception; DCP's CheckpointException wraps the real one."""
    if isinstance(exc, CheckpointError):
        return str(exc)
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        inner_exc = inner[0] if isinstance(inner, tuple) and inner else inner  # (exc, frames)
        if isinstance(inner_exc, BaseException):
            return error_text(inner_exc)
        return str(inner)
    return describe_os_error(exc)


@dataclass
class Coordinator:
    """The exchanges of one save or load on ``world_size`` ranks (local when there is one)."""

    operation: str
    path: str
    rank: int
    world_size: int
    timeout: float
    arrival_timeout: float

    def __post_init__(self) -> None:
        self.store = None
        if self.world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise CheckpointError(
                    f"Checkpoint {self.operation} of {self.path} on {self.world_size} processes "
                    f"needs torch.distributed's process group (its store coordinates the ranks), "
                    f"and none is initialized. A strategy that runs several processes must "
                    f"initialize one in torchplug_setup."
                )
            self.store = torchprivate.default_store()
        _SEQUENCE[0] += 1
        self.sequence = _SEQUENCE[0]
        self.prefix = f"torchplug/checkpoint/{self.sequence}/"

    def run(self, phase: str, work: Callable[[], Any], share: bool = False) -> Any:
        """Run ``work`` here, then agree: every rank raises a CheckpointError naming the first
        failing rank, the path and its error, or returns ``work``'s result (with ``share``, the
        list of every rank's JSON result)."""
        error: str | None = None
        result: Any = None
        local_exc: BaseException | None = None
        try:
            result = work()
        except BaseException as exc:  # noqa: BLE001 - reported to every rank below
            if isinstance(exc, _INTERRUPTS) and self.store is None:
                raise
            error = error_text(exc)
            local_exc = exc
        shared = result if share and error is None else None
        records = self.exchange(phase, {"error": error, "result": shared})
        failed = [(r, rec["error"]) for r, rec in enumerate(records) if rec.get("error")]
        if isinstance(local_exc, _INTERRUPTS):
            raise local_exc  # the others know now; here, Ctrl-C stays Ctrl-C
        if failed and self.store is None and isinstance(local_exc, CheckpointError):
            raise local_exc  # one process: its own message says it all
        if failed:
            first_rank, first_error = failed[0]
            others = "".join(f"\n  rank {r}: {e}" for r, e in failed[1:])
            message = (
                f"Checkpoint {self.operation} of {self.path} failed on rank {first_rank} while "
                f"{phase}: {first_error}{others}"
            )
            if self.operation == "save":
                message += "\nThe previous checkpoint at that path, if any, is intact."
            raise CheckpointError(message) from (local_exc if error is not None else None)
        return [rec["result"] for rec in records] if share else result

    def exchange(self, phase: str, record: dict[str, Any]) -> list[dict[str, Any]]:
        if self.store is None:
            return [json.loads(json.dumps(record))]
        key = f"{self.prefix}{phase}/"
        self.store.set(key + str(self.rank), json.dumps(record))
        keys = [key + str(r) for r in range(self.world_size)]
        first = phase == ARRIVING
        self._wait(keys, self.arrival_timeout if first else self.timeout, phase)
        return [json.loads(self.store.get(k)) for k in keys]

    def _wait(self, keys: list[str], timeout: float, phase: str) -> None:
        start = time.monotonic()
        next_notice = NOTICE_EVERY
        while True:
            elapsed = time.monotonic() - start
            step = min(NOTICE_EVERY, max(timeout - elapsed, 0.001))
            try:
                self.store.wait(keys, datetime.timedelta(seconds=step))
                return
            except Exception:  # the store's timeout error type differs across torch versions
                pass
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            if not missing:
                return
            elapsed = time.monotonic() - start
            if elapsed >= timeout:
                if phase == ARRIVING and _SEQUENCE[0] == self.sequence:
                    # The absent ranks never drew this number: take it back, so that the next
                    # save or load of every rank meets under the same one.
                    self.store.delete_key(keys[self.rank])
                    _SEQUENCE[0] -= 1
                raise CheckpointError(self._absent(missing, phase, elapsed))
            if elapsed >= next_notice:
                warnings.warn(self._absent(missing, phase, elapsed, waiting=True), stacklevel=4)
                next_notice += NOTICE_EVERY

    def _absent(self, missing: list[int], phase: str, elapsed: float, waiting: bool = False) -> str:
        head = (
            f"Checkpoint {self.operation} of {self.path} on rank {self.rank} is still waiting"
            if waiting
            else f"Checkpoint {self.operation} of {self.path} failed on rank {self.rank}"
        )
        ranks = ", ".join(map(str, missing))
        if phase == ARRIVING:
            why = (
                f"rank(s) {ranks} did not call engine.{self.operation} within {elapsed:.0f} s. "
                f"Call engine.{self.operation}(...) on every rank (not inside `if engine.is_main:`)"
                f"; torchplug decides which rank writes what."
            )
        else:
            why = f"rank(s) {ranks} did not finish {phase} within {elapsed:.0f} s (dead or stuck)."
        return f"{head}: {why}"
