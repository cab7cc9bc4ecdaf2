"""Helpers for the checkpoint trust tests: tampering as an attacker would, and loading under a
guard that fails on any unpickling. Module-level, so rank workers can import them."""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import torchplug as tp
from torchplug.checkpoint.manifest import canonical
from torchplug.testing.bodies import full_state, make_model


class Unpickled(AssertionError):
    pass


@contextlib.contextmanager
def no_unpickling() -> Iterator[None]:
    """pickle.load(s), pickle.Unpickler and torch.load(weights_only != True) raise inside."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise Unpickled("something unpickled checkpoint bytes")

    class Refusing(pickle.Unpickler):
        def load(self) -> Any:
            refuse()

    real_torch_load = torch.load

    def guarded_torch_load(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("weights_only") is not True:
            refuse()
        return real_torch_load(*args, **kwargs)

    saved = (pickle.load, pickle.loads, pickle.Unpickler, torch.load)
    pickle.load, pickle.loads, pickle.Unpickler = refuse, refuse, Refusing  # type: ignore[misc]
    torch.load = guarded_torch_load  # type: ignore[assignment]
    try:
        yield
    finally:
        pickle.load, pickle.loads, pickle.Unpickler, torch.load = saved  # type: ignore[misc]


def forge(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Edit a manifest and make its digest agree, as someone without the signing key can."""
    manifest_path = Path(path) / "manifest.json"
    body = json.loads(manifest_path.read_text())
    change(body)
    body["digest"] = hashlib.sha256(canonical(body)).hexdigest()
    manifest_path.write_text(json.dumps(body))


def load_state(
    path: str, strategy: str = "single", guard: bool = True, **engine_options: Any
) -> dict[str, Any]:
    """Load into a fresh (differently seeded) model and optimizer; return everything loaded."""
    with contextlib.ExitStack() as stack:
        if guard:
            stack.enter_context(no_unpickling())
        engine = stack.enter_context(tp.Engine(strategy, **engine_options))
        model = make_model(seed=123)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
        model, optimizer = engine.setup(model, optimizer)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        rest = engine.load(path, state)
        return {"step": state["step"], "rest": rest, **full_state(engine, model, optimizer)}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit-identical loaded states (tensors compared with torch.equal)."""
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            if not isinstance(y, dict) or not same(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


# -- format 4's column index ----------------------------------------------------------------------


def _record_index(path: Path, data: bytes) -> None:
    """Write ``data`` as the checkpoint's manifest.index and make manifest.json agree with it
    (size, digest, the manifest's own digest): what someone without the signing key can do."""
    from torchplug.checkpoint import files as fs

    (Path(path) / "manifest.index").write_bytes(data)
    digest = fs.hasher("blake3")
    digest.update(data)

    def change(body: dict[str, Any]) -> None:
        body["index"] = {"file": "manifest.index", "size": len(data), "blake3": digest.hexdigest()}

    forge(path, change)


def read_columns(path: Path) -> dict[str, Any]:
    """The columns of a checkpoint's manifest.index as plain lists (``names`` as bytes)."""
    from torchplug.checkpoint import columns

    data = (Path(path) / "manifest.index").read_bytes()
    _, *counts = columns._HEADER.unpack_from(data)
    at = columns._HEADER.size
    out: dict[str, Any] = {}
    for section, letter, count in columns._sections(*counts):
        size = {"B": 1, "i": 4, "q": 8}[letter]
        raw = data[at : at + count * size]
        text = section in ("names", "file_names")
        out[section] = raw if text else list(struct.unpack(f"<{count}{letter}", raw))
        at += count * size
        at += -at % 8
    return out


def forge_columns(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Edit the columns of a checkpoint's manifest.index (lists, as `read_columns` gives them)
    and re-record it in manifest.json."""
    from torchplug.checkpoint import columns

    cols = read_columns(path)
    change(cols)
    _record_index(path, columns.pack(**cols))


def forge_index_bytes(path: Path, change: Callable[[bytearray], bytes | bytearray | None]) -> None:
    """Edit the raw bytes of a checkpoint's manifest.index and re-record it in manifest.json."""
    data = bytearray((Path(path) / "manifest.index").read_bytes())
    result = change(data)
    _record_index(path, bytes(result if result is not None else data))


def as_format3(path: Path) -> None:
    """Rewrite a checkpoint as format 3 wrote it: the tensor index as JSON in manifest.json, no
    manifest.index (an older torchplug's checkpoint)."""
    from torchplug.checkpoint import columns

    manifest_path = Path(path) / "manifest.json"
    body = json.loads(manifest_path.read_text())
    sizes = {name: info["size"] for name, info in body["files"].items()}
    index = columns.ColumnIndex(bytearray((Path(path) / "manifest.index").read_bytes()), sizes)
    body["tensors"] = {name: index[name] for name in index}
    del body["index"]
    body["format_version"] = 3
    body["digest"] = hashlib.sha256(canonical(body)).hexdigest()
    manifest_path.write_text(json.dumps(body, indent=1, sort_keys=True))  # as a save writes it
    (Path(path) / "manifest.index").unlink()
