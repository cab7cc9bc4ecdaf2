"""``pp`` on 2 ranks: bytes per rank against ``ddp``, and each schedule's bubble measured against
its theoretical value (issue 39).

Bytes: live parameters, gradients and optimizer state after an AdamW step (the fullest rank),
over ``ddp``'s (every rank holds the whole model): about 1/stages plus the embedding.

Bubble: a schedule's step over ``m`` micro-batches of a fixed size takes about
``(m + idle) * t``, where ``t`` is one micro-batch's forward and backward through a rank's
stages and ``idle`` the slots a rank waits for the pipeline to fill and drain. ``t`` is the
slope of the step time over ``m`` (m = 2, 4, 8: a least-squares line), so the measured bubble at
``m`` is ``1 - m t / T(m)``; theory: ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, ``(p - 1) /
(v m + p - 1)`` interleaved over ``v`` stages per rank.

    python -m torch.distributed.run --nproc-per-node 2 --standalone -m benchmarks.pipeline --out R
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
from torch import nn

from benchmarks.common import median, record, write_records

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))
MICRO = (2, 4, 8)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.fc(x)))


class Model(nn.Module):
    def __init__(self, width: int, depth: int, vocab: int = 512) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _bytes(strategy: str, options: dict[str, Any], width: int, depth: int) -> int:
    import torchplug as tp
    from torchplug.features import memory

    before = memory.live_storages()
    with tp.Engine(strategy, **options) as engine:
        torch.manual_seed(0)
        model = Model(width, depth)
        model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters()))
        x = torch.randint(0, 512, (8, 16))
        for _ in range(2):
            engine.forward_backward(model, x, target=x, loss_fn=_loss)
            optimizer.step()
        counted = memory.count_live(model, optimizer, before)
        total = torch.tensor(float(counted["params"] + counted["grads"] + counted["optimizer"]))
        return int(engine.reduce(total, "max").item())


def _step_times(schedule: str, per_rank: int, micro: int, width: int, depth: int) -> list[float]:
    import torchplug as tp

    times = {}
    with tp.Engine("pp", schedule=schedule, stages_per_rank=per_rank) as engine:
        torch.manual_seed(0)
        model = Model(width, depth)
        model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
        for m in MICRO:
            x = torch.randint(0, 512, (m * micro, 16))
            samples = []
            for step in range(4):
                engine.barrier()
                started = time.perf_counter()
                engine.forward_backward(model, x, target=x, loss_fn=_loss)
                took = engine.reduce(torch.tensor(time.perf_counter() - started), "max").item()
                if step:  # the first traces the stages
                    samples.append(took)
                optimizer.zero_grad()
            times[m] = median(samples)
    return [times[m] for m in MICRO]


def _bubble(times: list[float], m: int) -> float:
    xs = [float(x) for x in MICRO]
    mean_x, mean_y = sum(xs) / len(xs), sum(times) / len(times)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, times, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return 1.0 - m * slope / times[MICRO.index(m)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--micro", type=int, default=8, help="samples per micro-batch")
    args = parser.parse_args()
    records = []
    pp = [_bytes("pp", {}, args.width, args.depth)]  # deterministic: one round is enough
    ddp = [_bytes("ddp", {}, args.width, args.depth)]
    records.append(record("pipeline", "bytes per rank (params, grads, AdamW state)", "ddp",
                          "MB", [b / 1e6 for b in ddp], [b / 1e6 for b in ddp], "ddp"))  # fmt: skip
    records.append(record("pipeline", "bytes per rank (params, grads, AdamW state)", "pp, 2 stages",
                          "MB", [b / 1e6 for b in pp], [b / 1e6 for b in ddp], "ddp",
                          {"max": 0.6}))  # fmt: skip
    stages = 2
    for schedule, per_rank in SCHEDULES:
        measured, theory = [], []
        for _ in range(args.rounds):
            times = _step_times(schedule, per_rank, args.micro, args.width, args.depth)
            measured.append(_bubble(times, 4))
            theory.append((stages - 1) / (per_rank * 4 + stages - 1))
        records.append(record("pipeline", "bubble fraction at 4 micro-batches, 2 ranks",
                              schedule, "fraction", measured, theory, "theory",
                              mode="diff"))  # fmt: skip
    if int(os.environ.get("RANK", "0")) == 0:
        write_records(args.out, records)


if __name__ == "__main__":
    main()
