"""Manifest validation at scale: a legitimate fsdp-shaped manifest of R ranks x T tensors (every
tensor split by rows into R chunks, one file per rank), validated as a load does it — the JSON
read with its digest check, then every chunk's checks and the layout check (each tensor's pieces
cover it exactly once).

Timed in one process (validation is pure Python and the same on every rank). The target is
absolute: at most 1 s of validation (``check``) per manifest; the JSON read is shown beside it.
"""

from __future__ import annotations

import json
import time
from typing import Any

from benchmarks.common import record
from torchplug.checkpoint import manifest as mf


def fsdp_manifest(ranks: int, tensors: int, cols: int = 8) -> dict[str, Any]:
    rows = 2 * ranks
    files = {f"tensors/__{r}_0.distcp": {"size": 10**12, "sha256": "0" * 64} for r in range(ranks)}
    index = {}
    for t in range(tensors):
        chunks = [
            {
                "offsets": [2 * r, 0],
                "sizes": [2, cols],
                "file": f"tensors/__{r}_0.distcp",
                "offset": t * 4096,
                "length": 4096,
                "raw": t * 4096 + 64,
            }  # fmt: skip
            for r in range(ranks)
        ]
        index[f"model.layers.{t}.weight"] = {
            "dtype": "float32", "shape": [rows, cols], "chunks": chunks,
        }  # fmt: skip
    header = {"strategy": {"name": "fsdp", "options": {}}, "world_size": ranks, "step": 1}
    return mf.build(header, {"model": {"kind": "module", "data": {}}}, index, files)


def run(rounds: int, smoke: bool) -> list[dict[str, Any]]:
    shapes = [(16, 50)] if smoke else [(256, 1000), (1024, 1000)]
    records = []
    for ranks, tensors in shapes:
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
        group = f"manifest of {ranks} ranks x {tensors} tensors ({len(raw) / 1e6:.0f} MB)"
        zero = [0.0] * rounds
        records.append(
            record(
                "validation",
                group,
                "validation (check)",
                "s",
                checks,
                zero,
                "0 s",
                {"max": 1.0},
                mode="diff",
            )  # fmt: skip
        )
        records.append(
            record(
                "validation",
                group,
                "JSON read + digest (load_json)",
                "s",
                reads,
                zero,
                "0 s",
                None,
                mode="diff",
            )  # fmt: skip
        )
    return records
