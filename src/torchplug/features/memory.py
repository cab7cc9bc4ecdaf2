"""Per-rank bytes of parameters, gradients and optimizer state: estimated from parameter shapes
(``torchplug estimate-memory``) and counted from the live tensors (the benchmarks' memory section
and the tests that check the estimates against it).

An estimate needs no allocation: a model built on the meta device gives the shapes and dtypes,
and each strategy's sharding rule turns them into the bytes its fullest rank holds. A strategy
declares its rule as ``StrategyInfo(memory=...)`` (a function ``MemoryQuery -> MemoryEstimate``)
and each built-in's rule lives with its plugin; here are the shared types, the two generic rules
(`replicated`, `even_sharding`) and the rule derived from ``shards_parameters`` /
``shards_optimizer`` for a strategy registered without one (plugin API 1.0), marked as derived.

What is counted is the model state a training step keeps: parameters, gradients, optimizer state
and (DeepSpeed) fp32 master copies. Activations, communication buckets and allocator caches are
not; each rule says in its notes what else its backend allocates.

This module imports torch only inside functions: plugins import it while registering.
"""

from __future__ import annotations

import contextlib
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


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a rule sees it: its name, shape, bytes per element, and the class name
    of the module holding it (``"Linear"``, ``"Embedding"``: how tensor parallelism splits it).

    Args:
        name: The parameter's name in the model.
        shape: Its shape.
        itemsize: Bytes per element.
        module: The class name of the module holding it.
    """

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
    (a key of `OPTIMIZER_STATES`) and the strategy's resolved options.

    Args:
        params: The model's parameters, each once (tied ones once).
        world_size: The ranks the model is spread over.
        precision: ``"32"``, ``"bf16"`` or ``"fp16"``.
        optimizer: A key of ``OPTIMIZER_STATES`` (``"adamw"``, ``"sgd"``, ...).
        options: The strategy's resolved options.
        model_tp_plan: The model's own tensor-parallel plan, if it has one.
    """

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
    ``notes``: what the rule assumes or leaves out.

    Args:
        params: Bytes of parameters on the fullest rank.
        grads: Bytes of gradients.
        optimizer: Bytes of optimizer state (with each tensor's ``step``).
        masters: Bytes of fp32 master copies that are not the parameters (DeepSpeed).
        notes: What else the backend allocates, or how the rule decided, in words.
    """

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
    """The tensor-parallel plan a model carries: its own ``tp_plan`` (or Hugging Face's
    ``_tp_plan``), else those of its outermost submodules that carry one, each entry prefixed
    with the submodule's name (a Hugging Face model inside the user's wrapper keeps its plan);
    ``None`` when nothing carries one.

    Args:
        module: The model as the user gives it to ``engine.setup``.
    """
    own = getattr(module, "tp_plan", None) or getattr(module, "_tp_plan", None)
    if own is not None or not hasattr(module, "named_modules"):
        return own if isinstance(own, Mapping) else None
    plan: dict[str, Any] = {}
    taken: list[str] = []
    for name, child in module.named_modules():
        if not name or any(name.startswith(f"{t}.") for t in taken):
            continue
        found = getattr(child, "tp_plan", None) or getattr(child, "_tp_plan", None)
        if isinstance(found, Mapping) and found:
            taken.append(name)
            plan.update({f"{name}.{pattern}": style for pattern, style in found.items()})
    return plan or None


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up: the elements per rank of ``a`` split over ``b`` ranks.

    Args:
        a: The elements to split.
        b: The ranks they are split over.
    """
    return -(-a // b)


def state_bytes(query: MemoryQuery, numels: Iterable[int], itemsize: int, tensors: int) -> int:
    """Bytes of optimizer state over ``numels`` elements of ``itemsize`` bytes, held as
    ``tensors`` stepped tensors (each with its ``step`` scalar).

    Args:
        query: The question asked (optimizer and precision).
        numels: Element counts of the stepped tensors.
        itemsize: Bytes per element of the state.
        tensors: How many stepped tensors hold them.
    """
    states = query.states
    if not states:
        return 0
    return states * sum(numels) * itemsize + query.step_bytes * tensors


# -- the rules ------------------------------------------------------------------------------------


def replicated(query: MemoryQuery) -> MemoryEstimate:
    """Every rank holds everything (DDP, single device): parameters, gradients and optimizer
    state of the whole model, in the parameters' dtype (AMP autocasts; weights stay as built).

    Args:
        query: The question asked.
    """
    params = sum(p.numel * p.itemsize for p in query.params)
    state = sum(query.states * p.numel * p.itemsize for p in query.params)
    steps = query.step_bytes * len(query.params) if query.states else 0
    return MemoryEstimate(params, params, state + steps)


def even_sharding(query: MemoryQuery) -> MemoryEstimate:
    """Derived for a strategy that declares ``shards_parameters``: everything split evenly
    (``ceil(numel / world_size)`` per parameter) over the ranks.

    Args:
        query: The question asked.
    """
    w = query.world_size
    params = sum(ceil_div(p.numel, w) * p.itemsize for p in query.params)
    state = query.states * params + (query.step_bytes * len(query.params) if query.states else 0)
    return MemoryEstimate(params, params, state)


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
    """A rule that says why a strategy's per-rank bytes cannot be told from shapes alone.

    Args:
        reason: Why; what ``torchplug estimate-memory`` shows instead of numbers.
    """

    def rule(query: MemoryQuery) -> MemoryEstimate:
        raise NotEstimable(reason)

    return rule
