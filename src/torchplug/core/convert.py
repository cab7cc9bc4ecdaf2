"""``torchplug convert``: any torchplug checkpoint -> a plain ``model.safetensors``.

The output loads with ``safetensors.torch.load_file`` into the unwrapped model, with no torchplug,
no process group and no pickles involved: the way to hand a model to inference code or another
library.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from torchplug.core import checkpoint
from torchplug.core.errors import CheckpointError


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ModuleNotFoundError:
        raise CheckpointError(
            "torchplug convert writes safetensors files and needs the 'safetensors' package: "
            "pip install safetensors (or pip install torchplug[convert])."
        ) from None
    return safetensors.torch


class Progress:
    """A one-line progress bar on stderr, shown for large checkpoints or on a terminal."""

    def __init__(self, total_bytes: int, enabled: bool) -> None:
        self.total = max(total_bytes, 1)
        self.done = 0
        self.enabled = enabled

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.enabled:
            filled = int(30 * self.done / self.total)
            sys.stderr.write(
                f"\rconverting [{'#' * filled}{'.' * (30 - filled)}] "
                f"{self.done / 2**20:,.1f}/{self.total / 2**20:,.1f} MiB"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _module_entry(entries: dict[str, Any], requested: str | None, root: Path) -> str:
    modules = [k for k, e in entries.items() if e["kind"] == "module"]
    if requested is not None:
        if requested not in modules:
            raise CheckpointError(
                f"Checkpoint {root} has no module entry {requested!r}; its modules are "
                f"{modules or 'none'}. Pass one of those with --entry."
            )
        return requested
    if len(modules) == 1:
        return modules[0]
    if "model" in modules:
        return "model"
    raise CheckpointError(
        f"Checkpoint {root} holds {len(modules)} module entries ({modules}); choose one with "
        f"--entry NAME."
    )


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    entry: str | None = None,
    optimizer: bool = False,
    progress: bool | None = None,
) -> list[Path]:
    """Write ``destination/model.safetensors`` (and ``optimizer.safetensors``); return the paths."""
    st = _safetensors()
    root = Path(source)
    if not (root / checkpoint.MANIFEST).is_file() and (root / "latest").is_file():
        return [_convert_native_deepspeed(root, Path(destination), st)]
    manifest = checkpoint.read_manifest(root)
    checkpoint.verify_files(root, manifest)
    entries = manifest["entries"]
    module_key = _module_entry(entries, entry, root)
    wanted = {module_key: entries[module_key]}
    if optimizer:
        optimizers = [k for k, e in entries.items() if e["kind"] == "optimizer"]
        if not optimizers:
            raise CheckpointError(f"Checkpoint {root} holds no optimizer; drop --optimizer.")
        wanted[optimizers[0]] = entries[optimizers[0]]
    store = root / checkpoint.TENSORS
    shapes = checkpoint.tensor_shapes(store)
    names = [n for e in wanted.values() for n in checkpoint.tensor_paths(e["data"])]
    tensors = checkpoint.allocate(shapes, names)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    bar = Progress(total, sys.stderr.isatty() or total > 2**30 if progress is None else progress)
    for chunk in _chunks(tensors, CHUNK_BYTES):  # read in pieces so the bar moves
        checkpoint.load_tensors(store, chunk)
        bar.advance(sum(t.numel() * t.element_size() for t in chunk.values()))
    bar.close()
    out = Path(destination)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    model_state = checkpoint.decode(entries[module_key]["data"], tensors)
    flat = {name: tensor.contiguous() for name, tensor in model_state.items()}
    target = out / "model.safetensors"
    st.save_file(flat, str(target), metadata={"torchplug_source": str(root), "entry": module_key})
    written.append(target)

    if optimizer:
        key = next(k for k in wanted if k != module_key)
        state = checkpoint.decode(entries[key]["data"], tensors)
        flat = {
            f"state.{param}.{name}": value.contiguous()
            for param, values in state.get("state", {}).items()
            for name, value in values.items()
            if isinstance(value, torch.Tensor)
        }
        groups = json.dumps(entries[key]["data"].get("param_groups", []))
        target = out / "optimizer.safetensors"
        st.save_file(flat, str(target), metadata={"param_groups": groups, "entry": key})
        written.append(target)
    return written


def _convert_native_deepspeed(root: Path, out: Path, st: Any) -> Path:
    """A DeepSpeed checkpoint directory (with its ``latest`` file), consolidated by DeepSpeed's
    own zero_to_fp32."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ModuleNotFoundError:
        raise CheckpointError(
            f"{root} is a native DeepSpeed checkpoint; converting it needs deepspeed: "
            f"pip install torchplug[deepspeed]."
        ) from None
    state = get_fp32_state_dict_from_zero_checkpoint(str(root))
    out.mkdir(parents=True, exist_ok=True)
    target = out / "model.safetensors"
    flat = {name: tensor.contiguous() for name, tensor in state.items()}
    st.save_file(flat, str(target), metadata={"torchplug_source": str(root), "entry": "deepspeed"})
    return target


CHUNK_BYTES = 256 * 2**20


def _chunks(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    chunks: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if size >= limit:
            chunks.append({})
            size = 0
        chunks[-1][name] = tensor
        size += tensor.numel() * tensor.element_size()
    return chunks
