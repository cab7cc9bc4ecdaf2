"""Per-rank bytes of parameters, gradients and optimizer state under one strategy (2 ranks).

    python -m torch.distributed.run --nproc-per-node 2 -m benchmarks.memory --strategy fsdp \\
        --out R.jsonl

Measured from the tensors themselves after two AdamW steps: every live tensor's storage is
counted once (views of one flat buffer, as DeepSpeed makes, count once), split into what the
model's parameters hold, what their gradients hold, and the rest that appeared since before
setup: the optimizer's state (reached through the optimizer), and other buffers (fp32 master
copies, gradient partitions, buckets). Peak RSS is reported beside
it. One strategy per job, so that peak RSS is that strategy's own.
"""

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


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    with contextlib.suppress(Exception):
        s = t.untyped_storage()
        if s.nbytes() and t.device.type != "meta":
            return s.data_ptr(), s.nbytes()
    return None


def live_storages() -> dict[int, int]:
    """Every storage a live tensor holds, by address (each counted once)."""
    found: dict[int, int] = {}
    for obj in gc.get_objects():
        with contextlib.suppress(Exception):
            if isinstance(obj, torch.Tensor):
                s = _storage(obj)
                if s is not None:
                    found[s[0]] = s[1]
    return found


def optimizer_states(opt: Any) -> dict[int, int]:
    """Storages of the optimizer's state (AdamW's moments and step), through wrappers that hold
    the real optimizer as ``.optimizer`` (DeepSpeed, torchplug's own) or ``.optim`` (FairScale)."""
    found: dict[int, int] = {}
    seen: set[int] = set()
    todo = [opt]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        for state in getattr(current, "state", {}).values() if hasattr(current, "state") else ():
            values = state.values() if isinstance(state, dict) else ()
            for value in values:
                if isinstance(value, torch.Tensor):
                    s = _storage(value)
                    if s is not None:
                        found[s[0]] = s[1]
        todo += [getattr(current, name, None) for name in ("optimizer", "optim", "_optimizer")]
    return found


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
    gc.collect()
    after = {k: v for k, v in live_storages().items() if k not in before}
    params: dict[int, int] = {}
    grads: dict[int, int] = {}
    for p in model.parameters():
        for t, into in ((getattr(p, "ds_tensor", None), params), (p, params), (p.grad, grads)):
            if isinstance(t, torch.Tensor):
                s = _storage(t)
                if s is not None and s[0] not in params and s[0] not in grads:
                    into[s[0]] = s[1]
    # DeepSpeed ZeRO-3 leaves p.data empty and keeps the shard in p.ds_tensor (counted above).
    states = {k: v for k, v in optimizer_states(opt).items() if k not in params}
    rest = {
        k: v for k, v in after.items() if k not in params and k not in grads and k not in states
    }
    sizes = {
        "params": sum(params.values()),
        "grads": sum(grads.values()),
        "optimizer": sum(states.values()),
        # fp32 master partitions, gradient partitions and flat buffers DeepSpeed allocates
        # (ZeRO-3's reduce bucket is sized by reduce_bucket_size, not by the model)
        "other": sum(rest.values()),
        "rss": peak_rss_mib(),
    }
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
