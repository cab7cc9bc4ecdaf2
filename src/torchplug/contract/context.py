"""`HookContext`: what a hook may read and call, instead of the user-facing Engine.

Every strategy hook receives it as its ``engine`` argument (the name plugins written against API
1.0 already accept). It answers what a backend needs and nothing a user's script is for: the
runtime facts (rank, device, the job's mesh), the selection (strategy, precision, options), the
one collective timeout, the collectives, the active set's hooks (the state protocol), and the few
calls a backend makes on the user's objects (`restore_on_close`, `real_optimizer_steps`,
`skipping_updates`). Authors no longer have to guess which of the Engine's 40-odd members they may
touch (issue 26), and the specification no longer depends on the Engine's type.

Through API 1.x, reading anything else still reaches the Engine, with a `HookContextWarning`
(a ``DeprecationWarning``) that names the member, so a plugin that followed the old docs keeps
working and learns what to change.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torchplug.contract.hooks import Hooks
    from torchplug.contract.types import ClusterInfo, Runtime, Settings


class HookContextWarning(DeprecationWarning):
    """A hook read an Engine member that the
    [`HookContext`][torchplug.plugin.HookContext] does not offer."""


# Python hides DeprecationWarnings raised outside __main__, and a hook never runs in __main__:
# without this filter an author would not see it under torchplug launch or torchplug check.
# Only when the user chose no warning filter (-W, PYTHONWARNINGS): then theirs decides, so
# `-W error` makes it an error and `PYTHONWARNINGS=ignore::DeprecationWarning` hides it.
if not sys.warnoptions:
    warnings.filterwarnings("default", category=HookContextWarning)


class HookContext:
    """What a hook may read and call: passed to every strategy hook as ``engine``.

    Runtime facts (``rank``, ``world_size``, ``local_rank``, ``node_rank``, ``device``,
    ``is_main``, ``is_local_main``, ``data_parallel_rank``/``size``, ``mesh``, ``runtime``, and
    ``cluster``, which ``torchplug_setup`` decides from), the selection (``strategy``, ``backend``,
    ``precision``, ``precision_options``, ``options``, ``settings``), ``failing`` (the run is
    leaving on an error: skip collectives at teardown), ``collective_timeout`` and
    ``checkpoint_timeout`` (the one setting each), ``checkpoint_key``, the collectives
    (``reduce``, ``gather``, ``barrier``, ``broadcast_object``), ``hooks`` (the active set's
    typed hooks: call the state protocol through them; ``hook``, pluggy's raw relay, is
    deprecated since API 1.2), the user
    objects set up so far (``optimizers``,
    ``model_of``, ``accumulating``) and the calls a backend makes on them (``restore_on_close``,
    ``real_optimizer_steps``, ``skipping_updates``, ``native_state_dicts``, ``full_state``,
    ``checkpoint_header``). The calls on the user's objects are the backend's own (owned by the
    Engine's ``BackendState``, documented here); the rest is the Engine member of the same name,
    whose docs say what it does.

    Args:
        engine: The Engine it answers for (torchplug makes the context; a plugin never does).
        hooks: Returns the Engine's typed façade (`hooks`), which is made after the context.
        backend: Owns what a backend changes on the user's objects (`restore_on_close`,
            `skipping_updates`, ...); the Engine itself when not given.
    """

    __slots__ = ("_backend", "_engine", "_hooks_of")

    def __init__(
        self, engine: Any, hooks: Callable[[], Any] | None = None, backend: Any = None
    ) -> None:
        object.__setattr__(self, "_engine", engine)
        # the owner of what a backend changes on the user's objects (the Engine's BackendState)
        object.__setattr__(self, "_backend", backend if backend is not None else engine)
        # the Engine's typed façade, handed over by its owner (made after this context, which
        # it is built with)
        object.__setattr__(self, "_hooks_of", hooks)

    def __repr__(self) -> str:
        return f"HookContext(strategy={self._engine.strategy!r})"

    # -- runtime facts ----------------------------------------------------------------------------

    @property
    def strategy(self) -> str:
        return self._engine.strategy

    @property
    def rank(self) -> int:
        return self._engine.rank

    @property
    def world_size(self) -> int:
        return self._engine.world_size

    @property
    def local_rank(self) -> int:
        return self._engine.local_rank

    @property
    def node_rank(self) -> int:
        return self._engine.node_rank

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def is_main(self) -> bool:
        return self._engine.is_main

    @property
    def is_local_main(self) -> bool:
        return self._engine.is_local_main

    @property
    def data_parallel_rank(self) -> int:
        return self._engine.data_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        return self._engine.data_parallel_size

    @property
    def mesh(self) -> Any:
        return self._engine.mesh

    @property
    def runtime(self) -> Runtime:
        return self._engine.runtime

    @property
    def cluster(self) -> ClusterInfo:
        return self._engine.cluster

    @property
    def failing(self) -> bool:
        return self._engine.failing

    @property
    def backend(self) -> object:
        return self._engine.backend

    # -- the selection and its settings -----------------------------------------------------------

    @property
    def precision(self) -> str:
        return self._engine.precision

    @property
    def precision_options(self) -> dict[str, Any]:
        return self._engine.precision_options

    @property
    def options(self) -> dict[str, Any]:
        return self._engine.options

    @property
    def settings(self) -> Settings:
        return self._engine.settings

    @property
    def collective_timeout(self) -> float:
        return self._engine.collective_timeout

    @property
    def checkpoint_timeout(self) -> float:
        return self._engine.checkpoint_timeout

    @property
    def checkpoint_key(self) -> Any:
        return self._engine.checkpoint_key

    # -- the active set and the collectives -------------------------------------------------------

    @property
    def hook(self) -> Any:
        """Deprecated for plugins since API 1.2: pluggy's raw relay, whose answers nobody
        checks; call the typed `hooks` instead (``engine.hooks.model_state(model)``). It keeps
        working through API 1.x, with a DeprecationWarning."""
        warnings.warn(
            "engine.hook in a hook is pluggy's raw relay (answers unchecked); call the typed "
            "engine.hooks instead (e.g. engine.hooks.model_state(model)). engine.hook keeps "
            "working through plugin API 1.x.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._engine.hook

    @property
    def hooks(self) -> Hooks:
        """The active set's typed façade (`torchplug.contract.hooks.Hooks`): one method per hook,
        its answer checked; how torchplug's own checkpoint plugin calls the state protocol."""
        if self._hooks_of is None:
            raise AttributeError("this HookContext was made without its Engine's hooks")
        return self._hooks_of()

    def reduce(self, tensor: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        """[`Engine.reduce`][torchplug.Engine.reduce], through the active set's reduce hook.

        Args:
            tensor: This rank's tensor (or number).
            op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        """
        return self._engine.reduce(tensor, op)

    def gather(self, tensor: torch.Tensor | float) -> torch.Tensor:
        """[`Engine.gather`][torchplug.Engine.gather].

        Args:
            tensor: This rank's tensor (or number), the same shape on every rank.
        """
        return self._engine.gather(tensor)

    def barrier(self) -> None:
        """[`Engine.barrier`][torchplug.Engine.barrier]."""
        self._engine.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """[`Engine.broadcast_object`][torchplug.Engine.broadcast_object].

        Args:
            obj: A JSON value on rank ``src`` (ignored elsewhere).
            src: The rank whose value every rank gets.
        """
        return self._engine.broadcast_object(obj, src)

    # -- the user's objects -----------------------------------------------------------------------

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._engine.optimizers

    def model_of(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> Any:
        """The (wrapped) model whose parameters ``optimizer`` updates.

        Args:
            optimizer: An optimizer returned by setup.
            state: A checkpoint state dict, searched for the model when needed.

        Raises:
            CheckpointError: No model is known for ``optimizer``.
        """
        return self._backend.model_of(optimizer, state)

    @property
    def accumulating(self) -> tuple[int, bool] | None:
        return self._engine.accumulating

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
        return self._engine.full_state(model, optimizer)

    def checkpoint_header(self, state: dict[str, Any]) -> dict[str, Any]:
        """What the manifest records about this run, besides the entries themselves.

        Args:
            state: The state being saved.
        """
        return self._backend.checkpoint_header(state)

    # -- API 1.x: the rest of the Engine, with a warning ------------------------------------------

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._engine, name)  # an unknown name raises AttributeError as before
        if not name.startswith("__"):
            warnings.warn(
                f"engine.{name} in a hook: the hook's `engine` argument is a "
                f"torchplug.plugin.HookContext, which does not offer '{name}' (it lists what a "
                f"backend may read and call). It reaches the Engine through API 1.x; use a "
                f"HookContext member, or keep what you need from the setup hook.",
                HookContextWarning,
                stacklevel=2,
            )
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        warnings.warn(
            f"engine.{name} = ... in a hook: the hook's `engine` argument is a "
            f"torchplug.plugin.HookContext; keep your state on your plugin object instead. "
            f"It is set on the Engine through API 1.x.",
            HookContextWarning,
            stacklevel=2,
        )
        setattr(self._engine, name, value)


def iter_members() -> Iterator[str]:
    """The context's public members, as the class defines them (for the tests and docs)."""
    return (name for name in vars(HookContext) if not name.startswith("_"))
