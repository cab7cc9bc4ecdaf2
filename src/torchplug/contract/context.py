"""`HookContext`: what a hook may read and call, instead of the user-facing Engine.

Every strategy hook receives it as its ``engine`` argument (the name API 1.0 plugins accept):
what a backend needs and nothing a user's script is for, built from the objects that own the
Engine's state, so the specification never depends on the Engine. Through API 1.x any other
name still reaches the Engine, with a warning naming the member (`torchplug._deprecated`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchplug.util.records import Record

if TYPE_CHECKING:
    from torchplug.contract.hooks import Hooks
    from torchplug.contract.types import ClusterInfo, Runtime


@dataclass(eq=False, repr=False)
class Selection(Record):
    """What an Engine decided when it was made, as its hooks read it (owned by the Engine;
    `runtime` is set once the backend's ``torchplug_setup`` answered).

    Args:
        strategy: The strategy's canonical name.
        backend: The object holding the strategy's hooks.
        precision: ``"32"``, ``"bf16"`` or ``"fp16"``.
        precision_options: The precision plugin's resolved options.
        options: The strategy's resolved options.
        settings: Every setting with where it came from.
        cluster: Who this process is in its job.
        checkpoint_key: The key checkpoints are signed with (``None``: none).
        collective_timeout: Seconds a collective waits for the other ranks.
        checkpoint_timeout: Seconds a save or load waits for every rank.
        runtime: Where this process runs, once the backend's setup answered.
    """

    strategy: str
    backend: object
    precision: str
    precision_options: dict[str, Any]
    options: dict[str, Any]
    settings: Any
    cluster: ClusterInfo
    checkpoint_key: Any
    collective_timeout: float
    checkpoint_timeout: float
    runtime: Runtime | None = None


def _read(owner: str, name: str, doc: str) -> property:
    """A read-only property answering ``self.<owner>.<name>``."""
    return property(lambda self: getattr(getattr(self, owner), name), doc=doc)


class RuntimeFacts:
    """Who and where this process is, read from ``runtime`` (what the backend's
    ``torchplug_setup`` answered): the user's Engine and a hook's context answer alike."""

    __slots__ = ()
    runtime: Runtime

    rank = _read("runtime", "rank", "This process's rank, 0 to ``world_size - 1``.")
    local_rank = _read("runtime", "local_rank", "This process's index on its node.")
    node_rank = _read("runtime", "node_rank", "This node's index.")
    world_size = _read("runtime", "world_size", "How many processes run the job.")
    device = _read("runtime", "device", "The device this process computes on.")
    mesh = _read(
        "runtime",
        "mesh",
        "The job's device mesh (a ``torch.distributed.device_mesh.DeviceMesh``) as the "
        "backend's setup built it, shared by every model the job sets up; ``None`` for "
        "backends without one (``single``, ``ddp``).",
    )

    @property
    def data_parallel_rank(self) -> int:
        """Which share of the data this rank trains on (its rank, unless model parallelism
        makes several ranks share one replica)."""
        value = self.runtime.data_parallel_rank
        return self.runtime.rank if value is None else value

    @property
    def data_parallel_size(self) -> int:
        """How many shares the data is split into (``world_size`` unless model parallel)."""
        value = self.runtime.data_parallel_size
        return self.runtime.world_size if value is None else value

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0."""
        return self.runtime.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Whether this is the first process on its node (local rank 0)."""
        return self.runtime.local_rank == 0


class HookContext(RuntimeFacts):
    """What a hook may read and call: passed to every strategy hook as ``engine``: runtime
    facts, the selection, the collectives, the typed `hooks`, the user's objects set up so far
    and the calls a backend makes on them. Built from the owners of the Engine's state, never
    the Engine itself (API 1.x's fall-through to it goes through a weak reference).

    Args:
        selection: The Engine's selection and, after setup, its runtime.
        collectives: Answers ``reduce``, ``gather``, ``barrier`` and ``broadcast_object``.
        backend: Owns what a backend changes on the user's objects (``restore_on_close``,
            ``skipping_updates``, ...), the optimizers set up, ``accumulating`` and ``failing``.
        hooks: The Engine's typed façade (offered as `hooks`).
        api1: API 1.x's fall-through to the Engine: ``get(name)`` and ``set(name, value)``
            (``None``: none), `torchplug._deprecated.EngineFallThrough`.
    """

    __slots__ = ("_api1", "_backend", "_collectives", "_hooks_of", "_selection")

    def __init__(
        self,
        selection: Selection,
        *,
        collectives: Any,
        backend: Any,
        hooks: Hooks,
        api1: Any = None,
    ) -> None:
        object.__setattr__(self, "_selection", selection)
        object.__setattr__(self, "_collectives", collectives)
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "_hooks_of", hooks)
        object.__setattr__(self, "_api1", api1)

    def __repr__(self) -> str:
        return f"HookContext(strategy={self._selection.strategy!r})"

    # -- runtime facts ----------------------------------------------------------------------------

    @property
    def runtime(self) -> Runtime:
        """Where this process runs, as the backend's ``torchplug_setup`` answered."""
        runtime = self._selection.runtime
        if runtime is None:
            raise AttributeError(
                "the runtime (rank, device, ...) is what torchplug_setup answers: it is not "
                "known inside that hook; read the `cluster` argument there instead"
            )
        return runtime

    @property
    def failing(self) -> bool:
        return self._backend.failing

    # -- the selection and its settings -----------------------------------------------------------

    strategy = _read("_selection", "strategy", "The selected strategy's canonical name.")
    cluster = _read("_selection", "cluster", "Who this process is in its job.")
    backend = _read("_selection", "backend", "The object holding the strategy's hooks.")
    precision = _read("_selection", "precision", '``"32"``, ``"bf16"`` or ``"fp16"``.')
    precision_options = _read("_selection", "precision_options", "The precision's options.")
    options = _read("_selection", "options", "The strategy's resolved options, by name.")
    settings = _read("_selection", "settings", "Every setting with where it came from.")
    collective_timeout = _read("_selection", "collective_timeout", "Seconds a collective waits.")
    checkpoint_timeout = _read("_selection", "checkpoint_timeout", "Seconds a save or load waits.")
    checkpoint_key = _read("_selection", "checkpoint_key", "The signing key (``None``: none).")

    # -- the active set and the collectives -------------------------------------------------------

    @property
    def hook(self) -> Any:
        """Deprecated since API 1.2 (pluggy's raw relay, answers unchecked): use `hooks`."""
        warnings.warn(
            "engine.hook in a hook is pluggy's raw relay (answers unchecked); call the typed "
            "engine.hooks instead (e.g. engine.hooks.model_state(model)). engine.hook keeps "
            "working through plugin API 1.x.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.hooks.relay

    @property
    def hooks(self) -> Hooks:
        """The active set's typed façade (`torchplug.contract.hooks.Hooks`): one method per hook,
        its answer checked; how torchplug's own checkpoint plugin calls the state protocol."""
        return self._hooks_of

    def reduce(self, tensor: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        """[`Engine.reduce`][torchplug.Engine.reduce], through the active set's reduce hook.

        Args:
            tensor: This rank's tensor (or number).
            op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        """
        return self._collectives.reduce(tensor, op)

    def gather(self, tensor: torch.Tensor | float) -> torch.Tensor:
        """[`Engine.gather`][torchplug.Engine.gather].

        Args:
            tensor: This rank's tensor (or number), the same shape on every rank.
        """
        return self._collectives.gather(tensor)

    def barrier(self) -> None:
        """[`Engine.barrier`][torchplug.Engine.barrier]."""
        self._collectives.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """[`Engine.broadcast_object`][torchplug.Engine.broadcast_object].

        Args:
            obj: A JSON value on rank ``src`` (ignored elsewhere).
            src: The rank whose value every rank gets.
        """
        return self._collectives.broadcast_object(obj, src)

    # -- the user's objects -----------------------------------------------------------------------

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self._backend.optimizers)

    def model_of(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> Any:
        """The (wrapped) model whose parameters ``optimizer`` updates (else CheckpointError).

        Args:
            optimizer: An optimizer returned by setup.
            state: A checkpoint state dict, searched for the model when needed.
        """
        return self._backend.model_of(optimizer, state)

    @property
    def accumulating(self) -> tuple[int, bool] | None:
        return self._backend.accumulating

    def restore_on_close(self, obj: Any, name: str) -> None:
        """Remember ``obj.name`` as it is now; the Engine's ``close()`` puts it back (what setup
        patches on user objects is undone, so a model pickles again after close).

        Args:
            obj: The object a hook patches (a user's model or optimizer).
            name: The attribute about to be set (or added) on it.
        """
        self._backend.restore_on_close(obj, name)

    def real_optimizer_steps(self) -> contextlib.AbstractContextManager[None]:
        """Inside, ``optimizer.step()`` bypasses the hook (zero steps that create state)."""
        return self._backend.real_optimizer_steps()

    def skipping_updates(
        self, optimizer: torch.optim.Optimizer, skip: bool = True
    ) -> contextlib.AbstractContextManager[None]:
        """Inside, with ``skip``, the optimizer's real step does nothing (the backend's step
        around it still runs): how a wrapper skips an update without replacing the backend.

        Args:
            optimizer: The optimizer whose update to skip (or not).
            skip: Whether to skip it inside the block.
        """
        return self._backend.skipping_updates(optimizer, skip)

    def native_state_dicts(self) -> contextlib.AbstractContextManager[None]:
        """Inside, modules returned by ``engine.setup`` answer ``state_dict()`` with the
        backend's own names (``module.<name>``): what the state hooks and torch's DCP state-dict
        API expect from the wrapper."""
        return self._backend.native_state_dicts()

    def full_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> dict[str, Any]:
        """[`Engine.full_state`][torchplug.Engine.full_state].

        Args:
            model: A model this Engine set up.
            optimizer: Its optimizer, whose state is included when given.
        """
        return self._backend.full_state(model, optimizer)

    def checkpoint_header(self, state: dict[str, Any]) -> dict[str, Any]:
        """What the manifest records about this run, besides the entries themselves.

        Args:
            state: The state being saved.
        """
        return self._backend.checkpoint_header(state)

    # -- API 1.x: the rest of the Engine, with a warning ------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if self._api1 is None:
            raise AttributeError(f"'HookContext' object has no attribute {name!r}")
        return self._api1.get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if self._api1 is None:
            raise AttributeError(f"'HookContext' object attribute {name!r} is read-only")
        self._api1.set(name, value)


def iter_members() -> Iterator[str]:
    """The context's public members, as the class defines them (for the tests and docs)."""
    names = [*vars(RuntimeFacts), *vars(HookContext)]
    return (name for name in dict.fromkeys(names) if not name.startswith("_"))
