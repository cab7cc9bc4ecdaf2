"""``pp``'s memory rule for ``torchplug estimate-memory``: each pipeline rank holds its stages'
parameters, their gradients and optimizer state; the fullest rank is the answer.

Why by parameter order: the tracer cuts the forward before each split point, so a stage holds
the parameters from its split point's module to the next one's, in the order the model
registers them (the code before the first block, an embedding, goes to stage 0; what follows
the last block, a norm and a head, to the last). Without split points the longest numbered
block list (``layers.0``, ``layers.1``, ...) is cut evenly, as the strategy does.
"""

from __future__ import annotations

import re

from torchplug.plugin import MemoryEstimate, MemoryQuery


def _even_points(names: list[str], stages: int) -> list[str]:
    """The split points an even split of the longest numbered block list gives."""
    blocks: dict[str, set[int]] = {}
    for name in names:
        for match in re.finditer(r"(?:^|\.)(\d+)\.", name):
            prefix = name[: match.start()]
            blocks.setdefault(prefix, set()).add(int(match.group(1)))
    if not blocks:
        return []
    prefix, numbers = max(blocks.items(), key=lambda item: len(item[1]))
    count = len(numbers)
    head = f"{prefix}." if prefix else ""
    return [f"{head}{(i * count) // stages}" for i in range(1, min(stages, count))]


def stage_of_params(names: list[str], points: list[str]) -> list[int]:
    """Each parameter's stage: the number of split points whose module starts at or before it
    (a split point's module starts at its first parameter)."""
    starts = []
    for point in points:
        first = next((i for i, n in enumerate(names) if n.startswith(point + ".")), len(names))
        starts.append(first)
    return [sum(1 for start in starts if i >= start) for i in range(len(names))]


def pipeline_memory(query: MemoryQuery) -> MemoryEstimate:
    """The fullest pipeline rank's parameters, gradients and optimizer state."""
    options = query.options
    inner = max(int(options.get("dp_shard") or 1), 1) * max(int(options.get("tp_size") or 1), 1)
    pp = int(options.get("pp_size") or 0) or max(query.world_size // inner, 1)
    per_rank = int(options.get("stages_per_rank") or 0) or (
        1 if options.get("schedule", "1f1b") in ("gpipe", "1f1b") else 2
    )
    names = [p.name for p in query.params]
    points = options.get("split_points") or ()
    if isinstance(points, str):
        points = [p.strip() for p in points.split(",") if p.strip()]
    stages = stage_of_params(names, list(points) or _even_points(names, pp * per_rank))
    held = [0] * pp
    numel = [0] * pp
    for spec, stage in zip(query.params, stages, strict=True):
        held[stage % pp] += spec.numel * spec.itemsize
        numel[stage % pp] += spec.numel
    shard = max(int(options.get("dp_shard") or 1), 1)  # FSDP2 over dp_shard: a 1/shard share
    held, numel = [-(-h // shard) for h in held], [-(-n // shard) for n in numel]
    fullest = max(range(pp), key=lambda r: held[r])
    itemsize = held[fullest] // max(numel[fullest], 1)
    optimizer = query.states * numel[fullest] * itemsize
    count = sum(1 for s in stages if s % pp == fullest)
    steps = query.step_bytes * count if query.states else 0
    notes = (
        f"pipeline rank {fullest} of {pp} holds the most: its stages' parameters, gradients "
        f"and optimizer state; the other stages' tensors are freed",
        "tp_size's split layers are not modelled (each stage counted whole over tp)",
        "plus the activations of the micro-batches in flight (up to the stage count under "
        "1f1b, every micro-batch under gpipe), and a parameter tied across stages (an "
        "embedding and its head) once on each stage holding it",
    )
    return MemoryEstimate(held[fullest], held[fullest], optimizer + steps, notes=notes)
