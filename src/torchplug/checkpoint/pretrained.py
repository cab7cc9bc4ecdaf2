"""Pretrained weights from safetensors into a model set up under any strategy.

Hugging Face checkpoints are one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``. The usual route for a big model — build it on the meta device
(``engine.init_module(empty=True)``), set it up (sharded), then load — must never materialise the
whole model on one rank: each parameter here is either a plain tensor (read whole) or a DTensor,
whose rank reads only the block of its own shard. safetensors maps the file and a slice reads only
the bytes of the rows it covers, so a rank reads roughly its share of the bytes.
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
            where = {}
            for name, shard in weight_map.items():
                target = (root / str(shard)).resolve()
                if not target.is_relative_to(root.resolve()) or not target.is_file():
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
    with safe_open(str(root), framework="pt") as handle:
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
    ``{"loaded": [...], "missing": [...], "unexpected": [...]}``."""
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
    loaded = []
    with ExitStack() as files, torch.no_grad():
        handles: dict[Path, Any] = {}
        for name, tensor in targets.items():
            if name not in where:
                continue
            if hasattr(tensor, "ds_id"):
                raise CheckpointError(
                    f"The model's {name!r} is a DeepSpeed ZeRO-partitioned parameter, which "
                    f"load_pretrained does not read into. Load the weights before setup "
                    f"(e.g. from_pretrained, or load_pretrained under init_module() without "
                    f"empty=True), or use a strategy whose parameters are DTensors (fsdp, tp)."
                )
            file = where[name]
            if file not in handles:
                handles[file] = files.enter_context(safe_open(str(file), framework="pt"))
            stored = handles[file].get_slice(name)
            shape = tuple(stored.get_shape())
            if shape != tuple(tensor.shape):
                raise CheckpointError(
                    f"{file} holds {name!r} with shape {shape}; the model's is "
                    f"{tuple(tensor.shape)}. Load into the architecture that was saved."
                )
            if isinstance(tensor, DTensor):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                local = tensor.to_local()
                sizes, offsets = compute_local_shape_and_global_offset(
                    tensor.shape, tensor.device_mesh, tensor.placements
                )
                if local.numel():
                    block = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
                    local.copy_(stored[block] if block else handles[file].get_tensor(name))
            elif tensor.is_meta:
                raise CheckpointError(
                    f"The model's {name!r} is still on the meta device: call load_pretrained "
                    f"after engine.setup(model), which materialises an empty-built model."
                )
            else:
                tensor.copy_(stored[:] if shape else handles[file].get_tensor(name))
            loaded.append(name)
    return {"loaded": loaded, "missing": missing, "unexpected": unexpected}
