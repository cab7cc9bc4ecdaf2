"""What a backend may change about the user's objects, and the state that records it, owned here
rather than by the Engine: the undo list ``close()`` runs, the optimizers set up and their models,
and the switches a backend turns (a skipped update, raw optimizer steps, native state-dict names).

Why apart from the Engine: these are the backend's calls, not the user's. Backends reach them
through their hook's `HookContext` (built with this object); the user's Engine keeps them only
as deprecated aliases for plugin API 1.x, so its reference lists what a training script uses.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from torchplug.checkpoint import fresh
from torchplug.contract.errors import CheckpointError, ConfigurationError
from torchplug.engine import wrappers
from torchplug.features import faults
from torchplug.util import torchprivate
from torchplug.util.nested import map_tensors

if TYPE_CHECKING:
    from torchplug.contract.context import Selection
    from torchplug.contract.hooks import Hooks


#: What only a backend calls, owned by `BackendState` and offered by the hook's HookContext; the
#: Engine answers these names through plugin API 1.x with a DeprecationWarning.
BACKEND_ONLY = frozenset(
    {
        "restore_on_close",
        "native_state_dicts",
        "model_of",
        "skipping_updates",
        "real_optimizer_steps",
        "checkpoint_header",
    }
)


class BackendState:
    """The Engine's objects as its backend changes them.

    Args:
        selection: The Engine's selection (what the manifest records of the run).
        hooks: The Engine's typed hook façade.
    """

    def __init__(self, selection: Selection, hooks: Hooks) -> None:
        self._selection = selection
        self._hooks = hooks
        #: Inside ``engine.accumulate``: ``(steps, whether this micro-batch synchronizes)``.
        self.accumulating: tuple[int, bool] | None = None
        #: Micro-batches counted so far in each model's open accumulation group (by id).
        self.accumulated: dict[int, int] = {}
        #: Per model (by id): the current loader batch, its ``accumulate`` blocks so far, and
        #: how many the batch before it had.
        self._blocks: dict[int, list[int]] = {}
        #: Set when the Engine is left by an exception (teardown then skips its barrier).
        self.left_by_error = False
        #: What ``close()`` undoes, newest last: patches on user objects, SyncBatchNorm, ...;
        #: last of all DTensor's caches, which hold this job's meshes (`forget_device_meshes`).
        self.undo: list[Callable[[], None]] = [torchprivate.forget_device_meshes]
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
        from torchplug.util.version import VERSION

        step = state.get("step")
        chosen = self._selection
        return {
            "strategy": {"name": chosen.strategy, "options": chosen.options},
            "precision": chosen.precision,
            "world_size": chosen.runtime.world_size if chosen.runtime else 1,
            "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
            "torchplug_version": VERSION,
        }

    @property
    def failing(self) -> bool:
        """Whether the Engine, or the process, is going down with an exception: teardown then
        skips its barrier (the other ranks may sit in a collective that never completes)."""
        return self.left_by_error or faults.failing

    def full_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> dict[str, Any]:
        """`Engine.full_state`: the unsharded state by parameter name, on the CPU.

        Args:
            model: A model the Engine set up.
            optimizer: Its optimizer, whose state is included when given.
        """
        from torch.distributed.tensor import DTensor

        def full(value: torch.Tensor) -> torch.Tensor:
            if isinstance(value, DTensor):
                value = value.full_tensor()
            return value.detach().cpu().clone()

        hooks = self._hooks
        with self.native_state_dicts():
            result = {"model": map_tensors(hooks.model_state(model), full)}
            if optimizer is not None:
                read = fresh.read_optimizer_state(
                    optimizer, lambda: hooks.optimizer_state(model, optimizer)
                )
                result["optimizer"] = map_tensors(read, full)
        return result

    @contextlib.contextmanager
    def accumulate(
        self, model: torch.nn.Module, steps: int, batch: tuple[int, bool] = (0, False)
    ) -> Iterator[bool]:
        """`Engine.accumulate`'s count: yields whether this micro-batch synchronizes (the
        ``steps``-th of its model's group, or the end of a loader pass, which completes the
        group and starts the count again, as Accelerate's ``sync_with_dataloader``), with
        `accumulating` set inside.

        The end of a pass is its last batch's last ``accumulate`` block (per model): a loop
        that splits each batch into micro-batches (several blocks per batch) completes the
        group at the last of them, as many blocks into the last batch as it made per batch
        before.

        Args:
            model: The model the count is kept for.
            steps: Micro-batches per optimizer update.
            batch: Which loader batch is current, and whether it ends its pass.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigurationError(
                f"engine.accumulate: steps={steps!r} is not a number of micro-batches; expected a "
                f"whole number of 1 or more. Fix: e.g. engine.accumulate(model, steps=4)."
            )
        if self.accumulating is not None:
            raise ConfigurationError(
                "engine.accumulate() was entered inside another engine.accumulate(). Use one "
                "block per micro-batch."
            )
        current, last_of_pass = batch
        seen = self._blocks.setdefault(id(model), [0, 0, 1])  # batch, blocks in it, before
        if current != seen[0]:  # a new batch: how many blocks the one before it had
            seen[:] = [current, 0, seen[1] or seen[2]]
        seen[1] += 1
        ending = last_of_pass and seen[1] >= seen[2]
        count = self.accumulated.get(id(model), 0) + 1
        sync = ending or count % steps == 0
        self.accumulated[id(model)] = 0 if sync else count
        for optimizer in self.optimizers:
            wrappers.skip_zero_grad(self, optimizer)
        self.accumulating = (steps, sync)
        try:
            yield sync
        finally:
            self.accumulating = None

    def deprecated_alias(self, name: str) -> Any:
        """``engine.<name>`` for a name of `BACKEND_ONLY` (plugin API 1.x): the member, with a
        DeprecationWarning naming its new place; any other name is an AttributeError."""
        if name not in BACKEND_ONLY:
            raise AttributeError(f"'Engine' object has no attribute {name!r}")
        warnings.warn(
            f"engine.{name} is a backend's call and leaves the user's Engine: use the "
            f"`engine` argument of your hook (a torchplug.plugin.HookContext), which has "
            f"it. Engine.{name} keeps working through plugin API 1.x.",
            DeprecationWarning,
            stacklevel=3,
        )
        return getattr(self, name)
