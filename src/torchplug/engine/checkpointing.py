"""The Engine's side of checkpoints: what `Engine.save`, `Engine.load` and `Engine.full_state`
do around the active set's ``torchplug_save`` / ``torchplug_load`` and state hooks.

The format itself is `torchplug.checkpoint` (its default answers are the built-in
``checkpoint`` plugin); here are the checks of the user's arguments, the plugins' own state
under torchplug's reserved names, the asynchronous hand-off, and the native state-dict names
the state hooks expect. The Engine keeps the public methods and their docstrings.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchplug.checkpoint import async_save
from torchplug.contract.errors import CheckpointError, PluginError

if TYPE_CHECKING:
    from torchplug.engine._typing import Engine

#: Checkpoint entries of torchplug's own (plugins' state): user keys may not start with it.
RESERVED_PREFIX = "torchplug."


class Saves:
    """The Engine's asynchronous save in flight (at most one) and the host copies the next one
    reuses: `Engine.wait_for_save`, `Engine.after_save` and what ``close()`` finishes."""

    def __init__(self) -> None:
        self.pending: async_save.PendingSave | None = None
        #: Async saves' host copies, reused by the next one.
        self.staging: dict[str, Any] = {}

    def wait(self) -> None:
        """Wait for the save in flight to commit; raise its failure (`Engine.wait_for_save`)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()

    def after(self, step: Callable[[], None]) -> None:
        """Run ``step`` once the last save has committed (`Engine.after_save`)."""
        if self.pending is None:
            step()
        else:
            self.pending.then(step)

    def finish(self, failing: bool) -> CheckpointError | None:
        """At close: finish a save in flight. Its failure is returned (raised once the Engine is
        released), unless the Engine is closing because of another error (then a warning)."""
        try:
            self.wait()
        except CheckpointError as exc:
            if not failing:
                return exc
            warnings.warn(str(exc), stacklevel=4)
        finally:
            self.staging.clear()
        return None


def save(
    engine: Engine,
    path: str | os.PathLike[str],
    state: dict[str, Any],
    metadata: dict[str, Any] | None,
    async_: bool,
) -> None:
    engine.wait_for_save()
    if not isinstance(state, dict):
        raise TypeError(
            f"engine.save expects a dict of what to save, e.g. {{'model': model, "
            f"'optimizer': optimizer, 'step': step}}, got {type(state).__name__}."
        )
    metadata = dict(metadata or {})
    try:
        json.dumps(metadata, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"Checkpoint metadata must be JSON values (numbers, strings, lists, dicts): {exc}"
        ) from None
    reserved = sorted(k for k in state if str(k).startswith(RESERVED_PREFIX))
    if reserved:
        raise CheckpointError(
            f"State keys {reserved} start with {RESERVED_PREFIX!r}, which is torchplug's own "
            f"namespace in checkpoints (plugins' state, such as the fp16 loss scale). Rename "
            f"them."
        )
    state = {**state, **plugin_state(engine)}
    pending = async_save.PendingSave(str(path), engine._saves.staging) if async_ else None
    handoff = async_save.handing_off(pending) if pending else contextlib.nullcontext()
    with engine._backend.native_state_dicts(), handoff:
        done = engine._hooks.save(str(Path(path)), state, metadata)
    engine._saves.pending = pending
    engine._hooks.answer("torchplug_save", done)


def plugin_state(engine: Engine) -> dict[str, Any]:
    """What the active set's plugins keep in every checkpoint (``torchplug_checkpoint_state``),
    under torchplug's reserved names."""
    merged: dict[str, Any] = {}
    for answer in engine._hooks.checkpoint_state():
        for name, obj in answer.items():
            if not (
                callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))
            ):
                raise PluginError(
                    f"torchplug_checkpoint_state answered {name!r}: {type(obj).__name__}, "
                    f"which lacks state_dict()/load_state_dict(). Return objects that have "
                    f"both (docs/hooks.md#torchplug_checkpoint_state)."
                )
            merged[f"{RESERVED_PREFIX}{name}"] = obj
    return merged


def load(
    engine: Engine, path: str | os.PathLike[str], state: dict[str, Any] | None, strict: bool
) -> dict[str, Any]:
    engine.wait_for_save()
    if state is not None and not isinstance(state, dict):
        raise TypeError(
            f"engine.load expects a dict of the objects to restore, e.g. {{'model': model, "
            f"'optimizer': optimizer}}, got {type(state).__name__}."
        )
    merged = None if state is None else {**state, **plugin_state(engine)}
    with engine._backend.native_state_dicts():
        answer = engine._hooks.load(str(Path(path)), merged, strict)
    if state is not None and merged is not None:
        state.update({k: merged[k] for k in state})  # plain values replaced, as documented
    return {k: v for k, v in answer.items() if not str(k).startswith(RESERVED_PREFIX)}


def load_pretrained(
    engine: Engine, model: Any, path: str | os.PathLike[str], strict: bool
) -> dict[str, list[str]]:
    result = engine._hooks.load_pretrained(engine.unwrap(model), path, strict)
    if result is None:
        raise PluginError(
            f"No plugin of strategy '{engine.strategy}''s active set loads pretrained weights "
            f"(torchplug_load_pretrained). The built-in 'checkpoint' plugin does: unblock it "
            f"(TORCHPLUG_BLOCK_PLUGINS), or answer the hook in the backend."
        )
    return result
