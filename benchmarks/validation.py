"""Manifest validation at scale: a legitimate fsdp-shaped checkpoint index of R ranks x T tensors
(every tensor split by rows into R chunks, one file per rank), read as a load reads it.

Format 4 (``manifest.index``, columns): the file read, its BLAKE3 digest checked, every chunk's
checks and the layout check (each tensor's pieces cover it exactly once) — `columns.read`, what
every rank runs before the first byte of data is read. Targets: at most 1.0 s at 1,024 ranks x
1,000 tensors and 0.3 s at 256, at most 40 bytes a chunk, and growth to 8,192 ranks no worse
than linear (the 8,192-rank index is built as columns directly: as Python dicts it would not fit
in this machine's memory). Format 3 (the index as JSON in manifest.json, still loaded) is shown
beside it at 256 ranks.

Timed in one process (the same work runs on every rank).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import interleaved, record
from torchplug.checkpoint import columns
from torchplug.checkpoint import files as fs
from torchplug.checkpoint import manifest as mf

ROW_BYTES = 4096  # each chunk's bytes in its file (the numbers only need to be consistent)


def fsdp_manifest(ranks: int, tensors: int, cols: int = 8) -> dict[str, Any]:
    """A format 3 manifest (the index as JSON) of the fsdp layout."""
    rows = 2 * ranks
    files = {f"tensors/__{r}_0.distcp": {"size": 10**12, "sha256": "0" * 64} for r in range(ranks)}
    index = {}
    for t in range(tensors):
        chunks = [
            {
                "offsets": [2 * r, 0],
                "sizes": [2, cols],
                "file": f"tensors/__{r}_0.distcp",
                "offset": t * ROW_BYTES,
                "length": ROW_BYTES,
                "raw": t * ROW_BYTES + 64,
            }  # fmt: skip
            for r in range(ranks)
        ]
        index[f"model.layers.{t}.weight"] = {
            "dtype": "float32", "shape": [rows, cols], "chunks": chunks,
        }  # fmt: skip
    header = {"strategy": {"name": "fsdp", "options": {}}, "world_size": ranks, "step": 1}
    return mf.build(header, {"model": {"kind": "module", "data": {}}}, index, files)


def fsdp_index(ranks: int, tensors: int, cols: int = 8) -> tuple[bytes, dict[str, int]]:
    """The same layout as `fsdp_manifest`, as format 4's column bytes, built with tensor
    operations; and the file sizes it refers to."""
    file_names = [f"tensors/__{r}_0.distcp".encode() for r in range(ranks)]
    rank = torch.arange(ranks).repeat(tensors)  # chunk order: tensor by tensor
    tensor = torch.arange(tensors).repeat_interleave(ranks)
    names = [f"model.layers.{t}.weight".encode() for t in range(tensors)]
    data = columns.pack(
        dtype=[columns.DTYPE_ORDER.index("float32")] * tensors,
        ndim=[2] * tensors,
        count=[ranks] * tensors,
        name_len=[len(n) for n in names],
        names=b"".join(names),
        shape=[2 * ranks, cols] * tensors,
        file_name_len=[len(n) for n in file_names],
        file_names=b"".join(file_names),
        file=rank,
        start=tensor * ROW_BYTES,
        length=torch.full((ranks * tensors,), ROW_BYTES),
        raw=torch.full((ranks * tensors,), 64),
        offsets=torch.stack([2 * rank, torch.zeros_like(rank)], 1).flatten(),
        sizes=torch.tensor([2, cols]).repeat(ranks * tensors),
    )
    return data, {name.decode(): 10**12 for name in file_names}


def _reader(root: Path, data: bytes, sizes: dict[str, int], ranks: int) -> Any:
    """One timed read of an index: `columns.read` (file read, digest check, validation), then
    one rank's load plan entries (`ColumnIndex.over`: its own rows of every tensor). Each size
    has its own folder, so that sizes can be read in turns."""
    root.mkdir()
    (root / mf.INDEX).write_bytes(data)
    digest = fs.hasher("blake3")
    digest.update(data)
    recorded = {"file": mf.INDEX, "size": len(data), "blake3": digest.hexdigest()}
    mine = [([ranks, 0], [2, 8])]  # rank ranks // 2's rows (fsdp_index: 2 rows a rank, 8 columns)

    def once() -> tuple[float, float]:
        start = time.perf_counter()
        index = columns.read(root, recorded, sizes)
        took = time.perf_counter() - start
        start = time.perf_counter()
        entries = [index.over(name, mine) for name in index]
        planned = time.perf_counter() - start
        assert all(len(e["chunks"]) == 1 for e in entries)
        return took, planned

    return once


def run(rounds: int, smoke: bool) -> list[dict[str, Any]]:
    shapes = [(16, 50)] if smoke else [(256, 1000), (1024, 1000), (8192, 1000)]
    targets = {256: 0.3, 1024: 1.0}
    records = []
    zero = [0.0] * rounds
    root = Path(tempfile.mkdtemp(prefix="torchplug-bench-index-"))
    per_chunk: dict[int, list[float]] = {}
    try:
        readers, lengths = {}, {}
        for ranks, tensors in shapes:
            data, sizes = fsdp_index(ranks, tensors)
            readers[ranks] = _reader(root / str(ranks), data, sizes, ranks)
            lengths[ranks] = len(data)
            del data
        # The sizes are read in turns, round by round (the order rotated), so that the growth
        # row compares reads made under the same machine load, not one size's rounds against
        # another's made minutes later.
        times = interleaved(readers, rounds, lambda: None)
        for ranks, tensors in shapes:
            took = [t for t, _ in times[ranks]]
            planned = [p for _, p in times[ranks]]
            chunks = ranks * tensors
            per_chunk[ranks] = [t / chunks for t in took]
            group = f"index of {ranks} ranks x {tensors} tensors ({lengths[ranks] / 1e6:.0f} MB)"
            limit = targets.get(ranks)
            records.append(
                record("validation", group, "format 4: read + digest + validate", "s", took,
                       zero, "0 s", {"max": limit} if limit else None, mode="diff")
            )  # fmt: skip
            records.append(
                record("validation", group, "format 4: one rank's entries (its chunks only)", "s",
                       planned, zero, "0 s", None, mode="diff")
            )  # fmt: skip
            records.append(
                record("validation", group, "format 4: bytes per chunk", "B",
                       [lengths[ranks] / chunks] * rounds, zero, "0 B", {"max": 40.0},
                       mode="diff")
            )  # fmt: skip
        if 8192 in per_chunk:  # the time per chunk at 8,192 ranks over that at 1,024
            records.append(
                record("validation", "index of 8192 ranks x 1000 tensors (growth)",
                       "format 4: time per chunk vs 1,024 ranks", "x", per_chunk[8192],
                       per_chunk[1024], "time per chunk at 1,024 ranks", {"max": 1.0})
            )  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ranks, tensors = shapes[0]
    raw = json.dumps(fsdp_manifest(ranks, tensors)).encode()
    reads, checks = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        body = mf.load_json(raw, "manifest.json")
        t1 = time.perf_counter()
        mf.check(body, "manifest.json")
        t2 = time.perf_counter()
        reads.append(t1 - t0)
        checks.append(t2 - t1)
    group = f"format 3 manifest of {ranks} ranks x {tensors} tensors ({len(raw) / 1e6:.0f} MB JSON)"
    records.append(
        record("validation", group, "format 3: JSON read + digest", "s", reads, zero, "0 s",
               None, mode="diff")
    )  # fmt: skip
    records.append(
        record("validation", group, "format 3: validation (check)", "s", checks, zero, "0 s",
               None, mode="diff")
    )  # fmt: skip
    return records
