"""``torchplug convert``: any torchplug checkpoint -> a plain ``model.safetensors``; a native
checkpoint of another library (DeepSpeed) -> safetensors or a portable torchplug checkpoint.

The output loads with ``safetensors.torch.load_file`` into the unwrapped model, with no torchplug,
no process group and no pickles involved: the way to hand a model to inference code or another
library.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch

from torchplug.checkpoint import tensors as store
from torchplug.checkpoint.io import open_checkpoint
from torchplug.checkpoint.manifest import (
    INDEX_FILE,
    MANIFEST,
    SINGLE_FILE,
    VERIFIED,
    decode,
    tensor_paths,
)
from torchplug.checkpoint.settings import key_from
from torchplug.contract.errors import CheckpointError
from torchplug.contract.spec import hookimpl


def _safetensors() -> Any:
    """safetensors (which writes torch tensors through numpy), or an error naming the install."""
    try:
        import numpy  # noqa: F401 - safetensors.torch.save_file needs it
        import safetensors.torch
    except ModuleNotFoundError as exc:
        raise CheckpointError(
            f"torchplug convert writes safetensors files and needs the {exc.name!r} package: "
            f"pip install torchplug[convert] (safetensors and numpy)."
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


#: Hugging Face's names for an export: one file, or shards with an index beside them.
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(value: str | int) -> int:
    """``"2GB"`` (decimal, as Hugging Face counts), ``"500MiB"`` or a number of bytes."""
    import re

    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", str(value), re.IGNORECASE)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise CheckpointError(
            f"--max-shard-size {value!r} is not a size; expected a number of bytes or a number "
            f"with a unit (KB, MB, GB, or KiB, MiB, GiB), e.g. --max-shard-size 2GB."
        )
    return int(float(match.group(1)) * _UNITS[unit])


def write_safetensors(
    state: dict[str, torch.Tensor],
    out: Path,
    source: Path,
    entry: str,
    max_shard_size: int | None = None,
) -> list[Path]:
    """``out/model.safetensors`` from a flat state dict; with ``max_shard_size`` (bytes) and a
    state larger than that, ``model-0000K-of-0000N.safetensors`` shards (tensors in order, a
    shard never above the size unless one tensor is) and ``model.safetensors.index.json`` (its
    ``weight_map`` names each tensor's shard), as ``save_pretrained`` writes them."""
    st = _safetensors()
    out.mkdir(parents=True, exist_ok=True)
    flat = {name: tensor.contiguous() for name, tensor in state.items()}
    sizes = {name: t.numel() * t.element_size() for name, t in flat.items()}
    total = sum(sizes.values())
    metadata = {"torchplug_source": str(source), "entry": entry, "format": "pt"}
    sharded = max_shard_size is not None and total > max_shard_size
    stale = [
        p.name
        for p in (
            [out / SINGLE_FILE]
            if sharded
            else [out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]
        )
        if p.exists()
    ]
    if stale:
        raise CheckpointError(
            f"{out} holds {', '.join(sorted(stale))} from an earlier export in the other layout "
            f"({'single file' if sharded else 'shards'}); from_pretrained would read the wrong "
            f"one. Remove them or convert into an empty directory."
        )
    if not sharded:
        target = out / SINGLE_FILE
        st.save_file(flat, str(target), metadata=metadata)
        _honour_umask(target)
        return [target]
    shards: list[list[str]] = [[]]
    filled = 0
    for name in flat:
        if shards[-1] and filled + sizes[name] > max_shard_size:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += sizes[name]
    written, weight_map = [], {}
    for k, names in enumerate(shards, start=1):
        target = out / f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        st.save_file({n: flat[n] for n in names}, str(target), metadata=metadata)
        _honour_umask(target)
        written.append(target)
        weight_map.update({n: target.name for n in names})
    index = out / INDEX_FILE
    index.write_text(
        json.dumps(
            {"metadata": {"total_size": total, **metadata}, "weight_map": weight_map},
            indent=2,
            sort_keys=True,
        )
        + "\n"  # fmt: skip
    )
    return [*written, index]


def _umask() -> int:
    """The process's umask, read without changing it where the OS tells it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _honour_umask(path: Path) -> None:
    """Give ``path`` the mode a new file gets (0644 under the usual umask 022), as checkpoints
    have: safetensors writes through a private temporary file (0600)."""
    os.chmod(path, 0o666 & ~_umask())


#: How a file torch.save wrote starts: a zip archive (torch >= 1.6) or a raw pickle.
_TORCH_SAVE_MAGIC = (b"PK\x03\x04", b"\x80")


def _not_a_checkpoint(root: Path) -> CheckpointError:
    """What to say about a *file* given as the checkpoint: it is never unpickled."""
    with root.open("rb") as handle:
        head = handle.read(4)
    what = (
        "a torch.save file (a pickle)"
        if head.startswith(_TORCH_SAVE_MAGIC)
        else "a file, not a directory"
    )
    return CheckpointError(
        f"{root} is not a torchplug checkpoint: it is {what}. A torchplug checkpoint is the "
        f"directory engine.save() writes (with a manifest.json); torchplug convert never "
        f"unpickles a file. To convert a state dict you saved with torch.save, load it yourself "
        f"if you trust it (torch.load(path, weights_only=True)) and write it with "
        f"safetensors.torch.save_file, or save it with engine.save(path, {{'model': model}})."
    )


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
    if not modules:
        kinds = ", ".join(f"'{k}' ({e['kind']})" for k, e in entries.items()) or "none"
        raise CheckpointError(
            f"Checkpoint {root} holds no model: none of its entries ({kinds}) was saved as an "
            f"nn.Module, so there are no parameter names to convert. Save the module itself, "
            f"engine.save(path, {{'model': model}}), not its state_dict()."
        )
    raise CheckpointError(
        f"Checkpoint {root} holds {len(modules)} module entries ({modules}); choose one with "
        f"--entry NAME."
    )


FORMATS = ("safetensors", "checkpoint")


def _trusted_foreign(
    root: Path, key: bytes | None, trust_pickles: bool, source_format: str | None
) -> None:
    """Refuse to read a directory without a manifest unless the user trusts its pickles, and
    always while a checkpoint key is set."""
    where = f"{root} has no {MANIFEST}: it is not a torchplug checkpoint"
    if key is not None:
        raise CheckpointError(
            f"{where}, and a checkpoint key is set (TORCHPLUG_CHECKPOINT_KEY or key=): only "
            f"signed torchplug checkpoints are read then, and another library's format (e.g. "
            f"DeepSpeed's native one) unpickles its files. Unset the key to convert a checkpoint "
            f"you trust, or convert a signed torchplug checkpoint."
        )
    if not trust_pickles:
        named = f" --from {source_format}" if source_format else " --from deepspeed"
        raise CheckpointError(
            f"{where} (a deleted or missing manifest, or another library's format). Reading "
            f"another library's checkpoint (e.g. DeepSpeed's native one) unpickles its files, "
            f"which runs any code they contain. If you trust this directory, say what it is and "
            f"that you trust it: torchplug convert {root} DST{named} --trust-pickles."
        )


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    entry: str | None = None,
    optimizer: bool = False,
    progress: bool | None = None,
    key: str | bytes | None = None,
    to: str = "safetensors",
    trust_pickles: bool = False,
    source_format: str | None = None,
    max_shard_size: str | int | None = None,
) -> list[Path]:
    """Write ``destination/model.safetensors`` (and ``optimizer.safetensors``), or with
    ``to="checkpoint"`` a portable torchplug checkpoint at ``destination``; return the paths.

    A directory that is not a torchplug checkpoint (no ``manifest.json``) is another library's
    format, whose readers unpickle its files, which runs any code they contain. It is read only
    with ``trust_pickles=True`` (``--trust-pickles``), offered to the installed plugins (the
    ``torchplug_read_checkpoint`` hook; only the one named by ``source_format``,
    ``--from deepspeed``, when given), and never while a checkpoint key is set: signed
    checkpoints are the only ones trusted then.
    """
    if to not in FORMATS:
        raise CheckpointError(f"Unknown output format {to!r}; use one of {', '.join(FORMATS)}.")
    if max_shard_size is not None:
        if to != "safetensors":
            raise CheckpointError(
                "--max-shard-size splits a safetensors export; drop it with --to checkpoint."
            )
        max_shard_size = parse_size(max_shard_size)
    root = Path(source)
    if root.is_file():
        raise _not_a_checkpoint(root)
    if root.is_dir() and not (root / MANIFEST).exists():
        from torchplug.contract import manager

        _trusted_foreign(root, key_from(key), trust_pickles, source_format)
        registry = manager.get_registry()
        hook = registry.pm.hook
        if source_format is not None:
            others = [
                plugin
                for name, plugin in registry.pm.list_name_plugin()
                if source_format.lower() not in str(name).lower()
            ]
            hook = types.SimpleNamespace(
                torchplug_read_checkpoint=registry.pm.subset_hook_caller(
                    "torchplug_read_checkpoint", others
                ),
                torchplug_convert_checkpoint=registry.pm.subset_hook_caller(
                    "torchplug_convert_checkpoint", others
                ),
            )
        foreign = hook.torchplug_read_checkpoint(
            source=root, optimizer=optimizer or to == "checkpoint"
        )
        if foreign is not None:
            if to == "checkpoint":
                return [write_checkpoint(foreign, Path(destination), root)]
            written = write_safetensors(
                foreign["model"], Path(destination), root, "model", max_shard_size
            )
            if optimizer:
                if not foreign.get("optimizer"):
                    raise CheckpointError(f"{root} holds no optimizer state; drop --optimizer.")
                written.append(
                    _write_optimizer(foreign["optimizer"], Path(destination), "optimizer")
                )
            return written
        if to == "safetensors":
            written = hook.torchplug_convert_checkpoint(source=root, destination=Path(destination))
            if written is not None:
                return list(written)
    if to == "checkpoint":
        open_checkpoint(root, key_from(key))  # a clear error if it is not one at all
        raise CheckpointError(
            f"{root} is a torchplug checkpoint already: every strategy loads it as it is. "
            f"Copy the directory, or convert to safetensors (--to safetensors)."
        )
    _safetensors()  # missing: say so before reading anything
    root, manifest = open_checkpoint(root, key_from(key))
    entries, index = manifest["entries"], manifest["tensors"]
    module_key = _module_entry(entries, entry, root)
    wanted = {module_key: entries[module_key]}
    if optimizer:
        optimizers = [k for k, e in entries.items() if e["kind"] == "optimizer"]
        if not optimizers:
            raise CheckpointError(f"Checkpoint {root} holds no optimizer; drop --optimizer.")
        wanted[optimizers[0]] = entries[optimizers[0]]
    names = [n for e in wanted.values() for n in tensor_paths(e["data"])]
    tensors = store.allocate(index, names)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    bar = Progress(total, sys.stderr.isatty() or total > 2**30 if progress is None else progress)
    for chunk in _chunks(tensors, CHUNK_BYTES):  # read in pieces so the bar moves
        store.read(root, index, chunk, manifest[VERIFIED])
        bar.advance(sum(t.numel() * t.element_size() for t in chunk.values()))
    bar.close()
    out = Path(destination)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    model_state = decode(entries[module_key]["data"], tensors)
    written.extend(write_safetensors(model_state, out, root, module_key, max_shard_size))

    if optimizer:
        opt_key = next(k for k in wanted if k != module_key)
        written.append(_write_optimizer(decode(entries[opt_key]["data"], tensors), out, opt_key))
    return written


def _write_optimizer(state: dict[str, Any], out: Path, entry: str) -> Path:
    """``out/optimizer.safetensors``: ``state.<param>.<key>`` tensors, the param groups as JSON
    metadata."""
    st = _safetensors()
    out.mkdir(parents=True, exist_ok=True)
    flat = {
        f"state.{param}.{name}": value.contiguous()
        for param, values in state.get("state", {}).items()
        for name, value in values.items()
        if isinstance(value, torch.Tensor)
    }
    groups = json.dumps(state.get("param_groups", []), default=list)
    target = out / "optimizer.safetensors"
    st.save_file(flat, str(target), metadata={"param_groups": groups, "entry": entry})
    _honour_umask(target)
    return target


def write_checkpoint(foreign: dict[str, Any], out: Path, source: Path) -> Path:
    """``foreign`` (what ``torchplug_read_checkpoint`` answered) as a portable checkpoint at
    ``out`` with entries ``model``, ``optimizer`` (if any) and ``step``: load it with
    ``engine.load(out, {"model": model, "optimizer": optimizer, "step": 0})`` under any
    strategy."""
    from torchplug.checkpoint import io
    from torchplug.checkpoint.manifest import encode
    from torchplug.engine.engine import Engine

    state: dict[str, Any] = {"model": foreign["model"], "step": foreign.get("step")}
    if foreign.get("optimizer") is not None:
        state["optimizer"] = foreign["optimizer"]

    def entries_of(_: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        tensors: dict[str, torch.Tensor] = {}
        kinds = {"model": "module", "optimizer": "optimizer", "step": "value"}
        found = {k: {"kind": kinds[k], "data": encode(v, k, tensors)} for k, v in state.items()}
        return found, tensors

    metadata = {"converted_from": str(foreign.get("format", "unknown")), "source": str(source)}
    handed = _ContextOf()
    with Engine("single", plugins=[handed]) as engine:
        engine.barrier()  # hands this Engine's HookContext to `handed`, as any hook would
        io.save(handed.context, str(out), state, metadata, entries_of=entries_of)
    return out


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


class _ContextOf:
    """An extension plugin that keeps the `HookContext` its Engine calls it with: the one
    handle on the Engine's active set that the checkpoint writer takes (as every plugin gets
    it, through a hook, not through the Engine's insides)."""

    context: Any = None

    @hookimpl(tryfirst=True)
    def torchplug_barrier(self, engine: Any) -> None:
        self.context = engine
