"""DeepSpeed ZeRO's per-rank bytes (``StrategyInfo(memory=...)`` of the ``deepspeed*`` names):
ZeRO-1/2's flat, padded buffers and ZeRO-3's per-parameter partitions, with the fp32 master
partitions every stage steps, as ``torchplug estimate-memory`` shows them."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from torchplug.plugin import MemoryEstimate, MemoryQuery, ceil_div, state_bytes

#: Bytes per element of the dtypes DeepSpeed's own precision keeps weights in.
LOW_PRECISION_BYTES = {"bf16": 2, "fp16": 2}


def _zero_dtype_bytes(query: MemoryQuery) -> int:
    """DeepSpeed casts the model to bf16/fp16 under those precisions; fp32 stays as built."""
    return LOW_PRECISION_BYTES.get(query.precision, 0)


#: ``stage3_param_persistence_threshold``: ZeRO-3 keeps parameters of at most this many
#: elements whole on every rank after their first all-gather (DeepSpeed's default).
ZERO3_PERSISTENCE = 100_000
#: ``sub_group_size``: ZeRO-3 steps its flat fp32 partition in sub-groups of this many elements.
ZERO3_SUB_GROUP = 1_000_000_000
#: ZeRO-1/2 pad each flat group to a multiple of this many elements times the world size.
ZERO12_ALIGNMENT = 2


def zero(stage: int, **fixed: Any) -> Any:
    """DeepSpeed ZeRO stage ``stage`` (the ``deepspeed-zeroN`` names), with options the name
    fixes (``offload_optimizer="cpu"``)."""

    def rule(query: MemoryQuery) -> MemoryEstimate:
        options = {**query.options, **fixed}
        return _zero(stage, dataclasses.replace(query, options=options))

    rule.__doc__ = f"DeepSpeed ZeRO-{stage}."
    return rule


def deepspeed_memory(query: MemoryQuery) -> MemoryEstimate:
    """DeepSpeed with the ``stage`` option (default 2, as the strategy's), or the stage of the
    DeepSpeed ``config`` given."""
    stage = _ds_config(query).get("zero_optimization", {}).get("stage")
    return _zero(int(stage if stage is not None else query.options.get("stage", 2) or 2), query)


def _ds_config(query: MemoryQuery) -> dict[str, Any]:
    """The user's DeepSpeed config (option ``config``: a dict or a JSON file), else ``{}``."""
    import json
    from pathlib import Path

    config = query.options.get("config")
    if isinstance(config, (str, Path)) and Path(config).is_file():
        with contextlib.suppress(ValueError, OSError):
            config = json.loads(Path(config).read_text())
    return config if isinstance(config, dict) else {}


def _zero(stage: int, query: MemoryQuery) -> MemoryEstimate:
    w = query.world_size
    low = _zero_dtype_bytes(query)
    notes: list[str] = []
    offload_opt = query.options.get("offload_optimizer", "none") not in (None, "none")
    offload_par = query.options.get("offload_params", "none") not in (None, "none")
    if stage == 3:
        # each parameter partitioned on its own: ceil(numel / W) elements per rank
        parts = [ceil_div(p.numel, w) for p in query.params]
        dtype = [low or p.itemsize for p in query.params]
        partition = sum(n * b for n, b in zip(parts, dtype, strict=True))
        zero_config = _ds_config(query).get("zero_optimization", {})
        threshold = int(zero_config.get("stage3_param_persistence_threshold", ZERO3_PERSISTENCE))
        persistent = sum(
            p.numel * b for p, b in zip(query.params, dtype, strict=True) if p.numel <= threshold
        )
        params = partition + persistent
        grads = partition  # the flat gradient partition, in the model's dtype
        elements = sum(parts)
        masters = 4 * elements  # the fp32 partition the optimizer steps: a copy, in fp32 too
        groups = max(1, ceil_div(elements, ZERO3_SUB_GROUP))
        state = state_bytes(query, [elements], 4, groups)
        if persistent:
            notes.append(
                f"parameters of at most {threshold:,} elements stay whole on every rank "
                f"after the first forward (stage3_param_persistence_threshold)"
            )
        notes.append("plus DeepSpeed's reduce/prefetch buckets (reduce_bucket_size), not counted")
        if offload_par:
            notes.append("offload_params: the parameter partitions are on the CPU")
    else:
        numel = sum(p.numel for p in query.params)
        padded = ceil_div(numel, ZERO12_ALIGNMENT * w) * ZERO12_ALIGNMENT * w
        elements = padded // w
        itemsize = low or max((p.itemsize for p in query.params), default=4)
        params = padded * itemsize  # the weights live in one flat, padded buffer
        # Whole gradients at the end of backward: ZeRO-1 reduces them at the step; ZeRO-2 moves
        # them into the rank's partition bucket by bucket, so only a model larger than one
        # reduce bucket peaks lower (about the partition plus a bucket)
        grads = numel * itemsize
        masters = 4 * elements  # the fp32 partition is a copy, whatever the precision
        state = state_bytes(query, [elements], 4, 1)
        if stage == 2:
            notes.append(
                "gradients: whole while backward fills a reduce bucket (reduce_bucket_size, "
                "5e8 elements by default); beyond that, the partition plus one bucket"
            )
    if offload_opt:
        notes.append("offload_optimizer: fp32 masters, gradients' fp32 copy and state on the CPU")
    return MemoryEstimate(params, grads, state, masters, notes=tuple(notes))
