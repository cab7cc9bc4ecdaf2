"""What a ZeRO-3 save holds in memory on each rank, against the rank's share of the state.

    python -m torch.distributed.run --nproc-per-node 2 -m benchmarks.save_memory --out R.jsonl

The model is built partitioned (``engine.init_module(empty=True)``) and trained one AdamW step;
then ``engine.save``. Measured on every rank when the save starts writing (when it holds all it
will write): the bytes of tensor storages that appeared since before the save (every live
tensor counted once, as ``benchmarks.memory`` counts), and the peak RSS rise during the save,
sampled every millisecond. The baseline is the rank's share of the full state (fp32 weights and
AdamW's two moments over the world size): ZeRO-3 exists because the whole does not fit on one
rank, so a save must not gather it there.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

import torchplug as tp
from benchmarks.common import record, write_records
from benchmarks.memory import live_storages


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=24, help="24 x 1024^2 fp32: ~100 MB")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from torchplug.checkpoint import tensors as store

    engine = tp.Engine("deepspeed-zero3", timeout=300.0)
    with engine.init_module(empty=True):
        layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.depth)]
        model = torch.nn.Sequential(*layers)
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    engine.backward(model(torch.randn(4, args.width)).square().mean())
    optimizer.step()
    optimizer.zero_grad()
    full = [p.ds_numel * 4 for p in model.parameters()] * 3  # weights, exp_avg, exp_avg_sq
    share = sum(full) / engine.world_size

    held: dict[str, int] = {}
    real = store.write

    def measured(root: Any, tensors: dict[str, torch.Tensor], rank: int) -> Any:
        held["live"] = sum(live_storages().values()) - before
        return real(root, tensors, rank)

    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.001)

    store.write = measured  # this benchmark process only
    path = os.path.join(args.dir or "/tmp", f"torchplug-bench-zero3-save-{os.getppid()}")
    before = sum(live_storages().values())
    rss_before = _rss_bytes()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    engine.save(path, {"model": model, "optimizer": optimizer})
    done.set()
    sampler.join()
    store.write = real
    rows = [None] * engine.world_size
    dist.all_gather_object(rows, (held["live"], peak[0] - rss_before))
    if engine.is_main:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
        live = max(r[0] for r in rows)
        rss = max(r[1] for r in rows)
        rec = record(
            "checkpoint",
            f"ZeRO-3 save, {sum(full) / 3e6:.0f} MB of fp32 weights, {engine.world_size} ranks",
            "zero3 save: tensors a rank holds while writing (largest rank)",
            "MB",
            [live / 1e6],
            [share / 1e6],
            "the rank's share of weights + AdamW state",
            {"max": 1.1},
        )
        rec["detail"] = (
            f"share {share / 1e6:.0f} MB, largest tensor {max(full) / 1e6:.1f} MB, "
            f"peak RSS rise during the save {rss / 1e6:.0f} MB"
        )
        write_records(args.out, [rec])
    engine.close()


if __name__ == "__main__":
    main()
