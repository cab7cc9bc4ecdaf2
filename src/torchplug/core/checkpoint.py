"""The on-disk checkpoint format, one for every backend.

A checkpoint is a directory::

    ckpt/
      manifest.json      format version, layout, strategy and options, world size, step, user
                         metadata, the entries (their structure, with JSON values in place and
                         tensors by name), and every file with its size and sha256
      tensors/           the tensors, written by torch.distributed.checkpoint (DCP): each rank
                         writes its own shards; replicated tensors are written once

Because DCP records every tensor's global shape and each shard's offsets, a checkpoint written by
any strategy on any world size loads into any other: loading reads exactly the pieces each rank
needs. Module and optimizer state is stored by parameter name (``get_model_state_dict`` /
``get_optimizer_state_dict``), never by wrapper-specific names or parameter ids.

Nothing in a checkpoint can run code on load: non-tensor state is JSON in the manifest, tensor
data is read with ``weights_only=True``, and DCP's own metadata file is read by an unpickler that
admits only DCP's metadata classes. Every file's size and sha256 are checked before loading.

The checkpoint is written into a hidden temporary directory beside the target and swapped into
place in one rename once every rank has finished, so a crash never leaves a half-written
checkpoint under the final name and never destroys the last good one.

The manifest grows by adding keys (readers ignore keys they do not know); ``format_version``
changes only when an old reader would misread a new checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime
import hashlib
import json
import os
import pickle
import shutil
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from torchplug.core.errors import CheckpointError

FORMAT = "torchplug-checkpoint"
FORMAT_VERSION = 1
LAYOUT = "dcp"
MANIFEST = "manifest.json"
TENSORS = "tensors"


def kind_of(obj: Any) -> str:
    """Classify a state entry, or raise an error saying what can be saved."""
    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        return "stateful"
    if isinstance(obj, torch.Tensor):
        return "tensor"
    try:
        encode(obj, "", {})
    except CheckpointError:
        pass
    else:
        return "value"
    raise CheckpointError(
        f"Cannot save an object of type {type(obj).__name__}: expected an nn.Module, an "
        f"optimizer, an object with state_dict()/load_state_dict(), a tensor, or plain data "
        f"(numbers, strings, lists, dicts). Convert it to one of those, or give it a state_dict()."
    )


# -- structure: JSON skeleton + named tensors ------------------------------------------------------


def encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON skeleton of ``obj``; its tensors go into ``tensors`` under slash-separated paths.

    Tuples, dicts with non-string keys and tensors are tagged so that :func:`decode` restores
    them exactly. Anything else that JSON cannot hold is refused: no pickles.
    """
    if isinstance(obj, torch.Tensor):
        if path in tensors:
            raise CheckpointError(f"Two tensors in the state map to the name {path!r}.")
        tensors[path] = obj
        return {"__tensor__": path}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, (list, tuple)):
        items = [encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, f"{path}/{k}", tensors) for k, v in obj.items()}
        pairs = []
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise CheckpointError(
                    f"State at {path or '/'} has a key of type {type(k).__name__}; checkpoint "
                    f"keys must be strings or numbers."
                )
            pairs.append([k, encode(v, f"{path}/{k}", tensors)])
        return {"__dict__": pairs}
    raise CheckpointError(
        f"State at {path or '/'} holds a {type(obj).__name__}, which a checkpoint cannot store "
        f"safely (no pickles). Store tensors, numbers, strings, lists or dicts instead."
    )


def decode(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild what :func:`encode` took apart."""
    if isinstance(skeleton, list):
        return [decode(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__dtype__" in skeleton:
            return getattr(torch, skeleton["__dtype__"])
        if "__tuple__" in skeleton:
            return tuple(decode(v, tensors) for v in skeleton["__tuple__"])
        if "__dict__" in skeleton:
            return {k: decode(v, tensors) for k, v in skeleton["__dict__"]}
        return {k: decode(v, tensors) for k, v in skeleton.items()}
    return skeleton


def tensor_paths(skeleton: Any) -> Iterator[str]:
    """Every tensor name a skeleton refers to."""
    if isinstance(skeleton, list):
        for v in skeleton:
            yield from tensor_paths(v)
    elif isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            yield skeleton["__tensor__"]
            return
        for v in skeleton.values():
            yield from tensor_paths(v)


def restore_entry(
    state: dict[str, Any], key: str, kind: str, payload: Any, remainder: dict[str, Any]
) -> None:
    """Restore a non-module, non-optimizer entry: a stateful object in place; anything else is
    returned in ``remainder`` and replaces ``state[key]`` if the caller holds that key."""
    target = state.get(key)
    if key in state and kind == "stateful" and hasattr(target, "load_state_dict"):
        target.load_state_dict(payload)
        return
    remainder[key] = payload
    if key in state:
        state[key] = payload


# -- files -----------------------------------------------------------------------------------------


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def describe_files(root: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file below ``root`` (fsynced on the way), by relative path."""
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        _fsync(path)
        files[path.relative_to(root).as_posix()] = {
            "size": path.stat().st_size,
            "sha256": _sha256(path),
        }
    for directory in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        _fsync(directory)
    return files


def temporary_dir(final: Path) -> Path:
    """A fresh hidden directory beside ``final``; stale ones from crashed saves are removed."""
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def write_manifest(directory: Path, header: Mapping[str, Any], entries: Mapping[str, Any]) -> None:
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "layout": LAYOUT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "torch_version": torch.__version__,
        **json.loads(json.dumps(dict(header), default=repr)),
        "entries": entries,
        "files": describe_files(directory),
    }
    path = directory / MANIFEST
    with path.open("w") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    _fsync(directory)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False if unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return result == 0


def swap_into_place(tmp: Path, final: Path) -> None:
    """Make ``tmp`` the checkpoint at ``final`` in one step; the old one is removed after."""
    if not final.exists():
        os.rename(tmp, final)
    elif _exchange(tmp, final):
        shutil.rmtree(tmp)  # now holds the previous checkpoint
    else:  # no atomic exchange here: keep the old one under a backup name until the new is in
        backup = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(final, backup)
        os.rename(tmp, final)
        shutil.rmtree(backup)
    _fsync(final.parent)


# -- reading ---------------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``, checked for format and version."""
    root = Path(path)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        if root.is_dir() and (root / "latest").is_file():
            raise CheckpointError(
                f"{root} looks like a native DeepSpeed checkpoint, not a torchplug one. "
                f"Load it with strategy='deepspeed' or convert it with `torchplug convert`."
            )
        raise CheckpointError(
            f"No torchplug checkpoint at {root}: {manifest_path} does not exist. Check the path; "
            f"a checkpoint is the directory that engine.save() created."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"Checkpoint manifest {manifest_path} is not valid JSON ({exc}); the checkpoint is "
            f"damaged. Load an earlier checkpoint."
        ) from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{manifest_path} is not a torchplug checkpoint manifest (format "
            f"{manifest.get('format')!r}, expected {FORMAT!r})."
        )
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"Checkpoint {root} has format version {version!r}; this torchplug reads up to "
            f"{FORMAT_VERSION}. Upgrade torchplug to load it."
        )
    if manifest.get("layout") != LAYOUT:
        raise CheckpointError(
            f"Checkpoint {root} has layout {manifest.get('layout')!r}; this torchplug reads "
            f"{LAYOUT!r}. Upgrade torchplug to load it."
        )
    return manifest


def verify_files(root: str | os.PathLike[str], manifest: Mapping[str, Any]) -> None:
    """Check that every file the manifest lists is there with its size and sha256."""
    root = Path(root)
    for name, expected in sorted(manifest.get("files", {}).items()):
        path = root / name
        if not path.is_file():
            raise CheckpointError(
                f"Checkpoint file {path} is missing (the manifest lists it). The checkpoint is "
                f"incomplete; restore the file or load an earlier checkpoint."
            )
        size = path.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(
                f"Checkpoint file {path} has {size} bytes, the manifest says {expected['size']}: "
                f"it was truncated or changed after saving. Restore it or load an earlier "
                f"checkpoint."
            )
        digest = _sha256(path)
        if digest != expected["sha256"]:
            raise CheckpointError(
                f"Checkpoint file {path} fails its sha256 check ({digest[:12]}..., the manifest "
                f"says {expected['sha256'][:12]}...): it was altered or corrupted after saving. "
                f"Restore it or load an earlier checkpoint."
            )


_SAFE_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` admitting only its data classes: no code runs on load."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _SAFE_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"Checkpoint metadata refers to {module}.{name}, which is not part of "
            f"torch.distributed.checkpoint's metadata; refusing to load it (it could run code)."
        )


def tensor_reader(directory: str | os.PathLike[str]) -> Any:
    """A DCP storage reader whose metadata is read by :class:`_MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = Path(self.path) / ".metadata"
            with path.open("rb") as handle:
                metadata = _MetadataUnpickler(handle).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(directory)


def tensor_shapes(directory: str | os.PathLike[str]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Global shape and dtype of every tensor in a checkpoint's tensor store."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = tensor_reader(directory).read_metadata()
    return {
        name: (meta.size, meta.properties.dtype)
        for name, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def save_tensors(
    directory: Path, tensors: dict[str, torch.Tensor], no_dist: bool | None = None
) -> None:
    """Write ``tensors`` (plain or sharded DTensors) with DCP; a collective on every rank unless
    ``no_dist`` (one process writing alone)."""
    import torch.distributed.checkpoint as dcp

    with _quiet_single_process():
        dcp.save(
            tensors,
            storage_writer=dcp.FileSystemWriter(directory, sync_files=True),
            no_dist=not distributed() if no_dist is None else no_dist,
        )


def load_tensors(
    directory: Path, targets: dict[str, torch.Tensor], no_dist: bool | None = None
) -> None:
    """Fill ``targets`` in place from the tensor store, resharding as needed; a collective
    unless ``no_dist``."""
    import torch.distributed.checkpoint as dcp

    if not targets:
        return
    with _quiet_single_process():
        dcp.load(
            targets,
            storage_reader=tensor_reader(directory),
            no_dist=not distributed() if no_dist is None else no_dist,
        )


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns when it runs in one process; here that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def allocate(
    shapes: Mapping[str, tuple[torch.Size, torch.dtype]], names: list[str]
) -> dict[str, torch.Tensor]:
    """Empty CPU tensors to load the named tensors into, from the store's metadata."""
    missing = [n for n in names if n not in shapes]
    if missing:
        raise CheckpointError(
            f"Checkpoint tensor store lacks {missing[:5]}; the checkpoint is damaged. Load an "
            f"earlier checkpoint."
        )
    return {n: torch.empty(shapes[n][0], dtype=shapes[n][1]) for n in names}
