"""What every benchmark worker shares: models, interleaved timing, and the result records.

A result record is one JSON object per measured contestant::

    {"section": "step", "group": "tiny MLP, fp32", "name": "torchplug ddp",
     "unit": "ms/step", "values": [...], "baseline": "raw DDP", "ratios": [...],
     "target": {"kind": "ratio", "max": 1.01}}

``values`` holds one number per round; ``ratios`` (when there is a baseline) the same round's
value over the baseline's, so that drift of the machine between rounds cancels. The runner turns
records into the Markdown table and the chart.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def mlp(width: int, depth: int, inputs: int, classes: int = 10) -> torch.nn.Module:
    """The same seeded MLP for every contestant (``depth`` hidden layers of ``width``)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(inputs, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, classes))


def record(
    section: str,
    group: str,
    name: str,
    unit: str,
    values: Sequence[float],
    baseline: Sequence[float] | None = None,
    baseline_name: str | None = None,
    target: dict[str, Any] | None = None,
    *,
    mode: str = "ratio",
) -> dict[str, Any]:
    """One result record; ``mode`` is ``ratio`` (value / baseline) or ``diff`` (value - baseline),
    computed round by round."""
    out: dict[str, Any] = {
        "section": section,
        "group": group,
        "name": name,
        "unit": unit,
        "values": list(values),
        "baseline": baseline_name,
        "target": target,
        "mode": mode,
    }
    if baseline is not None:
        if mode == "ratio":
            out["ratios"] = [v / b for v, b in zip(values, baseline, strict=True)]
        else:
            out["ratios"] = [v - b for v, b in zip(values, baseline, strict=True)]
    return out


def interleaved(
    contestants: dict[str, Callable[[], float]], rounds: int, sync: Callable[[], None]
) -> dict[str, list[float]]:
    """Run every contestant once per round, in an order rotated each round, so that machine
    drift and position in the round hit all alike. Each callable returns its own measurement."""
    names = list(contestants)
    results: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            sync()
            results[name].append(contestants[name]())
    return results


def per_second(
    amount: float, fn: Callable[[], Any], sync: Callable[[], None]
) -> Callable[[], float]:
    """A contestant for `interleaved`: ``amount`` (MB, GB) over the wall time of ``fn``, every
    rank synchronised before and after (a save or load is done when the slowest rank is)."""

    def run() -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return amount / (time.perf_counter() - start)

    return run


def interleaved_steps(
    steps: dict[str, Callable[[], Any]],
    per_round: int,
    rounds: int,
    warmup: int,
    sync: Callable[[], None],
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Milliseconds per step, one value per round: the wall time, and the CPU time of the
    calling (training) thread. The contestants' steps are interleaved one by one, the order
    rotating each step and carrying on across rounds (so no contestant is always the first
    after a round's barrier): every load burst longer than a few steps then hits every
    contestant alike. On 2 ranks on 2 cores, blocks of 200 steps per contestant gave round
    ratios spread over 0.92-1.27 between two identical raw loops, and these rounds 0.91-1.07
    (interquartile +-2.5 % against +-10 %).

    The thread's CPU time leaves out what the wall time spends waiting: for the other rank, for
    a collective in flight, descheduled. A framework's own per-step work (Python on the training
    thread) shows in both; its spread between identical loops is a tenth of the wall time's."""
    names = list(steps)
    for step in steps.values():
        for _ in range(warmup):
            step()
    clock, cpu_clock = time.perf_counter, time.thread_time
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    turn = 0
    for _ in range(rounds):
        spent = dict.fromkeys(names, 0.0)
        used = dict.fromkeys(names, 0.0)
        sync()
        for _ in range(per_round):
            first = turn % len(names)
            turn += 1
            for name in names[first:] + names[:first]:
                start, start_cpu = clock(), cpu_clock()
                steps[name]()
                spent[name] += clock() - start
                used[name] += cpu_clock() - start_cpu
        sync()
        for name in names:
            wall[name].append(spent[name] / per_round * 1e3)
            cpu[name].append(used[name] / per_round * 1e3)
    return wall, cpu


def added_cpu(
    cpu: Sequence[float], base_cpu: Sequence[float], base_wall: Sequence[float]
) -> list[float]:
    """Per round, ``1 +`` the CPU time a contestant's step adds over the baseline's, as a
    fraction of the baseline's wall step: the step time the contestant's own work costs, read
    at the CPU clock's resolution instead of the wall clock's (a planted busy-wait of 1 % of
    the step reads 1.01 here, 0.97-1.05 in the wall rows). Waiting the contestant adds (an
    extra collective) does not show: the wall rows and by-hand controls show that."""
    return [1 + (c - b) / w for c, b, w in zip(cpu, base_cpu, base_wall, strict=True)]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def write_records(path: str | os.PathLike[str], records: list[dict[str, Any]]) -> None:
    """Append records to a JSON-lines file (each worker adds its own)."""
    with Path(path).open("a") as handle:
        for rec in records:
            handle.write(json.dumps(rec) + "\n")


def peak_rss_mib() -> float:
    """This process's peak resident set size in MiB (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
