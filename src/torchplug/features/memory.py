"""Per-rank bytes of parameters, gradients and optimizer state: estimated from parameter shapes
(``torchplug estimate-memory``) and counted from the live tensors (the benchmarks' memory section
and the tests that check the estimates against it).

An estimate needs no allocation: a model built on the meta device gives the shapes and dtypes,
and each strategy's sharding rule turns them into the bytes its fullest rank holds. A strategy
declares its rule as ``StrategyInfo(memory=...)`` (a function ``MemoryQuery -> MemoryEstimate``,
the ready ones below); one registered without it (plugin API 1.0) gets a rule derived from its
``shards_parameters`` / ``shards_optimizer`` flags, marked as derived.

What is counted is the model state a training step keeps: parameters, gradients, optimizer state
and (DeepSpeed) fp32 master copies. Activations, communication buckets and allocator caches are
not; each rule says in its notes what else its backend allocates.

This module imports torch only inside functions: plugins import it while registering.

Why this module is over 500 lines: every built-in strategy's rule (ddp, fsdp's padded dim-0
shards, ZeRO-1/2/3 with their flat buffers and fp32 masters, FairScale, tp) is here beside the
shared query and estimate types and the live-tensor counter that checks them; split, each rule
would be a few dozen lines away from the types it fills.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Optimizer state tensors per parameter element, by ``--optimizer`` name; every torch optimizer
#: with state also keeps a ``step`` (a 4-byte float32 scalar tensor) per parameter it steps.
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}
#: Bytes of the ``step`` scalar Adam and AdamW keep per parameter (SGD's momentum keeps none).
STEP_BYTES = 4
#: Bytes per element of the dtypes a precision keeps weights in (DeepSpeed's own precision).
LOW_PRECISION_BYTES = {"bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a rule sees it: its name, shape, bytes per element, and the class name
    of the module holding it (``"Linear"``, ``"Embedding"``: how tensor parallelism splits it)."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    module: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class MemoryQuery:
    """What a strategy's memory rule is asked: the model's parameters (each once, tied ones
    once), the world size, the precision (``"32"``, ``"bf16"``, ``"fp16"``), the optimizer
    (a key of `OPTIMIZER_STATES`) and the strategy's resolved options."""

    params: tuple[ParamSpec, ...]
    world_size: int
    precision: str = "32"
    optimizer: str = "adamw"
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    #: The model's own ``tp_plan`` (or Hugging Face's ``_tp_plan``), when it carries one.
    model_tp_plan: Mapping[str, Any] | None = field(default=None, hash=False)

    @property
    def states(self) -> int:
        return OPTIMIZER_STATES[self.optimizer]

    @property
    def step_bytes(self) -> int:
        """The ``step`` scalar per stepped parameter (Adam, AdamW)."""
        return STEP_BYTES if self.optimizer in ("adam", "adamw") else 0


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the fullest rank; ``masters``: the fp32 copies of the weights an optimizer steps
    beside the model's own (DeepSpeed keeps its partition of them, in every precision);
    ``notes``: what the rule assumes or leaves out."""

    params: int
    grads: int
    optimizer: int
    masters: int = 0
    notes: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.masters

    def as_dict(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "masters": self.masters,
            "total": self.total,
            "notes": list(self.notes),
        }


MemoryRule = Callable[[MemoryQuery], MemoryEstimate]


def param_specs(module: Any) -> tuple[ParamSpec, ...]:
    """The trainable parameters of ``module`` (on any device, the meta device included), each
    once (``parameters()`` skips tied duplicates)."""
    return tuple(
        ParamSpec(
            name,
            tuple(p.shape),
            p.element_size(),
            type(module.get_submodule(name.rpartition(".")[0])).__name__,
        )
        for name, p in module.named_parameters()
        if p.requires_grad
    )


def model_tp_plan(module: Any) -> Mapping[str, Any] | None:
    """The tensor-parallel plan a model carries (``tp_plan``, Hugging Face's ``_tp_plan``)."""
    plan = getattr(module, "tp_plan", None) or getattr(module, "_tp_plan", None)
    return plan if isinstance(plan, Mapping) else None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _state_bytes(query: MemoryQuery, numels: Iterable[int], itemsize: int, tensors: int) -> int:
    """Optimizer state over ``numels`` elements held as ``tensors`` stepped tensors."""
    states = query.states
    if not states:
        return 0
    return states * sum(numels) * itemsize + query.step_bytes * tensors


# -- the rules ------------------------------------------------------------------------------------


def replicated(query: MemoryQuery) -> MemoryEstimate:
    """Every rank holds everything (DDP, single device): parameters, gradients and optimizer
    state of the whole model, in the parameters' dtype (AMP autocasts; weights stay as built)."""
    params = sum(p.numel * p.itemsize for p in query.params)
    state = sum(query.states * p.numel * p.itemsize for p in query.params)
    steps = query.step_bytes * len(query.params) if query.states else 0
    return MemoryEstimate(params, params, state + steps)


def ddp(query: MemoryQuery) -> MemoryEstimate:
    """`replicated`, plus DDP's gradient buckets (inside its C++ reducer, not counted)."""
    estimate = replicated(query)
    note = (
        "DDP's reducer also keeps gradient buckets of the gradients' size (not counted; "
        "gradient_as_bucket_view=True makes the gradients views into them)"
    )
    if query.options.get("gradient_as_bucket_view"):
        note = "gradients are views into DDP's buckets (gradient_as_bucket_view=True)"
    return MemoryEstimate(estimate.params, estimate.grads, estimate.optimizer, notes=(note,))


def fsdp2_shard_numel(shape: tuple[int, ...], world_size: int) -> tuple[int, int]:
    """FSDP2's dim-0 sharding of one parameter over ``world_size`` ranks: ``(padded, rank0)``
    elements, where ``padded`` is each rank's storage (dim 0 padded up to a multiple of the
    world size, so every rank's shard has ``ceil(dim0 / world_size)`` rows) and ``rank0`` the
    elements rank 0, the fullest, holds (optimizer state is made the size of the unpadded
    shard)."""
    if not shape:
        return 1, 1
    rows = _ceil_div(shape[0], world_size)
    rest = math.prod(shape[1:])
    return rows * rest, min(rows, shape[0]) * rest


def fsdp2(query: MemoryQuery) -> MemoryEstimate:
    """torch FSDP2 (``fully_shard``): each parameter split on dim 0 over the ranks; parameters
    and gradients stored padded, optimizer state the size of the rank's unpadded rows. Sharded
    weights and gradients stay in the parameters' dtype under bf16 (FSDP computes in bf16 and
    reduces in fp32); the gathered bf16 copies exist only around each unit's forward/backward."""
    w = query.world_size
    params = grads = state = 0
    for p in query.params:
        padded, rank0 = fsdp2_shard_numel(p.shape, w)
        params += padded * p.itemsize
        grads += padded * p.itemsize
        state += query.states * rank0 * p.itemsize
    steps = query.step_bytes * len(query.params) if query.states else 0
    notes = ["each unit's parameters are all-gathered whole around its forward and backward"]
    if query.options.get("cpu_offload"):
        notes.append("cpu_offload: parameters, gradients and optimizer state are on the CPU")
    return MemoryEstimate(params, grads, state + steps, notes=tuple(notes))


def even_sharding(query: MemoryQuery) -> MemoryEstimate:
    """Derived for a strategy that declares ``shards_parameters``: everything split evenly
    (``ceil(numel / world_size)`` per parameter) over the ranks."""
    w = query.world_size
    params = sum(_ceil_div(p.numel, w) * p.itemsize for p in query.params)
    state = query.states * params + (query.step_bytes * len(query.params) if query.states else 0)
    return MemoryEstimate(params, params, state)


def _owner_shares(query: MemoryQuery) -> list[list[ParamSpec]]:
    """FairScale OSS's partition: each parameter, in order, to the rank holding the fewest
    elements so far (whole parameters; ties to the lowest rank)."""
    sizes = [0] * query.world_size
    owned: list[list[ParamSpec]] = [[] for _ in range(query.world_size)]
    for p in query.params:
        rank = sizes.index(min(sizes))
        sizes[rank] += p.numel
        owned[rank].append(p)
    return owned


def sharded_optimizer(query: MemoryQuery) -> MemoryEstimate:
    """FairScale OSS (ZeRO-1 style): whole parameters and gradients on every rank, each
    parameter's optimizer state on one owner rank (the fullest owner counted)."""
    full = replicated(query)
    state = max(
        _state_bytes(query, (p.numel for p in share), share[0].itemsize if share else 4, len(share))
        for share in _owner_shares(query)
    )
    return MemoryEstimate(full.params, full.grads, state)


def sharded_gradients(query: MemoryQuery) -> MemoryEstimate:
    """FairScale ShardedDDP + OSS: whole parameters, each parameter's optimizer state on its
    owner. With ``reduce_buffer_size=0`` a rank frees the gradients it does not own once they
    are reduced (keeping its share); with reduce buckets (the default) every gradient stays."""
    estimate = sharded_optimizer(query)
    if query.options.get("reduce_buffer_size", 1):
        note = "gradients stay whole with reduce buckets (reduce_buffer_size=0: the owned share)"
        return MemoryEstimate(estimate.params, estimate.grads, estimate.optimizer, notes=(note,))
    shares = _owner_shares(query)
    fullest = max(shares, key=lambda share: sum(p.numel for p in share))
    grads = sum(p.numel * p.itemsize for p in fullest)
    note = "gradients of parameters owned elsewhere are freed once reduced"
    return MemoryEstimate(estimate.params, grads, estimate.optimizer, notes=(note,))


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


def zero(stage: int, **fixed: Any) -> MemoryRule:
    """DeepSpeed ZeRO stage ``stage`` (the ``deepspeed-zeroN`` names), with options the name
    fixes (``offload_optimizer="cpu"``)."""

    def rule(query: MemoryQuery) -> MemoryEstimate:
        options = {**query.options, **fixed}
        return _zero(stage, dataclasses.replace(query, options=options))

    rule.__doc__ = f"DeepSpeed ZeRO-{stage}."
    return rule


def deepspeed(query: MemoryQuery) -> MemoryEstimate:
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
        parts = [_ceil_div(p.numel, w) for p in query.params]
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
        groups = max(1, _ceil_div(elements, ZERO3_SUB_GROUP))
        state = _state_bytes(query, [elements], 4, groups)
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
        padded = _ceil_div(numel, ZERO12_ALIGNMENT * w) * ZERO12_ALIGNMENT * w
        elements = padded // w
        itemsize = low or max((p.itemsize for p in query.params), default=4)
        params = padded * itemsize  # the weights live in one flat, padded buffer
        # Whole gradients at the end of backward: ZeRO-1 reduces them at the step; ZeRO-2 moves
        # them into the rank's partition bucket by bucket, so only a model larger than one
        # reduce bucket peaks lower (about the partition plus a bucket)
        grads = numel * itemsize
        masters = 4 * elements  # the fp32 partition is a copy, whatever the precision
        state = _state_bytes(query, [elements], 4, 1)
        if stage == 2:
            notes.append(
                "gradients: whole while backward fills a reduce bucket (reduce_bucket_size, "
                "5e8 elements by default); beyond that, the partition plus one bucket"
            )
    if offload_opt:
        notes.append("offload_optimizer: fp32 masters, gradients' fp32 copy and state on the CPU")
    return MemoryEstimate(params, grads, state, masters, notes=tuple(notes))


def derived_rule(shards_parameters: bool, shards_optimizer: bool) -> MemoryRule:
    """For a strategy registered without ``memory=``: from its capability flags (even sharding
    assumed; marked as derived)."""

    def rule(query: MemoryQuery) -> MemoryEstimate:
        if shards_parameters:
            estimate, how = even_sharding(query), "shards_parameters: all split evenly"
        elif shards_optimizer:
            full = replicated(query)
            shard = even_sharding(query)
            estimate = MemoryEstimate(full.params, full.grads, shard.optimizer)
            how = "shards_optimizer: optimizer state split evenly"
        else:
            estimate, how = replicated(query), "full replicas"
        note = f"derived from the strategy's flags ({how}); it declares no memory rule"
        return MemoryEstimate(
            estimate.params, estimate.grads, estimate.optimizer, estimate.masters, (note,)
        )

    return rule


def rule_for(info: Any) -> MemoryRule:
    """The memory rule of a registered strategy: its own, else one derived from its flags."""
    return getattr(info, "memory", None) or derived_rule(
        info.shards_parameters, info.shards_optimizer
    )


# -- counting the live tensors --------------------------------------------------------------------


def _storage(t: Any) -> tuple[int, int] | None:
    """``(address, bytes)`` of the storage behind ``t`` (a DTensor's local shard), if any."""
    import torch

    with contextlib.suppress(Exception):
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = t.to_local()
    if not isinstance(t, torch.Tensor):
        return None
    with contextlib.suppress(Exception):
        s = t.untyped_storage()
        if s.nbytes() and t.device.type != "meta":
            return s.data_ptr(), s.nbytes()
    return None


def live_storages() -> dict[int, int]:
    """Every storage a live tensor holds, by address (each counted once)."""
    import torch

    found: dict[int, int] = {}
    for obj in gc.get_objects():
        with contextlib.suppress(Exception):
            if isinstance(obj, torch.Tensor):
                s = _storage(obj)
                if s is not None:
                    found[s[0]] = s[1]
    return found


def _optimizers(opt: Any) -> list[Any]:
    """``opt`` and what it wraps (``.optimizer`` as DeepSpeed's and torchplug's wrappers hold
    it, ``.optim`` as FairScale's, ``._optimizer``)."""
    found, seen, todo = [], set(), [opt]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        todo += [getattr(current, name, None) for name in ("optimizer", "optim", "_optimizer")]
    return found


def _tensors(value: Any) -> Iterable[Any]:
    """The tensors in ``value`` (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif value is not None:
        yield value


def optimizer_states(opt: Any) -> dict[int, int]:
    """Storages of the optimizer's state (Adam's moments and step), through wrappers."""
    found: dict[int, int] = {}
    for current in _optimizers(opt):
        state = getattr(current, "state", None)
        for per_param in state.values() if isinstance(state, dict) else ():
            for value in per_param.values() if isinstance(per_param, dict) else ():
                s = _storage(value)
                if s is not None:
                    found[s[0]] = s[1]
    return found


#: Where DeepSpeed's ZeRO optimizers keep gradient partitions and fp32 master partitions.
_GRAD_ATTRIBUTES = ("grad_partitions_flat_buffer", "grads_in_partition", "averaged_gradients")
_MASTER_ATTRIBUTES = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups")


def _attribute_storages(roots: Iterable[Any], names: tuple[str, ...]) -> dict[int, int]:
    found: dict[int, int] = {}
    for current in (o for root in roots for o in _optimizers(root)):
        for name in names:
            for tensor in _tensors(getattr(current, name, None)):
                s = _storage(tensor)
                if s is not None:
                    found[s[0]] = s[1]
    return found


def count_live(model: Any, optimizer: Any, before: Mapping[int, int] | None = None) -> dict:
    """Bytes this rank's live tensors hold, each storage once: ``params`` (what the model's
    parameters hold, a DTensor's local shard, a ZeRO-3 ``ds_tensor`` partition), ``grads``
    (their ``.grad``, DeepSpeed's gradient partitions), ``optimizer`` (the optimizer's state,
    through wrappers), ``masters`` (DeepSpeed's fp32 master partitions that are not the
    parameters themselves) and ``other``: every other storage not in ``before`` (from
    `live_storages` taken before setup), such as communication buffers."""
    gc.collect()
    params: dict[int, int] = {}
    grads: dict[int, int] = {}
    for p in model.parameters():
        for t, into in ((getattr(p, "ds_tensor", None), params), (p, params), (p.grad, grads)):
            s = _storage(t)
            if s is not None and s[0] not in params and s[0] not in grads:
                into[s[0]] = s[1]
    # DeepSpeed's ZeRO optimizer is reached from its engine (the set-up model's .optimizer)
    holders = (optimizer, model)
    for address, size in _attribute_storages(holders, _GRAD_ATTRIBUTES).items():
        if address not in params:
            grads.setdefault(address, size)
    masters = {
        k: v
        for k, v in _attribute_storages(holders, _MASTER_ATTRIBUTES).items()
        if k not in params and k not in grads
    }
    states = {
        k: v
        for k, v in optimizer_states(optimizer).items()
        if k not in params and k not in grads and k not in masters
    }
    counted = params.keys() | grads.keys() | masters.keys() | states.keys()
    rest = {
        k: v
        for k, v in live_storages().items()
        if k not in counted and (before is None or k not in before)
    }
    return {
        "params": sum(params.values()),
        "grads": sum(grads.values()),
        "optimizer": sum(states.values()),
        "masters": sum(masters.values()),
        "other": sum(rest.values()),
    }


class NotEstimable(Exception):
    """Raised by a memory rule when parameter shapes alone cannot tell (the message says why)."""


def not_estimable(reason: str) -> MemoryRule:
    """A rule that says why a strategy's per-rank bytes cannot be told from shapes alone."""

    def rule(query: MemoryQuery) -> MemoryEstimate:
        raise NotEstimable(reason)

    return rule
