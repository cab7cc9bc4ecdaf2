"""Per-step cost of torchplug's ``ddp`` against hand-written torch DDP, side by side.

    torchplug launch -n 2 benchmarks/ddp_overhead.py [--steps 200] [--rounds 5] [--amp bf16]

Both loops run in the same processes on the same process group, model and data, in alternating
rounds so that machine noise hits both alike. Prints the median step time of each and the ratio
(torchplug / plain); 1.00 means no measurable cost.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torchplug as tp


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


def timed(step, steps: int) -> float:
    for _ in range(5):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--amp", default=None, help="bf16 or fp16 autocast for both loops")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)

    plain = DistributedDataParallel(make_model())
    plain_opt = torch.optim.AdamW(plain.parameters())
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None

    def plain_step() -> None:
        ctx = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
        with ctx:
            loss = torch.nn.functional.cross_entropy(plain(x).float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(plain_opt)
            scaler.update()
        else:
            loss.backward()
            plain_opt.step()
        plain_opt.zero_grad()

    engine = tp.Engine("ddp", precision=args.amp)  # reuses the process group above
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    model, opt = engine.setup(model, opt)

    def engine_step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        engine.backward(loss)
        opt.step()
        opt.zero_grad()

    plain_times, engine_times = [], []
    for _ in range(args.rounds):
        plain_times.append(timed(plain_step, args.steps))
        engine_times.append(timed(engine_step, args.steps))
    p, e = statistics.median(plain_times), statistics.median(engine_times)
    engine.print(
        f"world size {engine.world_size}, precision {engine.precision}, {args.steps} steps x "
        f"{args.rounds} rounds\n"
        f"plain torch DDP   {p * 1e3:8.3f} ms/step\n"
        f"torchplug ddp     {e * 1e3:8.3f} ms/step\n"
        f"ratio             {e / p:8.3f}  (torchplug / plain)"
    )
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
