"""The on-disk checkpoint format, one for every backend.

A checkpoint is a directory::

    ckpt/
      manifest.json      format version, layout, strategy and options, world size, step,
                         entries (what each state key is and where it lives), and every file
                         with its size and sha256
      model.pt ...       tensor data, one file per stateful entry

It is written into a hidden temporary directory beside the target, flushed to disk, and swapped
into place in one rename, so a crash never leaves a half-written checkpoint under the final name
and never destroys the last good one. Loading checks the manifest, verifies each file's size and
hash before reading it, and reads with ``weights_only=True``: a checkpoint cannot run code.

The manifest grows by adding keys: readers ignore keys they do not know, and ``format_version``
changes only when an old reader would misread a new checkpoint. ``layout`` says how tensor data is
stored (``"full"`` here; sharded layouts add their own).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import hashlib
import io
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from torchplug.core.errors import CheckpointError

FORMAT = "torchplug-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"

#: Kinds of state entries and how each is stored.
#:   module / optimizer / stateful -> state_dict() in a tensor file, restored with load_state_dict
#:   tensor -> a tensor file;  value -> JSON inside the manifest
KINDS = ("module", "optimizer", "stateful", "tensor", "value")


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
    if _is_json(obj):
        return "value"
    raise CheckpointError(
        f"Cannot save an object of type {type(obj).__name__}: expected an nn.Module, an "
        f"optimizer, an object with state_dict()/load_state_dict(), a tensor, or a JSON value "
        f"(numbers, strings, lists, dicts). Convert it to one of those, or give it a state_dict()."
    )


def _is_json(obj: Any) -> bool:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return True
    if isinstance(obj, (list, tuple)):
        return all(_is_json(v) for v in obj)
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in obj.items())
    return False


def capture(obj: Any) -> tuple[str, Any]:
    """``(kind, payload)`` for one live object: its state dict, the tensor, or the value."""
    kind = kind_of(obj)
    if kind in ("module", "optimizer", "stateful"):
        return kind, obj.state_dict()
    if kind == "tensor":
        return kind, obj.detach().cpu()
    return kind, obj


def _file_name(key: str, taken: set[str]) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", key).strip(".") or "entry"
    name, n = f"{stem}.pt", 1
    while name in taken:
        n += 1
        name = f"{stem}-{n}.pt"
    taken.add(name)
    return name


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))


def _fsync_dir(path: Path) -> None:
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


def _write_file(path: Path, data: bytes) -> dict[str, Any]:
    with path.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write(
    path: str | os.PathLike[str],
    payloads: Mapping[str, tuple[str, Any]],
    header: Mapping[str, Any],
) -> Path:
    """Write ``payloads`` (from :func:`capture`) as a checkpoint at ``path``, atomically."""
    final = Path(path).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        files: dict[str, Any] = {}
        entries: dict[str, Any] = {}
        taken: set[str] = {MANIFEST}
        for key, (kind, payload) in payloads.items():
            if kind == "value":
                entries[key] = {"kind": kind, "value": _jsonable(payload)}
                continue
            name = _file_name(key, taken)
            buffer = io.BytesIO()
            torch.save(payload, buffer)
            files[name] = _write_file(tmp / name, buffer.getvalue())
            entries[key] = {"kind": kind, "file": name}
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "layout": "full",
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "torch_version": torch.__version__,
            **_jsonable(dict(header)),
            "entries": entries,
            "files": files,
        }
        _write_file(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
        _fsync_dir(tmp)
        _swap_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


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


def _swap_into_place(tmp: Path, final: Path) -> None:
    if not final.exists():
        os.rename(tmp, final)
    elif _exchange(tmp, final):
        shutil.rmtree(tmp)  # now holds the previous checkpoint
    else:  # no atomic exchange here: keep the old one under a backup name until the new is in
        backup = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(final, backup)
        os.rename(tmp, final)
        shutil.rmtree(backup)
    _fsync_dir(final.parent)


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
    return manifest


def read_file(root: str | os.PathLike[str], manifest: Mapping[str, Any], name: str) -> bytes:
    """The bytes of one checkpoint file, after checking its size and sha256 against the manifest."""
    path = Path(root) / name
    expected = manifest.get("files", {}).get(name)
    if expected is None:
        raise CheckpointError(f"Checkpoint manifest of {root} lists no file {name!r}.")
    if not path.is_file():
        raise CheckpointError(
            f"Checkpoint file {path} is missing (the manifest lists it). The checkpoint is "
            f"incomplete; restore the file or load an earlier checkpoint."
        )
    data = path.read_bytes()
    if len(data) != expected["size"]:
        raise CheckpointError(
            f"Checkpoint file {path} has {len(data)} bytes, the manifest says {expected['size']}: "
            f"it was truncated or changed after saving. Restore it or load an earlier checkpoint."
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected["sha256"]:
        raise CheckpointError(
            f"Checkpoint file {path} fails its sha256 check ({digest[:12]}..., the manifest says "
            f"{expected['sha256'][:12]}...): it was altered or corrupted after saving. Restore it "
            f"or load an earlier checkpoint."
        )
    return data


def read_entry(root: str | os.PathLike[str], manifest: Mapping[str, Any], key: str) -> Any:
    """One entry's payload: a JSON value, or tensor data read with ``weights_only=True``."""
    entry = manifest["entries"][key]
    if entry["kind"] == "value":
        return entry["value"]
    data = read_file(root, manifest, entry["file"])
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"Checkpoint file {Path(root) / entry['file']} could not be read safely "
            f"(weights_only=True): {exc}"
        ) from None


def restore(target: Any, kind: str, payload: Any) -> bool:
    """Load ``payload`` into the live object ``target`` in place; False if it has no place."""
    if kind in ("module", "optimizer", "stateful") and callable(
        getattr(target, "load_state_dict", None)
    ):
        target.load_state_dict(payload)
        return True
    return False


def load(
    root: str | os.PathLike[str],
    state: dict[str, Any] | None,
    *,
    strict: bool = True,
    unwrap: Callable[[Any], Any] = lambda obj: obj,
) -> dict[str, Any]:
    """Load the full checkpoint at ``root`` into ``state`` in place.

    Modules, optimizers and stateful objects are restored with ``load_state_dict``; tensors and
    plain values replace the entries of ``state``. Returns the entries that were not restored into
    an object (values, tensors, and state dicts of keys ``state`` does not hold).
    """
    manifest = read_manifest(root)
    if manifest.get("layout") != "full":
        raise CheckpointError(
            f"Checkpoint {root} has layout {manifest.get('layout')!r}, which this strategy cannot "
            f"read. Load it with the strategy that wrote it ({manifest.get('strategy')})."
        )
    entries = manifest["entries"]
    state = {} if state is None else state
    missing = [k for k in state if k not in entries]
    if missing and strict:
        raise CheckpointError(
            f"Checkpoint {root} has no entries {missing}; it holds {sorted(entries)}. Remove "
            f"those keys from the state you load into, or pass strict=False."
        )
    remainder: dict[str, Any] = {}
    for key, entry in entries.items():
        payload = read_entry(root, manifest, key)
        target = unwrap(state.get(key))
        if key in state and entry["kind"] in ("module", "optimizer", "stateful"):
            if not restore(target, entry["kind"], payload):
                raise CheckpointError(
                    f"Checkpoint entry '{key}' is a saved {entry['kind']} but state['{key}'] is a "
                    f"{type(target).__name__} without load_state_dict(). Pass the live object."
                )
            continue
        remainder[key] = payload
        if key in state:
            state[key] = payload
    return remainder
