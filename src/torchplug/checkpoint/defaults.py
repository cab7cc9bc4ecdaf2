"""The default answers to ``torchplug_save`` and ``torchplug_load`` (the portable checkpoint),
``torchplug_checkpoint_metadata`` (its manifest's metadata) and ``torchplug_load_pretrained``
(safetensors into any set-up model).

A built-in plugin registered like any other (its entry point ``checkpoint``): it joins every
Engine's active set, registered before the backend and marked ``trylast``, so a backend that has a
format of its own answers first (DeepSpeed's native checkpoint) and every other backend needs
nothing, whether or not it subclasses ``torchplug.plugin.Strategy``. Blocking it
(``TORCHPLUG_BLOCK_PLUGINS=checkpoint``) leaves the two hooks for the backend to answer; an Engine
whose active set then answers neither refuses to start, naming them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchplug.checkpoint import io, pretrained
from torchplug.contract.context import HookContext
from torchplug.contract.spec import hookimpl

if TYPE_CHECKING:
    import torch


@hookimpl(trylast=True)
def torchplug_save(
    engine: HookContext, path: str, state: dict[str, Any], metadata: dict[str, Any]
) -> bool:
    io.save(engine, path, state, metadata)
    return True


@hookimpl(trylast=True)
def torchplug_load(
    engine: HookContext, path: str, state: dict[str, Any] | None, strict: bool
) -> dict[str, Any]:
    return io.load(engine, path, state, strict)


@hookimpl(trylast=True)
def torchplug_checkpoint_metadata(engine: HookContext, path: Path) -> dict[str, Any] | None:
    if not (Path(path) / "manifest.json").is_file():
        return None  # not this format: another plugin may read it
    metadata = io.read_manifest(path, engine.checkpoint_key).get("metadata")
    return dict(metadata) if isinstance(metadata, dict) else {}


@hookimpl(trylast=True)
def torchplug_load_pretrained(
    engine: HookContext, model: torch.nn.Module, path: Path, strict: bool
) -> dict[str, list[str]]:
    return pretrained.load_into(model, path, strict=strict)
