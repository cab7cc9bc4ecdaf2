"""Pretrained weights from safetensors into a model set up under any strategy.

Hugging Face checkpoints are one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``. The usual route for a big model — build it on the meta device
(``engine.init_module(empty=True)``), set it up (sharded), then load — must never materialise the
whole model on one rank: each parameter here is either a plain tensor (read whole) or a DTensor,
whose rank reads only the block of its own shard. safetensors maps the file and a slice reads only
the bytes of the rows it covers, so a rank reads roughly its share of the bytes.

All or nothing: every name, file, header and shape is resolved and checked before the first
tensor is copied, so a bad shard leaves the model as it was; every malformed input (an index
that is not a name -> file map, a header safetensors refuses, a tensor the index names but its
shard lacks) is a CheckpointError naming the file (safetensors bounds the header it parses).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from torchplug.checkpoint.io import unwrapped
from torchplug.checkpoint.manifest import INDEX_FILE, SINGLE_FILE
from torchplug.contract.errors import CheckpointError
from torchplug.util import torchprivate


def _safe_open() -> Any:
    """safetensors' reader, or an error naming the install (it is an optional extra)."""
    try:
        from safetensors import safe_open
    except ModuleNotFoundError:
        raise CheckpointError(
            "engine.load_pretrained reads safetensors files and needs the 'safetensors' "
            "package: pip install torchplug[convert] (or pip install safetensors)."
        ) from None
    return safe_open


def _open(safe_open: Any, file: Path) -> Any:
    """``safe_open`` on ``file``, its refusal (a malformed header) as a CheckpointError."""
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors' errors are its own types
        raise CheckpointError(
            f"{file} is not a readable safetensors file: {type(exc).__name__}: {exc}. Copy it "
            f"again from its source (save_pretrained writes valid ones)."
        ) from None


def files_of(path: str | os.PathLike[str]) -> dict[str, Path]:
    """Each tensor name of a safetensors checkpoint (a file, or a directory with one file or an
    index of shards) and the file that holds it."""
    safe_open = _safe_open()

    root = Path(path)
    if root.is_dir():
        index = root / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(
                    f"{index} is not a safetensors index (a JSON object with a 'weight_map' of "
                    f"tensor name -> shard file): {exc}."
                ) from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(
                    f"{index}: 'weight_map' is a {type(weight_map).__name__}; expected an "
                    f"object of tensor name -> shard file."
                )
            where = {}
            for name, shard in weight_map.items():
                bad = not isinstance(shard, str) or "\0" in shard or "\0" in name
                target = None if bad else (root / shard).resolve()
                if target is None or not target.is_relative_to(root.resolve()):
                    raise CheckpointError(
                        f"{index} names shard {shard!r} for {name!r}, which is not a file name "
                        f"inside {root}. Copy the index and shards save_pretrained wrote."
                    )
                if not target.is_file():
                    raise CheckpointError(
                        f"{index} names shard {shard!r} for {name!r}, which is not a file in "
                        f"{root}. Copy every shard the index lists."
                    )
                where[name] = target
            return where
        root = root / SINGLE_FILE
    if not root.is_file():
        raise CheckpointError(
            f"No safetensors weights at {path}: expected a .safetensors file, or a directory "
            f"with {SINGLE_FILE} or {INDEX_FILE} (what save_pretrained and torchplug convert "
            f"write)."
        )
    with _open(safe_open, root) as handle:
        return {name: root for name in handle.keys()}  # noqa: SIM118 - safe_open's API


def _targets(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters and persistent buffers by their names without wrapper parts
    (a tied parameter once, under its first name)."""
    seen: set[int] = set()
    non_persistent = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        for name in getattr(module, "_non_persistent_buffers_set", ())
    }
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name in non_persistent or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield unwrapped(name), tensor


def load_into(model: torch.nn.Module, path: str | os.PathLike[str], strict: bool = True) -> dict:
    """Copy the weights at ``path`` into ``model``'s tensors in place; return what was read:
    ``{"loaded": [...], "missing": [...], "unexpected": [...]}``. Nothing is copied unless
    everything checks."""
    from torch.distributed.tensor import DTensor

    safe_open = _safe_open()

    where = files_of(path)
    targets = dict(_targets(model))
    missing = sorted(n for n in targets if n not in where)
    unexpected = sorted(n for n in where if n not in targets)
    if strict and missing:
        raise CheckpointError(
            f"{path} has no weights for {len(missing)} of the model's tensors: {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}. Load into the architecture that was saved, "
            f"or pass strict=False to load the ones it has."
        )
    with ExitStack() as files, torch.no_grad():
        handles: dict[Path, Any] = {}
        names: dict[Path, set[str]] = {}
        plan = []  # (name, tensor, the stored slice, its shape): every check first
        for name, tensor in targets.items():
            if name not in where:
                continue
            if tensor.is_meta:
                raise CheckpointError(
                    f"The model's {name!r} is still on the meta device: call load_pretrained "
                    f"after engine.setup(model), which materialises an empty-built model."
                )
            file = where[name]
            if file not in handles:
                handles[file] = files.enter_context(_open(safe_open, file))
                names[file] = set(handles[file].keys())
            if name not in names[file]:
                raise CheckpointError(
                    f"The index names {file.name} for {name!r}, but that shard has no tensor "
                    f"of that name. Copy the index and shards of one save_pretrained together."
                )
            try:
                stored = handles[file].get_slice(name)
                shape = tuple(stored.get_shape())
            except Exception as exc:  # noqa: BLE001 - safetensors' errors are its own types
                raise CheckpointError(
                    f"{file}: {name!r} cannot be read: {type(exc).__name__}: {exc}."
                ) from None
            if shape != tuple(tensor.shape):
                raise CheckpointError(
                    f"{file} holds {name!r} with shape {shape}; the model's is "
                    f"{tuple(tensor.shape)}. Load into the architecture that was saved "
                    f"(nothing was loaded)."
                )
            plan.append((name, tensor, stored, shape, file))
        loaded = []
        for name, tensor, stored, shape, file in plan:
            if isinstance(tensor, DTensor):
                local = tensor.to_local()
                sizes, offsets = torchprivate.local_block(tensor)
                if local.numel():
                    block = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
                    local.copy_(stored[block] if block else handles[file].get_tensor(name))
            else:
                tensor.copy_(stored[:] if shape else handles[file].get_tensor(name))
            loaded.append(name)
    return {"loaded": loaded, "missing": missing, "unexpected": unexpected}
