"""``ddp``: torch DistributedDataParallel. gloo on CPU, nccl on CUDA, device from LOCAL_RANK."""

from __future__ import annotations

import contextlib
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
    hookimpl,
    positive_number,
    replicated,
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

    @hookimpl
    def torchplug_wrap(
        self, engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        """The default answer to [`torchplug_wrap`][torchplug_wrap] (see the hook reference)."""
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(engine.device)
        device_ids = [engine.device.index] if engine.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs), optimizers

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
        )
    )
