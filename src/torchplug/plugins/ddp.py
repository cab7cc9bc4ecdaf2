"""``ddp``: torch DistributedDataParallel. gloo on CPU, nccl on CUDA, device from LOCAL_RANK."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torchplug.plugin import (
    DEFAULT_TIMEOUT,
    ConfigurationError,
    DistributedStrategy,
    HookContext,
    MemoryEstimate,
    MemoryQuery,
    Option,
    StrategyInfo,
    ddp_reduction_finished,
    hookimpl,
    positive_number,
    replicated,
    some_of,
)

#: DDP's own options, declared once: the registration, the defaults and what is passed to torch.
DDP_OPTIONS: tuple[Option, ...] = (
    Option("find_unused_parameters", bool, False, "see torch DDP"),
    Option("static_graph", bool, False, "see torch DDP"),
    Option("gradient_as_bucket_view", bool, False, "see torch DDP"),
    Option("broadcast_buffers", bool, True, "see torch DDP"),
    Option(
        "bucket_cap_mb",
        float,
        25.0,
        "gradient bucket size in MiB (torch DDP)",
        validate=positive_number("MiB", 1024.0**2),
    ),
)


class DDPStrategy(DistributedStrategy):
    """The ``ddp`` backend: torch DistributedDataParallel (subclass it to build on DDP).

    Args:
        process_group_backend: The torch.distributed backend (``None``: nccl on CUDA, gloo on CPU).
        timeout: Seconds before a collective gives up.
        **ddp: DistributedDataParallel's options: ``find_unused_parameters``, ``static_graph``,
            ``gradient_as_bucket_view``, ``broadcast_buffers``, ``bucket_cap_mb``.

    Raises:
        TypeError: An option DDP does not have.
    """

    def __init__(
        self, process_group_backend: str | None = None, timeout: float = DEFAULT_TIMEOUT, **ddp: Any
    ) -> None:
        super().__init__(process_group_backend, timeout)
        defaults = {o.name: o.default for o in DDP_OPTIONS}
        unknown = sorted(set(ddp) - set(defaults))
        if unknown:
            raise TypeError(
                f"DDPStrategy got unknown option(s) {unknown}; expected some of "
                f"{', '.join(defaults)} (see torch DistributedDataParallel)."
            )
        # Pass only what differs from DDP's defaults: names get deprecated across torch versions.
        self.ddp_kwargs = {k: v for k, v in ddp.items() if v != defaults[k]}
        #: The DDP modules whose unused parameters DDP does not look for, with their parameters,
        #: by id; an entry leaves when its module is freed (a k-fold loop's earlier models are
        #: freed as without torchplug). A plain dict: iterating a WeakKeyDictionary costs ~1 µs
        #: a backward.
        self.watched: dict[int, tuple[Any, list[tuple[str, torch.nn.Parameter]]]] = {}
        #: Models set up with no trainable parameter (left unwrapped), the same way.
        self.frozen: dict[int, tuple[Any, list[tuple[str, torch.nn.Parameter]]]] = {}

    @hookimpl
    def torchplug_wrap(
        self, engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        """The default answer to [`torchplug_wrap`][torchplug_wrap] (see the hook reference)."""
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(engine.device)
        if not any(p.requires_grad for p in model.parameters()):
            # A frozen model (a distillation teacher, a reward model): no gradient to average,
            # and DDP refuses it ("not needed"). It stays the plain module, as with Accelerate;
            # the backward check refuses it if it is unfrozen and trained later.
            key = id(model)
            self.frozen[key] = (weakref.ref(model), list(model.named_parameters()))
            weakref.finalize(model, self.frozen.pop, key, None)
            return model, optimizers
        device_ids = [engine.device.index] if engine.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs)
        finds = self.ddp_kwargs.get("find_unused_parameters") or self.ddp_kwargs.get("static_graph")
        if not finds:  # DDP itself does not look for unused parameters: torchplug does
            key = id(wrapped)
            self.watched[key] = (weakref.ref(wrapped), list(model.named_parameters()))
            weakref.finalize(wrapped, self.watched.pop, key, None)
        return wrapped, optimizers

    @hookimpl
    def torchplug_backward(
        self, engine: HookContext, loss: torch.Tensor, model: torch.nn.Module | None
    ) -> bool:
        """``loss.backward()``; then a parameter that took no part in the loss on this rank
        (ranks using different parameters: a mixture of experts, a branch some ranks take) is
        named now, before the optimizer steps. Without ``find_unused_parameters`` DDP cannot
        average a gradient a rank did not produce: it stepped once with unsynchronised
        gradients and raised at the next forward, naming its own keyword, not the option.
        (An answer, not a wrapper around the default one: a wrapper cost each backward ~1 µs
        more, past the dispatch benchmark's budget. No forward hook either: one sends every
        forward through torch's slow module-call path, ~6 µs a step.)

        A model whose DDP reducer finished its reduction (every parameter got its gradient, or
        none did: a GAN's other model, a model evaluated under ``no_grad``, an earlier k-fold
        model) passes at one C++ call, ~0.5 µs; reading each ``.grad`` cost ~10 µs a step.
        Only a model left half reduced is looked at, and then looked up in the loss's graph: it
        may hold leftover gradients of an earlier backward (a parameter no optimizer clears)
        and have taken no part in this loss."""
        loss.backward()
        if self.frozen:
            self._refuse_unfrozen(engine)
        reached: set[int] | None = None
        for ref, params in list(self.watched.values()):  # a freed model's finalizer may pop
            wrapped = ref()
            if wrapped is None or not wrapped.require_backward_grad_sync:
                continue  # inside no_sync: nothing is reduced yet
            if ddp_reduction_finished(wrapped):
                continue  # every gradient a backward began is reduced: none is missing
            missing = trainable = 0
            for _, p in params:
                if p.requires_grad:
                    trainable += 1
                    missing += p.grad is None
            if missing == 0 or missing == trainable:
                continue  # every gradient is there, or none: this loss is another model's
            if reached is None:
                reached = graph_leaves(loss)
            if not any(id(p) in reached for _, p in params):
                continue  # leftover gradients of an earlier backward: not this loss's model
            unused = [name for name, p in params if p.grad is None and p.requires_grad]
            if unused:
                raise ConfigurationError(
                    f"DDP on rank {engine.rank}: {len(unused)} parameter(s) took no part in this "
                    f"step's loss ({some_of(unused)}), and DDP cannot average a gradient a "
                    f"rank did not produce. Pass Engine('{engine.strategy}', "
                    f"find_unused_parameters=True) (torchplug launch --option "
                    f"find_unused_parameters=true), or set requires_grad=False on parameters "
                    f"that are never used. (Ranks use different parameters in a mixture of "
                    f"experts or a branch some ranks take; a layer no forward uses does the same.)"
                )
        return True

    def _refuse_unfrozen(self, engine: HookContext) -> None:
        """A model set up frozen is not DDP's: gradients it gets later are not averaged."""
        for ref, params in list(self.frozen.values()):
            model = ref()
            trained = [name for name, p in params if p.grad is not None] if model else []
            if trained:
                raise ConfigurationError(
                    f"DDP on rank {engine.rank}: a {type(model).__name__} set up with no "
                    f"trainable parameter now has gradients ({some_of(trained)}). It was left "
                    f"unwrapped (nothing to synchronise then), so its gradients would not be "
                    f"averaged across ranks and the ranks' copies would drift apart. Unfreeze it "
                    f"before engine.setup(model, optimizer), or set the plain model up again "
                    f"after unfreezing."
                )

    @hookimpl
    def torchplug_no_sync(
        self, engine: HookContext, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[None]:
        """The default answer to [`torchplug_no_sync`][torchplug_no_sync]
        (see the hook reference)."""
        no_sync = getattr(model, "no_sync", None)
        if no_sync is None:
            raise ConfigurationError(
                f"no_sync() needs the model returned by engine.setup(), got a "
                f"{type(model).__name__}. Pass the wrapped model."
            )
        return no_sync()


def graph_leaves(loss: torch.Tensor) -> set[int]:
    """The ids of the leaf tensors (parameters) whose gradients ``loss``'s graph accumulates.
    The graph's nodes outlive ``backward`` as long as ``loss`` holds them."""
    leaves: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return leaves


def ddp_memory(query: MemoryQuery) -> MemoryEstimate:
    """`replicated`, plus DDP's gradient buckets (inside its C++ reducer, not counted)."""
    estimate = replicated(query)
    note = (
        "DDP's reducer also keeps gradient buckets of the gradients' size (not counted; "
        "gradient_as_bucket_view=True makes the gradients views into them)"
    )
    if query.options.get("gradient_as_bucket_view"):
        note = "gradients are views into DDP's buckets (gradient_as_bucket_view=True)"
    return MemoryEstimate(estimate.params, estimate.grads, estimate.optimizer, notes=(note,))


@hookimpl
def torchplug_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(
        StrategyInfo(
            name="ddp",
            aliases=("distributed-data-parallel",),
            factory=DDPStrategy,
            description="torch DistributedDataParallel: full replicas, gradients all-reduced.",
            options=(*DistributedStrategy.strategy_options(), *DDP_OPTIONS),
            memory=ddp_memory,
            # ranks that use different parameters: right with find_unused_parameters=True,
            # else refused before the optimizer steps, naming the option
            refuses=("rank_dependent",),
        )
    )
