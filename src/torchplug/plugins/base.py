"""Base classes for backends: `Strategy` (``super()`` reaches the default answers) and
`DistributedStrategy` (setup and teardown of a torch.distributed process group).

The default answers themselves are a plugin, ``torch_distributed``
(`torchplug.plugins.torch_distributed`),
so a backend need not inherit anything; these classes are conveniences for the common case.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from torchplug.plugin import (
    DEFAULT_TIMEOUT,
    ClusterInfo,
    ConfigurationError,
    HookContext,
    Option,
    Runtime,
    did_you_mean,
    free_port,
    hookimpl,
    positive_number,
    rebind_optimizer,  # noqa: F401 - the name API 1.x backends imported from here
)
from torchplug.plugins import torch_distributed as defaults

#: The reduce ops ``engine.reduce`` accepts (kept here for API 1.x importers).
REDUCE_OPS = defaults.REDUCE_OPS


def _inherited(method: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a `Strategy` method as the base's delegate: a subclass that does not override it
    does not answer the hook (the ``torch_distributed`` plugin does); ``super()`` still works."""
    method.torchplug_inherited_default = True  # type: ignore[attr-defined]
    return method


class Strategy:
    """A base class for backends: ``super()`` calls reach torchplug's default answers.

    The defaults themselves are the built-in plugin ``torch_distributed``
    (`torchplug.plugins.torch_distributed`), in every Engine's active set and marked ``trylast``; a
    backend
    answers only what it changes, and need not subclass this at all. What a subclass inherits
    from here is not registered as its answer (the plugin answers instead), so blocking the
    plugin leaves those hooks unanswered, and the Engine says which.
    """

    @_inherited
    def torchplug_wrap(
        self, engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        """Calls the default answer, `torchplug.plugins.torch_distributed.torchplug_wrap`."""
        return defaults.torchplug_wrap(engine, model, optimizers)

    @_inherited
    def torchplug_place_batch(self, engine: HookContext, batch: Any) -> Any:
        """Calls the default answer, `torchplug.plugins.torch_distributed.torchplug_place_batch`."""
        return defaults.torchplug_place_batch(engine, batch)

    @_inherited
    def torchplug_backward(
        self, engine: HookContext, loss: torch.Tensor, model: torch.nn.Module | None
    ) -> bool:
        """Calls the default answer, `torchplug.plugins.torch_distributed.torchplug_backward`."""
        return defaults.torchplug_backward(engine, loss, model)

    @_inherited
    def torchplug_optimizer_step(
        self,
        engine: HookContext,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any] | None,
    ) -> bool:
        """Calls the default answer,
        `torchplug.plugins.torch_distributed.torchplug_optimizer_step`."""
        return defaults.torchplug_optimizer_step(engine, optimizer, closure)

    @_inherited
    def torchplug_clip_grad_norm(
        self,
        engine: HookContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        norm_type: float,
    ) -> torch.Tensor:
        """Calls the default answer,
        `torchplug.plugins.torch_distributed.torchplug_clip_grad_norm`."""
        return defaults.torchplug_clip_grad_norm(engine, model, optimizer, max_norm, norm_type)

    @_inherited
    def torchplug_no_sync(
        self, engine: HookContext, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[None]:
        """Calls the default answer, `torchplug.plugins.torch_distributed.torchplug_no_sync`."""
        return defaults.torchplug_no_sync(engine, model)

    @_inherited
    def torchplug_autocast(self, engine: HookContext) -> contextlib.AbstractContextManager[None]:
        """Calls the default answer, `torchplug.plugins.torch_distributed.torchplug_autocast`."""
        return defaults.torchplug_autocast(engine)

    @_inherited
    def torchplug_reduce(self, engine: HookContext, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Calls the default answer, `torchplug.plugins.torch_distributed.torchplug_reduce`."""
        return defaults.torchplug_reduce(engine, tensor, op)

    @_inherited
    def torchplug_gather(self, engine: HookContext, tensor: torch.Tensor) -> torch.Tensor:
        """Calls the default answer, `torchplug.plugins.torch_distributed.torchplug_gather`."""
        return defaults.torchplug_gather(engine, tensor)

    @_inherited
    def torchplug_barrier(self, engine: HookContext) -> bool:
        """Calls the default answer, `torchplug.plugins.torch_distributed.torchplug_barrier`."""
        return defaults.torchplug_barrier(engine)

    @_inherited
    def torchplug_broadcast(
        self, engine: HookContext, tensor: torch.Tensor, src: int
    ) -> torch.Tensor:
        """Calls the default answer, `torchplug.plugins.torch_distributed.torchplug_broadcast`."""
        return defaults.torchplug_broadcast(engine, tensor, src)

    @_inherited
    def torchplug_reads_in_place(self, engine: HookContext, kind: str) -> bool:
        """Calls the default answer,
        `torchplug.plugins.torch_distributed.torchplug_reads_in_place`."""
        return defaults.torchplug_reads_in_place(engine, kind)

    @_inherited
    def torchplug_model_state(self, engine: HookContext, model: torch.nn.Module) -> dict[str, Any]:
        """Calls the default answer, `torchplug.plugins.torch_distributed.torchplug_model_state`."""
        return defaults.torchplug_model_state(engine, model)

    @_inherited
    def torchplug_load_model_state(
        self, engine: HookContext, model: torch.nn.Module, state: dict[str, Any], strict: bool
    ) -> bool:
        """Calls the default answer,
        `torchplug.plugins.torch_distributed.torchplug_load_model_state`."""
        return defaults.torchplug_load_model_state(engine, model, state, strict)

    @_inherited
    def torchplug_optimizer_state(
        self, engine: HookContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Calls the default answer,
        `torchplug.plugins.torch_distributed.torchplug_optimizer_state`."""
        return defaults.torchplug_optimizer_state(engine, model, optimizer)

    @_inherited
    def torchplug_load_optimizer_state(
        self,
        engine: HookContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
    ) -> bool:
        """Calls the default answer,
        `torchplug.plugins.torch_distributed.torchplug_load_optimizer_state`."""
        return defaults.torchplug_load_optimizer_state(engine, model, optimizer, state)


def default_device(local_rank: int = 0) -> torch.device:
    """The accelerator for this local rank if there is one, else the CPU.

    Args:
        local_rank: This process's rank on its node.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


#: The longest collective timeout accepted: one year (torch overflows far above it).
MAX_TIMEOUT = 365 * 24 * 3600.0


def check_process_group_backend(value: str | None) -> str | None:
    """Why ``value`` is not a torch.distributed backend usable here, or ``None``.

    Accepts a backend name (``gloo``) or the per-device form ``cpu:gloo,cuda:nccl``.
    """
    if value is None:
        return None
    known = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    names = [part.split(":", 1)[-1].strip().lower() for part in value.split(",")]
    for name in names:
        if name not in known:
            return (
                f"names an unknown torch.distributed backend {name!r}; expected one of "
                f"{', '.join(known)} (or None: nccl on CUDA, gloo on CPU)"
                f"{did_you_mean(name, known)}"
            )
        available = getattr(dist, f"is_{name}_available", None)
        if available is not None and not available():
            return (
                f"asks for backend {name!r}, which this torch build does not have; expected a "
                f"backend it has ({', '.join(b for b in known if _has_backend(b)) or 'none'})"
            )
    return None


def _has_backend(name: str) -> bool:
    available = getattr(dist, f"is_{name}_available", None)
    return bool(available()) if available is not None else True


def distributed_options() -> tuple[Option, ...]:
    """Deprecated since API 1.0: declare ``StrategyInfo(extends="ddp")`` (a subclass of
    [`DDPStrategy`][torchplug.plugin.DDPStrategy]) or ``StrategyInfo(extends=DistributedStrategy)``
    (a backend of its own on a process group) instead, which inherit these options; this keeps
    working through API 1.x with a ``DeprecationWarning``.

    The options of every [`DistributedStrategy`][torchplug.plugin.DistributedStrategy], for its
    StrategyInfo."""
    warnings.warn(
        'distributed_options() is deprecated: declare StrategyInfo(extends="ddp") or '
        "StrategyInfo(extends=DistributedStrategy) to inherit the options instead; "
        "distributed_options() keeps working through API 1.x",
        DeprecationWarning,
        stacklevel=2,
    )
    return _distributed_options()


def _distributed_options() -> tuple[Option, ...]:
    """The options of every DistributedStrategy (torchplug's own strategies use this name; the
    public one is deprecated)."""
    return (
        Option(
            "process_group_backend",
            (str, type(None)),
            None,
            "torch.distributed backend; default nccl on CUDA, gloo on CPU",
            validate=check_process_group_backend,
        ),
        Option(
            "timeout",
            float,
            DEFAULT_TIMEOUT,
            "seconds before a collective gives up",
            validate=positive_number("seconds", MAX_TIMEOUT),
        ),
    )


class DistributedStrategy(Strategy):
    """A backend on a torch.distributed process group: created here unless one exists.

    Args:
        process_group_backend: The torch.distributed backend (``None``: nccl on CUDA, gloo on CPU).
        timeout: Seconds before a collective gives up.
    """

    def __init__(
        self, process_group_backend: str | None = None, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        self.owns_process_group = False

    @classmethod
    def strategy_options(cls) -> tuple[Option, ...]:
        """The options this class's constructor takes (``process_group_backend``, ``timeout``),
        which ``StrategyInfo(extends=DistributedStrategy)`` inherits."""
        return _distributed_options()

    @hookimpl
    def torchplug_setup(self, engine: HookContext, cluster: ClusterInfo) -> Runtime:
        """The default answer to [`torchplug_setup`][torchplug_setup] (see the hook reference)."""
        device = default_device(cluster.local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            port = cluster.master_port
            if port is None:
                if cluster.world_size > 1:
                    raise ConfigurationError(
                        f"Strategy '{engine.strategy}' with world size {cluster.world_size} "
                        f"needs MASTER_PORT (and MASTER_ADDR). Start the script with "
                        f"`torchplug launch` or torchrun, which set them."
                    )
                port = free_port()  # a world of one, e.g. in a notebook
            _check_address(cluster)  # a bad name fails now, not after the collective timeout
            timeout = datetime.timedelta(seconds=self.timeout)
            with _said_while_waiting(cluster, port, self.timeout):
                dist.init_process_group(
                    backend=self.process_group_backend
                    or ("nccl" if device.type == "cuda" else "gloo"),
                    rank=cluster.rank,
                    world_size=cluster.world_size,
                    timeout=timeout,
                    store=_group_store(cluster.master_addr, port, cluster, timeout),
                )
            self.owns_process_group = True
            atexit.register(self._release_at_exit)
        return Runtime(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=cluster.local_rank,
            device=device,
            node_rank=cluster.node_rank,
        )

    @hookimpl
    def torchplug_teardown(self, engine: HookContext) -> None:
        """The default answer to [`torchplug_teardown`][torchplug_teardown]
        (see the hook reference)."""
        self._release(failing=engine.failing)

    def _release(self, failing: bool = False) -> None:
        """Destroy the process group this strategy created (at close, or at interpreter exit)."""
        atexit.unregister(self._release_at_exit)
        if self.owns_process_group and dist.is_initialized():
            # The process group's C++ destructor runs later, when the wrapped module is freed,
            # and joins gloo's worker threads while holding the GIL. A worker still releasing the
            # last collective's work needs the GIL too: a deadlock (seen with torch 2.13). So:
            # the barrier keeps rank 0's store up until every rank is done, and the sleep gives
            # up the GIL long enough for the workers to drop their finished work. Leaving on an
            # exception, the other ranks may be inside a collective that never completes: no
            # barrier then, or this rank would wait for the whole timeout.
            if not failing:
                dist.barrier()
            dist.destroy_process_group()
            time.sleep(0.05)
        self.owns_process_group = False

    def _release_at_exit(self) -> None:
        """atexit: a script that never calls close() still destroys its process group, before
        the interpreter tears down gloo's threads (which aborts: 'terminate called ...'). An
        uncaught exception ending the interpreter (``sys.last_value``) means no barrier."""
        self._release(failing=getattr(sys, "last_value", None) is not None)


#: Cluster environments whose rendezvous host name may appear after the process starts (a
#: PyTorchJob's master service): their name is waited for, up to this many seconds, not refused.
LATE_NAMES = {"Kubeflow PyTorchJob": 300.0}


def _check_address(cluster: ClusterInfo) -> None:
    """The rendezvous address resolves: a leftover or mistyped ``MASTER_ADDR`` would otherwise
    wait for the whole timeout (30 minutes by default) without a word."""
    deadline = time.monotonic() + LATE_NAMES.get(cluster.source, 0.0)
    said = False
    while True:
        try:
            socket.getaddrinfo(cluster.master_addr, None)
            return
        except OSError as exc:
            if time.monotonic() < deadline:
                if not said:
                    print(
                        f"torchplug: MASTER_ADDR={cluster.master_addr!r} ({cluster.source}) "
                        f"does not resolve yet; waiting for it.",
                        file=sys.stderr,
                    )
                    said = True
                time.sleep(1.0)
                continue
            raise ConfigurationError(
                f"MASTER_ADDR={cluster.master_addr!r} (as {cluster.source} gave it) does not "
                f"resolve: {exc.strerror or exc}. Set MASTER_ADDR to the host of rank 0 (e.g. "
                f"the first of `scontrol show hostnames`), or unset it and start the script "
                f"with `torchplug launch`, which sets it."
            ) from None


#: Seconds a rank waits for the rendezvous before it says what it waits for (once).
RENDEZVOUS_NOTICE = 30.0


@contextlib.contextmanager
def _said_while_waiting(cluster: ClusterInfo, port: int, timeout: float) -> Iterator[None]:
    """Inside, a rendezvous that takes longer than `RENDEZVOUS_NOTICE` prints one line naming
    the address it waits at and where each value came from: a leftover ``MASTER_ADDR`` or a
    rank 0 that never started would otherwise wait for the whole timeout without a word."""
    names = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    given = ", ".join(f"{name}={os.environ[name]}" for name in names if name in os.environ)
    line = (
        f"torchplug: rank {cluster.rank} of {cluster.world_size} has waited "
        f"{RENDEZVOUS_NOTICE:.0f} s for the other ranks at {cluster.master_addr}:{port} (from "
        f"{cluster.source}; in this environment: {given or 'none of ' + ', '.join(names)}); it "
        f"gives up after {timeout:.0f} s. If rank 0 is not starting, check these values: a "
        f"variable left over in the shell is a common cause."
    )
    notice = threading.Timer(RENDEZVOUS_NOTICE, lambda: print(line, file=sys.stderr, flush=True))
    notice.daemon = True
    notice.start()
    try:
        yield
    finally:
        notice.cancel()


def _group_store(
    host: str, port: int, cluster: ClusterInfo, timeout: datetime.timedelta
) -> dist.Store:
    """The rendezvous store of a new process group: a prefix of its own (per restart attempt
    and per group) on the job's store.

    That store outlives a group: torchrun's agent keeps one across restarts (``--max-restarts``),
    and a ``tcp://`` store is shared by every client of its port in a process (torch's
    multi-tenant TCPStore), so the Engines one process makes one after another (a notebook, a
    sweep, a test suite; under srun and mpirun as under torchrun) meet the keys the earlier
    groups left. Without a prefix of its own a group's ranks read those, connect to addresses
    long gone and wait until the timeout. Every rank makes its Engines in the same order, so
    the counts agree.
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host,
        port,
        cluster.world_size,
        is_master=cluster.rank == 0 and not agent,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"torchplug/attempt-{attempt}/group-{next(_GROUPS)}/", store)


#: Process groups this process has made (`_group_store`'s prefix).
_GROUPS = itertools.count()
