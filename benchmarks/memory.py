"""Per-rank bytes of parameters, gradients and optimizer state under one strategy (2 ranks).

    python -m torch.distributed.run --nproc-per-node 2 -m benchmarks.memory --strategy fsdp \\
        --out R.jsonl

Measured from the tensors themselves after two AdamW steps by
``torchplug.features.memory.count_live`` (the counting ``torchplug estimate-memory``'s tests check
its estimates against): every live tensor's storage is counted once (views of one flat buffer, as
DeepSpeed makes, count once), split into what the model's parameters hold, what their gradients hold
(DeepSpeed's gradient partitions included), the optimizer's state (reached through the optimizer),
DeepSpeed's fp32 master partitions, and other buffers that appeared since before setup (buckets).
Peak RSS is reported beside it. One strategy per job, so that peak RSS is that strategy's own. """

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

import torchplug as tp
from benchmarks.common import mlp, peak_rss_mib, write_records
from torchplug.features.memory import count_live, live_storages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    x, y = torch.randn(16, args.width), torch.randint(0, 10, (16,))
    gc.collect()
    before = live_storages()
    engine = tp.Engine(args.strategy)
    model = mlp(args.width, args.depth, args.width)
    model, opt = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        engine.backward(loss)
        opt.step()
    # gradients are kept (no zero_grad): they are part of what a step holds
    del loss
    # counted as estimate-memory's test counts them (torchplug.features.memory); "other": fp32
    # gradient copies and flat buffers DeepSpeed allocates (ZeRO-3's reduce bucket is sized by
    # reduce_bucket_size, not by the model)
    sizes: dict[str, Any] = {**count_live(model, opt, before), "rss": peak_rss_mib()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sizes)
    if dist.get_rank() == 0:
        worst = {k: max(g[k] for g in gathered) for k in sizes}  # the fullest rank
        worst["strategy"] = args.strategy
        worst["world_size"] = dist.get_world_size()
        worst["numel"] = sum(
            p.numel() for p in mlp(args.width, args.depth, args.width).parameters()
        )
        write_records(args.out, [{"section": "memory-raw", **worst}])
    with contextlib.suppress(Exception):
        engine.close()
    os._exit(0)


if __name__ == "__main__":
    main()
