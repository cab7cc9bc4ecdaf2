"""Step time of DeepSpeed ZeRO-2 against ddp on the same model, side by side (issue 4's GPU check).

    python benchmarks/zero2_vs_ddp.py [--precision bf16] [--steps 50]      # one rank
    torchplug launch -n 2 benchmarks/zero2_vs_ddp.py                        # or several

Runs on CUDA when there is a GPU (the intended check: ZeRO-2 bf16 on one rank), else on the CPU
as a smoke test. Needs ``pip install torchplug[deepspeed]``. Prints the median step time of each
and the ratio deepspeed / ddp.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import torchplug as tp


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def step_times(
    strategy: str, precision: str | None, steps: int, width: int, batch: int
) -> list[float]:
    with tp.Engine(strategy, precision=precision) as engine:
        model = make_model(width)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = engine.setup(model, optimizer)
        x = torch.randn(batch, width, device=engine.device)
        y = torch.randint(0, 10, (batch,), device=engine.device)
        times = []
        for i in range(steps + 5):
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 5:  # warm-up steps are not timed
                times.append(time.perf_counter() - start)
        engine.print(f"{strategy:<16} {engine.device}  final loss {loss.item():.4f}")
        return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    ddp = statistics.median(step_times("ddp", args.precision, args.steps, args.width, args.batch))
    ds = statistics.median(
        step_times("deepspeed-zero2", args.precision, args.steps, args.width, args.batch)
    )
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(
        f"precision {args.precision}, width {args.width}, batch {args.batch}\n"
        f"ddp              {ddp * 1e3:8.3f} ms/step\n"
        f"deepspeed-zero2  {ds * 1e3:8.3f} ms/step\n"
        f"ratio            {ds / ddp:8.3f}  (deepspeed / ddp)"
    )


if __name__ == "__main__":
    main()
