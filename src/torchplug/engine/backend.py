"""What a backend may change about the user's objects, and the state that records it, owned here
rather than by the Engine: the undo list ``close()`` runs, the optimizers set up and their models,
and the switches a backend turns (a skipped update, raw optimizer steps, native state-dict names).

Why apart from the Engine: these are the backend's calls, not the user's. Backends reach them
through their hook's `HookContext` (built with this object); the user's Engine keeps them only
as deprecated aliases for plugin API 1.x, so its reference lists what a training script uses.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchplug.contract.errors import CheckpointError
from torchplug.engine import wrappers


class BackendState:
    """The Engine's objects as its backend changes them.

    Args:
        header: Makes the manifest's record of the run (the Engine's `checkpointing.header`).
    """

    def __init__(self, header: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self._header = header
        #: What ``close()`` undoes, newest last: patches on user objects, SyncBatchNorm, ...
        self.undo: list[Callable[[], None]] = []
        #: The optimizers set up so far, in order, and the (wrapped) model of each.
        self.optimizers: list[torch.optim.Optimizer] = []
        self.optimizer_models: dict[int, weakref.ref[torch.nn.Module]] = {}
        #: ``optimizer.step()`` bypasses the hook (`real_optimizer_steps`).
        self.raw_steps = False
        #: Optimizers (by id) whose real update is skipped (`skipping_updates`).
        self.skipped_updates: set[int] = set()
        #: Depth of `native_state_dicts` blocks.
        self.native_state = 0

    def restore_on_close(self, obj: Any, name: str) -> None:
        """Remember ``obj.name`` as it is now; the Engine's ``close()`` puts it back (what setup
        patches on user objects is undone, so a model pickles again after close).

        Args:
            obj: The object a hook patches (a user's model or optimizer).
            name: The attribute about to be set (or added) on it.
        """
        wrappers.remember(self.undo, obj, name)

    @contextlib.contextmanager
    def native_state_dicts(self) -> Iterator[None]:
        """Inside, modules returned by ``engine.setup`` answer ``state_dict()`` with the
        backend's own names (``module.<name>``): what the state hooks and torch's DCP state-dict
        API expect from the wrapper."""
        self.native_state += 1
        try:
            yield
        finally:
            self.native_state -= 1

    def model_of(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> Any:
        """The (wrapped) model whose parameters ``optimizer`` updates.

        Args:
            optimizer: An optimizer ``engine.setup`` returned (or one whose parameters a module
                of ``state`` owns).
            state: A checkpoint state dict, searched for the model when ``optimizer`` was not
                set up with one.

        Raises:
            CheckpointError: No model is known for ``optimizer``.
        """
        ref = self.optimizer_models.get(id(optimizer))
        model = ref() if ref is not None else None
        if model is not None:
            return model
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for candidate in state.values():
            if isinstance(candidate, torch.nn.Module) and any(
                id(p) in owned for p in candidate.parameters()
            ):
                return candidate
        raise CheckpointError(
            "Cannot tell which model this optimizer belongs to: it was not set up with "
            "engine.setup(model, optimizer) and no model in the state owns its parameters. "
            "Put the model in the same state dict, or set both up together."
        )

    @contextlib.contextmanager
    def skipping_updates(self, optimizer: torch.optim.Optimizer, skip: bool) -> Iterator[None]:
        """Inside, with ``skip``, the optimizer's real step does nothing (the backend's step
        around it still runs): how a wrapper skips an update without replacing the backend.

        Args:
            optimizer: The optimizer whose update is skipped.
            skip: Skip it (``False``: run it, e.g. inside an outer skip).
        """
        key = id(optimizer)  # kept here: nothing rides on the user's optimizer
        previous = key in self.skipped_updates
        if skip:
            self.skipped_updates.add(key)
        else:
            self.skipped_updates.discard(key)
        try:
            yield
        finally:
            if previous:
                self.skipped_updates.add(key)
            else:
                self.skipped_updates.discard(key)

    @contextlib.contextmanager
    def real_optimizer_steps(self) -> Iterator[None]:
        """Inside, ``optimizer.step()`` bypasses the hook (zero steps that create state)."""
        previous, self.raw_steps = self.raw_steps, True
        try:
            yield
        finally:
            self.raw_steps = previous

    def checkpoint_header(self, state: dict[str, Any]) -> dict[str, Any]:
        """What the manifest records about this run, besides the entries themselves.

        Args:
            state: The state being saved.
        """
        return self._header(state)
