"""The portable checkpoint as a backend with a format of its own writes and reads it (DeepSpeed's
native ZeRO checkpoint): its files inside the checkpoint directory, listed, hashed and signed
like every other file, beside the portable entries any strategy loads.

Why a module of its own: these four calls are the whole of what such a backend needs from the
checkpoint package, and they are on the authors' face (``torchplug.plugin``), so a backend never
imports the format's internals.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchplug.checkpoint import files, io
from torchplug.contract.context import HookContext
from torchplug.contract.errors import CheckpointError


def portable_save(
    engine: HookContext,
    path: str,
    state: dict[str, Any],
    metadata: dict[str, Any],
    *,
    native: Callable[[Path], None] | None = None,
    header: dict[str, Any] | None = None,
) -> None:
    """Save ``state`` as the portable checkpoint at ``path`` (every rank calls it), as a
    ``torchplug_save`` hook does; ``native(tmp)`` writes the backend's own files into the
    temporary directory first (on every rank), and ``header`` adds keys to the manifest that
    `portable_manifest` returns at load time.

    Args:
        engine: The hook's context.
        path: The checkpoint directory.
        state: What the user saves (modules, optimizers, values).
        metadata: The manifest's metadata.
        native: Writes the backend's own files into the temporary directory it is given.
        header: Keys added to the manifest.
    """
    io.save(engine, path, state, metadata, native=native, header=header)


def portable_load(
    engine: HookContext,
    path: str,
    state: dict[str, Any] | None,
    strict: bool = True,
    *,
    skip: Callable[[str, dict[str, Any]], bool] | None = None,
) -> dict[str, Any]:
    """Load the portable checkpoint at ``path`` into ``state`` in place, as a
    ``torchplug_load`` hook returns it; ``skip(key, entry)`` names the entries the backend
    restored from its own files.

    Args:
        engine: The hook's context.
        path: The checkpoint directory.
        state: The objects to load into, in place (``None``: return everything).
        strict: Refuse missing or unexpected entries.
        skip: ``skip(key, entry)``: the entries the backend restored itself.
    """
    return io.load(engine, path, state, strict, skip=skip)


def portable_manifest(
    engine: HookContext, path: str | os.PathLike[str]
) -> tuple[Path, dict[str, Any]]:
    """``(root, manifest)`` of the checkpoint at ``path``, its files verified (hashes, and the
    signature under ``checkpoint_key``): where a backend reads the ``header`` it saved.

    Args:
        engine: The hook's context (its ``checkpoint_key`` verifies the signature).
        path: The checkpoint directory.
    """
    return io.open_checkpoint(path, engine.checkpoint_key)


def native_part(root: Path, manifest: dict[str, Any], name: object) -> Path:
    """The directory ``name`` inside the checkpoint ``root``, refused unless it stays inside
    ``root`` and every file under it is one the (verified) manifest lists: a backend that globs
    its directory and unpickles what it finds never reads a file nobody signed.

    Args:
        root: The checkpoint directory, as `portable_manifest` returned it.
        manifest: Its verified manifest.
        name: The backend's directory inside it, as saved in its header.
    """
    directory = files.confined(root, name, "the backend's own directory")
    unlisted = [
        p.relative_to(root).as_posix()
        for p in directory.rglob("*")
        if not p.is_dir() and p.relative_to(root).as_posix() not in manifest["files"]
    ]
    if unlisted:
        raise CheckpointError(
            f"Checkpoint {root} holds files its manifest does not list: {unlisted[:5]}. The "
            f"backend would read them unverified; refusing. Remove them, or load an earlier "
            f"checkpoint."
        )
    return directory
