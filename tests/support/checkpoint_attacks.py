"""Helpers for the checkpoint trust tests: tampering as an attacker would, and loading under a
guard that fails on any unpickling. Module-level, so rank workers can import them."""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle
import random
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


class Loader:
    """One Engine, model and optimizer for every load (a load that succeeds overwrites all)."""

    def __init__(self) -> None:
        self.engine = tp.Engine("single")
        model = make_model(seed=123)
        self.model, self.optimizer = self.engine.setup(
            model, torch.optim.AdamW(model.parameters(), lr=0.5)
        )

    def __call__(self, path: Path) -> dict:
        state = {"model": self.model, "optimizer": self.optimizer, "step": 0}
        rest = self.engine.load(path, state)
        snapshot = full_state(self.engine, self.model, self.optimizer)
        return {"step": state["step"], "rest": rest, **snapshot}


def _random_tensor(rng: random.Random) -> tuple[dict, dict]:
    """A tensor entry and its files: a grid, rows, or an irregular layout, then perhaps one
    field of one chunk spoiled (out of range, overlapping, a wrong type, missing, too big)."""
    dims = rng.choice([1, 2, 3])
    shape = [rng.choice([1, 2, 4, 6]) for _ in range(dims)]
    cuts = [sorted({0, n, *rng.sample(range(n + 1), min(n, rng.choice([0, 1, 2])))}) for n in shape]
    cells = [[]]
    for cut in cuts:
        cells = [c + [(a, b)] for c in cells for a, b in zip(cut, cut[1:], strict=False)]
    files = {"f0": {"size": 10**6, "sha256": "0" * 64}, "f1": {"size": 100, "sha256": "0" * 64}}
    with_raw = rng.random() < 0.5
    chunks = []
    for i, cell in enumerate(cells):
        n = 1
        for a, b in cell:
            n *= b - a
        chunk = {
            "offsets": [a for a, _ in cell], "sizes": [b - a for a, b in cell],
            "file": "f0", "offset": 64 * i, "length": 4 * n + 8,
        }  # fmt: skip
        if with_raw:
            chunk["raw"] = 64 * i + rng.choice([0, 4, 8])
        chunks.append(chunk)
    if rng.random() < 0.7:
        chunk = rng.choice(chunks)
        key = rng.choice(["offsets", "sizes", "offset", "length", "file", "raw"])
        spoil = rng.choice([
            -1, 2**63, 2**70, 1.5, "3", None, [], [0] * (dims + 1), "f1", "nope", 10**7, "drop",
        ])  # fmt: skip
        if spoil == "drop":
            chunk.pop(key, None)
        elif key in ("offsets", "sizes") and isinstance(spoil, int):
            chunk[key] = [*chunk[key][:-1], chunk[key][-1] + spoil]
        else:
            chunk[key] = spoil
    if rng.random() < 0.2 and len(chunks) > 1:
        chunks.append(dict(rng.choice(chunks)))  # a duplicate piece
    return {"dtype": "float32", "shape": shape, "chunks": chunks}, files
