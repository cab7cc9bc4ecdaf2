"""The torchplug hook specification.

Every extension point of torchplug is a pluggy hook defined in this module; a plugin is any module,
class or object with functions named like these hooks and marked with
[`hookimpl`][torchplug.plugin.hookimpl]. There are two kinds of hooks.

**Registration hooks** are called once on every installed plugin when the registry is built.
A plugin announces what it offers by calling the ``register`` callback it is handed.
Announcing must stay cheap: import nothing heavy here, since ``torchplug plugins`` announces
every installed plugin.

**Strategy hooks** are called on the *active set* of one [`Engine`][torchplug.Engine]: the chosen
backend (an object made by the strategy's factory), the precision plugin if the backend does not own
precision, and extension plugins. Hooks that perform an action are ``firstresult``: the backend
answers, and composable plugins wrap it with ``@hookimpl(wrapper=True)``: code before the ``yield``
runs before the backend, the ``yield`` returns the backend's answer, and the wrapper returns the
(possibly changed) answer. That is how AMP works with any backend without a branch in the core.
Action hooks that have nothing to return (backward, barrier, save) return ``True`` to say "done";
the Engine raises a clear error when no plugin in the active set answers a hook. Hook names carry
the ``torchplug_`` prefix so that a plugin can also hold other code.
"""
# Why this module is over 500 lines: the whole contract, every hook's documented spec in one module,
# as pytest's hookspec.py (a comment: docs/api.md renders the docstring; hooks.md is made from it).

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import pluggy

from torchplug.util.records import Record

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from torchplug.contract.context import HookContext
    from torchplug.contract.types import (
        ClusterInfo,
        LoggerInfo,
        PrecisionInfo,
        Runtime,
        StrategyInfo,
    )

PROJECT = "torchplug"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marks a plugin function as a torchplug hook implementation: ``@hookimpl``, or with pluggy's
options, e.g. ``@hookimpl(wrapper=True)``, ``@hookimpl(trylast=True)``."""

API_VERSION = "1.5"
"""The version of the plugin API this specification implements, ``MAJOR.MINOR``. A minor
version adds hooks or arguments (a plugin written for 1.0 runs on 1.1); a major version
removes or changes them. A plugin declares the range it supports, e.g.
``TORCHPLUG_API = ">=1.0,<2"`` in its module (or ``StrategyInfo(api=...)``); one whose range
excludes this version is not loaded, and ``torchplug plugins`` says why (docs/plugins.md)."""

#: Hooks renamed or retired: old name -> (new name or "", the major API version that removes
#: it); until then it keeps a hookspec made by `deprecated_hookspec`, warning when implemented.
RETIRED_HOOKS: dict[str, tuple[str, str]] = {
    "torchplug_convert_checkpoint": ("torchplug_read_checkpoint", "2.0"),
}


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Contract(Record):
    """What torchplug promises about one hook, declared beside its specification (and read from
    here by the plugin manager, the Engine's dispatch and answer checks, and docs/hooks.md), so
    the contract lives in one place.

    Args:
        kind: ``"registration"`` (called once per installed plugin when the registry is built),
            ``"strategy"`` (called on one Engine's active set: the backend, the precision plugin,
            extensions) or ``"installed plugins"`` (called on every installed plugin by whoever
            needs the answer).
        called: Who calls it, on which ranks, when.
        required: The Engine refuses to start when no plugin of its active set answers it.
        per_step: Called in the training loop, so resolved once per Engine into a plain
            function (`torchplug.contract.dispatch`).
        answer: The type the answer must have (a dotted name, resolved when checked, so that
            this module imports no torch).
        answer_text: The answer's type as the error names it.
    """

    kind: str
    called: str
    required: bool = False
    per_step: bool = False
    answer: str | None = None
    answer_text: str = ""


#: Every hook's contract, by hook name (filled by `contract` as this module is read).
CONTRACTS: dict[str, Contract] = {}


def contract(**fields: Any) -> Callable[[Any], Any]:
    """Declare the [`Contract`][torchplug.contract.spec.Contract] of the hookspec it decorates.

    Args:
        **fields: The [`Contract`][torchplug.contract.spec.Contract]'s fields.
    """

    def declare(function: Any) -> Any:
        # also on the function, where the typed façade (`torchplug.contract.hooks`) reads it
        # from a plugin manager's specifications without importing this module
        CONTRACTS[function.__name__] = function.torchplug_contract = Contract(**fields)
        return function

    return declare


def hooks_where(**wanted: Any) -> frozenset[str]:
    """The hooks whose contract has every field given, e.g. ``hooks_where(required=True)``.

    Args:
        **wanted: [`Contract`][torchplug.contract.spec.Contract] fields and their values.
    """
    return frozenset(
        name
        for name, declared in CONTRACTS.items()
        if all(getattr(declared, key) == value for key, value in wanted.items())
    )


def deprecated_hookspec(replacement: str, removed_in: str, **options: Any) -> Callable[[Any], Any]:
    """A hookspec marker for a hook being renamed or retired: implementing it still works until
    the major API version ``removed_in`` (a minor version only adds), with a DeprecationWarning
    at registration (pluggy's ``warn_on_impl``) naming the replacement, so plugin authors
    learn of it before the hook is removed.

    Args:
        replacement: The hook to implement instead (``""``: none).
        removed_in: The plugin API version that removes the old hook.
        **options: pluggy's other hookspec options (``firstresult=True``, ...).
    """
    instead = f"implement {replacement} instead" if replacement else "it has no replacement"
    return hookspec(
        warn_on_impl=DeprecationWarning(
            f"this torchplug hook is deprecated and is removed in plugin API {removed_in}; "
            f"{instead} (see docs/hooks.md)"
        ),
        **options,
    )


# --------------------------------------------------------------------------------------------------
# Registration hooks: called once per installed plugin, on the global plugin manager.
# --------------------------------------------------------------------------------------------------

_ANNOUNCING = (
    "Once per process on every installed plugin, when the registry is built: in the launcher,"
    " in `torchplug plugins`/`doctor`/`check`, and in every rank. Keep it cheap."
)


@hookspec
@contract(kind="registration", called=_ANNOUNCING)
def torchplug_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    """Announce the strategies (backends) this plugin provides.

    Call ``register(StrategyInfo(...))`` once per strategy. The
    [`StrategyInfo`][torchplug.plugin.StrategyInfo] names the strategy and its aliases, describes it
    in one line, lists the packages it needs, its options with types and defaults, and its
    capabilities (shards parameters? owns precision? supports CPU? needs its own launcher?). Its
    ``factory`` is called only when a user selects the strategy, so the backend's heavy package is
    imported there, never here.

    Args:
        register: Call it with one [`StrategyInfo`][torchplug.plugin.StrategyInfo] per strategy.
    """


@hookspec
@contract(kind="registration", called=_ANNOUNCING)
def torchplug_register_precisions(register: Callable[[PrecisionInfo], None]) -> None:
    """Announce precision plugins (e.g. AMP) that compose with any backend not owning precision.

    Call ``register(PrecisionInfo(...))`` with the precisions it implements (``"bf16"``,
    ``"fp16"``).

    Args:
        register: Call it with one [`PrecisionInfo`][torchplug.plugin.PrecisionInfo] per precision
            plugin.
    """


@hookspec
@contract(kind="registration", called=_ANNOUNCING)
def torchplug_register_loggers(register: Callable[[LoggerInfo], None]) -> None:
    """Announce the metric loggers (experiment trackers) this plugin provides.

    Call ``register(LoggerInfo(...))`` once per logger: its name (``Engine(loggers=["csv"])``,
    ``torchplug launch --logger csv``), the packages it needs and a ``factory`` called with the
    log directory only when a user selects it, so the tracker's package is imported there,
    never here. Loggers are added exactly as strategies are: a built-in module, an entry point
    of an installed package, or ``torchplug.register`` in your own code.

    Args:
        register: Call it with one [`LoggerInfo`][torchplug.plugin.LoggerInfo] per logger.
    """


@hookspec(firstresult=True)
@contract(
    kind="installed plugins",
    called=(
        "In every process before its Engine exists, and in the `torchplug launch` process (to "
        "fill `--nnodes`, `--node-rank`, `--master-addr`). Never in the workers torchrun starts: "
        "there the manager reads torchrun's variables first, so a scheduler plugin answers for "
        "the launcher process only and need not step aside itself."
    ),
)
def torchplug_cluster_environment(env: Mapping[str, str]) -> ClusterInfo | None:
    """Say who this process is (rank, world size, master address, node rank) from ``env``.

    Return ``None`` when ``env`` does not look like your cluster; the first answer wins, so a plugin
    for a scheduler (SLURM, SageMaker, ...) answers only when its variables are present. The
    built-in implementation reads torchrun's variables and answers last.

    Args:
        env: The process's environment variables (``os.environ``, or what the launcher passes).
    """


# --------------------------------------------------------------------------------------------------
# Strategy hooks: called on the active set of one Engine.
# --------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
@contract(kind="strategy", required=True, called="On every rank, once, inside `Engine(...)`.")
def torchplug_setup(engine: HookContext, cluster: ClusterInfo) -> Runtime | None:
    """Start the backend: create the process group if needed and choose this process's device.

    The backend returns a [`Runtime`][torchplug.plugin.Runtime] (rank, local rank, world size,
    device). A precision plugin wraps this hook to learn the device it will run on.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        cluster: Who this process is in its job, as the cluster-environment plugins found it.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    answer="tuple",
    answer_text="(model, [optimizers])",
    called=("On every rank, by `engine.setup(model, *optimizers)`."),
)
def torchplug_wrap(
    engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]] | None:
    """Move ``model`` to the device and wrap it (and its optimizers) for the backend.

    Returns ``(model, optimizers)``. Wrappers post-process the backend's answer, e.g. AMP runs the
    wrapped model's forward under autocast.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        model: The user's model (on the meta device when the strategy ``takes_meta_modules`` and it
            was built with ``init_module(empty=True)``).
        optimizers: The optimizers given to ``engine.setup``, made on ``model``'s parameters.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    called=("On every rank, by `engine.init_module(empty=True)`, before the model is built."),
)
def torchplug_init_module(engine: HookContext) -> contextlib.AbstractContextManager[None] | None:
    """A context manager in which a model built with ``engine.init_module(empty=True)`` is
    created already partitioned the backend's own way (DeepSpeed ZeRO-3: ``zero.Init``).
    Optional: unanswered, the model is built on the meta device and materialised by setup.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    answer="torch.nn.Module",
    answer_text="a module",
    called=(
        "On every rank, by `engine.setup`, after `torchplug_wrap`, when `Engine(compile=...)` is "
        "set."
    ),
)
def torchplug_compile(
    engine: HookContext, model: torch.nn.Module, options: dict[str, Any]
) -> torch.nn.Module | None:
    """Apply ``torch.compile`` (``options`` are its arguments) to the wrapped ``model`` where
    this backend wants it: the whole DDP module, each FSDP unit; raise ``ConfigurationError``
    where it cannot be compiled. Return the model to use. Optional: unanswered, the Engine calls
    ``model.compile(**options)`` (in place, so parameter names stay the model's).

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        model: The model [`torchplug_wrap`][torchplug_wrap] returned.
        options: The ``torch.compile`` arguments of ``Engine(compile=...)``.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    per_step=True,
    called=("On every rank, for each batch of a loader returned by `engine.setup_dataloader`."),
)
def torchplug_place_batch(engine: HookContext, batch: Any) -> Any:
    """Return ``batch`` (tensors, possibly nested in lists, tuples and dicts) placed for the step.

    The default moves tensors to ``engine.device``; an SPMD backend also marks them sharded over
    its data axis.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        batch: One batch as the loader yields it.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    called=(
        "On every rank, by `engine.setup_dataloader`, for a DataLoader of a map-style dataset "
        "with the default sampler, sharded by sample (API 1.4)."
    ),
)
def torchplug_batch_sampler(engine: HookContext, loader: Any, seed: int) -> Any:
    """A batch sampler dealing ``loader``'s samples step by step, or ``None`` for fixed shares
    (a ``DistributedSampler``): for a backend whose ranks change per step (a quorum). The loader
    then fetches in the main process, asking for a batch's indices only when the loop needs it;
    it calls ``set_epoch(epoch)`` as a pass starts, reads ``end_of_pass`` (and ``batch_padding``,
    the padding samples ending the batch, which ``gather_for_metrics`` drops: 0 if absent) after
    each batch and keeps ``state_dict()``/``load_state_dict()`` in its own.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        loader: The user's ``DataLoader`` (dataset, batch size, shuffle, ``drop_last``).
        seed: The Engine's data seed (``DistributedSampler``'s).
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    per_step=True,
    answer="bool",
    answer_text="True",
    called=("On every rank, by `engine.backward(loss)`."),
)
def torchplug_backward(
    engine: HookContext, loss: torch.Tensor, model: torch.nn.Module | None
) -> bool:
    """Run the backward pass of ``loss``; return ``True``.

    A wrapper that must change the gradients (loss scaling) registers an autograd hook on ``loss``
    before yielding: the backend's backward then carries the change, whatever the backend does.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        loss: The loss to run backward from (scaled by ``1/steps`` inside ``engine.accumulate``).
        model: The model the user named in ``engine.backward(loss, model)``, else ``None``.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    answer="torch.Tensor",
    answer_text="the loss (detached)",
    called=("On every rank, by `engine.forward_backward(model, *inputs, target=, loss_fn=)`."),
)
def torchplug_forward_backward(
    engine: HookContext,
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
) -> torch.Tensor | None:
    """Run forward, ``loss_fn(output, target)`` and backward as one schedule (a pipeline's);
    return the batch's mean loss on every rank. Unanswered: the Engine's forward and backward.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        model: What `engine.setup` returned.
        inputs: The model's positional inputs (a whole batch).
        kwargs: Its keyword inputs.
        target: What ``loss_fn`` compares the output with.
        loss_fn: ``loss_fn(output, target)``, a mean (divided by ``engine.accumulate``'s steps).
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    per_step=True,
    answer="bool",
    answer_text="True (stepped) or False",
    called=(
        "On every rank, whenever the user calls `optimizer.step()` on an optimizer returned by "
        "`engine.setup`."
    ),
)
def torchplug_optimizer_step(
    engine: HookContext, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None
) -> bool | None:
    """Perform one optimizer step; return ``True`` if parameters were updated, ``False`` if skipped.

    It exists because a step is not always ``optimizer.step()``: a gradient scaler must skip
    steps with inf/NaN gradients, and some backends own the step. Inside this hook
    ``optimizer.step()`` is the optimizer's real step, so an implementation can call it directly.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        optimizer: The optimizer ``step()`` was called on.
        closure: The closure passed to ``step()``, if any.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    per_step=True,
    answer="torch.Tensor",
    answer_text="the total norm",
    called=("On every rank, by `engine.clip_grad_norm_(...)`."),
)
def torchplug_clip_grad_norm(
    engine: HookContext,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    max_norm: float,
    norm_type: float,
) -> torch.Tensor | None:
    """Clip gradients of ``model`` to ``max_norm``; return the total norm before clipping.

    A precision plugin wraps it to unscale gradients first; a sharded backend computes the norm
    across shards.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        model: The model whose gradients are clipped.
        optimizer: Its optimizer, when the user passed it (a precision plugin needs it to unscale).
        max_norm: The largest total norm allowed.
        norm_type: The norm's order.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    per_step=True,
    answer="contextlib.AbstractContextManager",
    answer_text="a context manager",
    called=("On every rank, by `engine.no_sync(model)`."),
)
def torchplug_no_sync(
    engine: HookContext, model: torch.nn.Module
) -> AbstractContextManager[None] | None:
    """Return a context manager in which backward does not synchronize gradients across ranks.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        model: The model whose gradient synchronization is skipped.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    per_step=True,
    answer="contextlib.AbstractContextManager",
    answer_text="a context manager",
    called=("On every rank, by `engine.autocast()`."),
)
def torchplug_autocast(engine: HookContext) -> AbstractContextManager[None] | None:
    """Return the context manager that applies the active precision to code the user runs in it.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    per_step=True,
    answer="torch.Tensor",
    answer_text="a tensor",
    called=("On every rank (a collective: all ranks must call it), by `engine.reduce`."),
)
def torchplug_reduce(engine: HookContext, tensor: torch.Tensor, op: str) -> torch.Tensor | None:
    """Reduce ``tensor`` over all ranks with ``op`` (``sum``, ``mean``, ``max``, ``min``).

    Returns a new tensor holding the result on every rank; the input is not modified. It has
    the input's dtype, except an integer ``mean``: a true mean (2.5, not 2) in the default dtype.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        tensor: This rank's tensor.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    per_step=True,
    answer="torch.Tensor",
    answer_text="a tensor",
    called=("On every rank (a collective), by `engine.gather`."),
)
def torchplug_gather(
    engine: HookContext, tensor: torch.Tensor, replicas: bool
) -> torch.Tensor | None:
    """Gather ``tensor`` from all ranks into a tensor of shape ``(world_size, *tensor.shape)``.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        tensor: This rank's tensor (the same shape on every rank).
        replicas: ``True`` from ``gather_for_metrics`` (API 1.5): a backend whose data-parallel
            replicas reach past its ranks (ft-ddp's groups) gathers every rank of every replica
            taking part, one row each, in data-parallel order. Other backends ignore it.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    per_step=True,
    answer="bool",
    answer_text="True",
    called=("On every rank (a collective), by `engine.barrier()`."),
)
def torchplug_barrier(engine: HookContext) -> bool | None:
    """Block until every rank reaches this point; return ``True``.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    answer="torch.Tensor",
    answer_text="a tensor",
    called=(
        "On every rank (a collective), by the Engine: before the backend wraps a model "
        "(`engine.setup`: rank 0's parameters and buffers, tensor by tensor), when a meta-device "
        "model is materialised (rank 0's RNG state) (API 1.2)."
    ),
)
def torchplug_broadcast(engine: HookContext, tensor: torch.Tensor, src: int) -> torch.Tensor | None:
    """Give every rank rank ``src``'s ``tensor``, written into ``tensor`` in place; return it.

    Every collective the Engine itself needs goes through this hook, `torchplug_reduce`,
    `torchplug_gather` and `torchplug_barrier`, never through torch.distributed directly, so a
    backend whose collectives are its own (XLA's, a private process group, torchft's managed
    groups, mpi4py) is never bypassed. A backend that owns a tensor's placement (a parameter it
    has already partitioned) returns it unchanged. The default answer (the ``torch_distributed``
    plugin) broadcasts over the default process group, staging through the device for
    backends that take device tensors only (nccl).

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        tensor: This rank's tensor; the same shape and dtype on every rank.
        src: The rank whose value every rank gets.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    answer="bool",
    answer_text="True",
    called=("On every rank (a collective), by `engine.save` / `save_checkpoint`."),
)
def torchplug_save(
    engine: HookContext, path: str, state: dict[str, Any], metadata: dict[str, Any]
) -> bool | None:
    """Write ``state`` as a torchplug checkpoint directory at ``path``; return ``True``.

    ``metadata`` is the user's JSON-serializable dict, recorded in the manifest as is. Every rank
    calls it. The default (`torchplug.checkpoint.save`) takes each module's and optimizer's
    state through the four state hooks below and writes the portable format; a backend with a
    format of its own (DeepSpeed) answers this hook and still writes through
    `torchplug.checkpoint`, so atomicity, hashing and failure agreement are the same.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        path: The checkpoint directory to write.
        state: What to save, by name: modules, optimizers, tensors, JSON values.
        metadata: The user's JSON values, recorded in the manifest.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    answer="dict",
    answer_text="a dict of the values loaded",
    called=("On every rank (a collective), by `engine.load` / `resume`."),
)
def torchplug_load(
    engine: HookContext, path: str, state: dict[str, Any] | None, strict: bool
) -> dict[str, Any] | None:
    """Load the checkpoint at ``path`` into the objects of ``state``, in place.

    Returns the plain values of the entries not restored into an object (step counters, user
    dicts); with ``state=None``, every plain value and a summary of the rest. With ``strict`` an
    entry that cannot be restored into the object given for it is an error. Implementations read
    through `torchplug.checkpoint`, which validates the manifest and never unpickles.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        path: The checkpoint directory to read.
        state: The objects to restore in place, by name; ``None``: return what the checkpoint holds.
        strict: Refuse entries that cannot be restored into the objects given.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    answer="bool",
    answer_text="True",
    called=("On every rank, by `engine.resume`, before it looks for a checkpoint on disk."),
)
def torchplug_resume(engine: HookContext, state: dict[str, Any]) -> bool | None:
    """Restore ``state`` from live peers, in place, instead of from disk; return ``True``.
    Answered by a backend whose replicas outlive a failure (fault-tolerant data parallel): a
    replica that (re)joins takes ``state`` from a healthy peer, and the backend keeps ``state``
    to serve later ones. Unanswered: `engine.resume` loads from ``checkpoint_dir``.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        state: The objects `engine.resume` was given, by name (plain values replaced in it).
    """


# -- the state protocol between the Engine, strategies and checkpoints ----------------------------


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    called=("On every rank, by the default save and by `engine.full_state`."),
)
def torchplug_model_state(engine: HookContext, model: torch.nn.Module) -> dict[str, Any] | None:
    """The model's state by parameter name (no wrapper prefixes), as the backend holds it.

    Sharded backends return DTensor shards; checkpoints store them by their global shape, so any
    strategy can load them. Also used by [`Engine.full_state`][torchplug.Engine.full_state].

    A backend that must gather a full tensor with a collective (ZeRO-3) may, while
    ``torchplug.checkpoint.deferred.wanted()`` is true (inside a save), return a
    ``Deferred(shape, dtype, produce)`` instead: the save calls ``produce`` on every rank in
    name order once it knows which rank writes the tensor, and keeps it only there, so no rank
    holds the whole model. The same holds for
    [`torchplug_optimizer_state`][torchplug_optimizer_state].

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        model: A model this Engine set up.
    """


@hookspec(firstresult=True)
@contract(kind="strategy", required=True, called="On every rank, by the default load.")
def torchplug_load_model_state(
    engine: HookContext, model: torch.nn.Module, state: dict[str, Any], strict: bool
) -> bool | None:
    """Put ``state`` (as [`torchplug_model_state`][torchplug_model_state] returns it) into
    ``model``; return True.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        model: A model this Engine set up.
        state: Its state, as [`torchplug_model_state`][torchplug_model_state] returns it.
        strict: Refuse missing and unexpected names.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    called=("On every rank, by the default save and `engine.full_state`."),
)
def torchplug_optimizer_state(
    engine: HookContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any] | None:
    """The optimizer's state keyed by parameter name (``{"state": ..., "param_groups": ...}``).

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        model: The model whose parameters ``optimizer`` updates.
        optimizer: An optimizer this Engine set up.
    """


@hookspec(firstresult=True)
@contract(kind="strategy", required=True, called="On every rank, by the default load.")
def torchplug_load_optimizer_state(
    engine: HookContext,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
) -> bool | None:
    """Put ``state`` (as [`torchplug_optimizer_state`][torchplug_optimizer_state] returns it) into
    ``optimizer``.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        model: The model whose parameters ``optimizer`` updates.
        optimizer: An optimizer this Engine set up.
        state: Its state, as [`torchplug_optimizer_state`][torchplug_optimizer_state] returns it.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    required=True,
    called=("On every rank, by the default load, once per entry kind."),
)
def torchplug_reads_in_place(engine: HookContext, kind: str) -> bool | None:
    """Whether loading reads a ``kind`` (``"module"``/``"optimizer"``) entry straight into the
    tensors the state hook returns (resharding in place), or into fresh CPU tensors handed to the
    load hook. A backend whose tensors DCP cannot write (XLA), or whose optimizer holds only part
    of the state (FairScale OSS), answers ``False``.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
        kind: ``"module"`` or ``"optimizer"``.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    called=(
        "On rank 0, by `Engine(resume='latest')`, for the newest `step-N` directory, before it "
        "is loaded (API 1.1)."
    ),
)
def torchplug_checkpoint_metadata(engine: HookContext, path: Path) -> dict[str, Any] | None:
    """The metadata the checkpoint at ``path`` was saved with (``engine.save(...,
    metadata=...)``, and ``"step"`` for ``engine.save_checkpoint``), read as its format reads it
    (signature checked when a checkpoint key is set); raise ``CheckpointError`` when it cannot be
    read. ``None``: not this plugin's format. Resuming compares ``"step"`` with the directory's
    name, so a renamed ``step-N`` is refused rather than resumed as a step it never was.
    Answered by the built-in ``checkpoint`` plugin for the portable format; a backend with a
    native format answers for its own. Called on one rank only: no collectives.

    Args:
        engine: The [`HookContext`][torchplug.plugin.HookContext] of the Engine calling it.
        path: A checkpoint directory.
    """


@hookspec(firstresult=True)
@contract(
    kind="strategy",
    called=("On every rank, by `engine.load_pretrained(model, path)` (API 1.1)."),
)
def torchplug_load_pretrained(
    engine: HookContext, model: torch.nn.Module, path: Path, strict: bool
) -> dict[str, list[str]] | None:
    """Load pretrained weights (``model.safetensors``, or the shards its index lists) into
    ``model``, each rank reading only what its shards need; return ``{"loaded", "missing",
    "unexpected"}`` (tensor names). Answered by the built-in ``checkpoint`` plugin for any
    backend whose parameters are plain tensors or DTensors; a backend that holds parameters its
    own way answers for itself.

    Args:
        engine: The [`HookContext`][torchplug.plugin.HookContext] of the Engine calling it.
        model: The user's model (unwrapped) as set up by this Engine.
        path: A ``.safetensors`` file, or a directory as ``save_pretrained`` writes it.
        strict: Refuse a model tensor the files lack.
    """


@hookspec(firstresult=True)
@contract(
    kind="installed plugins",
    called=(
        "By `torchplug convert` on a directory that is not a torchplug checkpoint, in one "
        "process, on every installed plugin until one answers."
    ),
)
def torchplug_read_checkpoint(source: Path, optimizer: bool) -> dict[str, Any] | None:
    """Read a checkpoint that is not torchplug's (e.g. a native DeepSpeed one) as portable state,
    or return ``None`` if the directory is not yours.

    The answer is ``{"model": {name: tensor}, "optimizer": {"state": {name: {...}},
    "param_groups": [{..., "params": [names]}]} or None, "step": int or None, "format": str}``,
    the layout [`torchplug_model_state`][torchplug_model_state] and
    [`torchplug_optimizer_state`][torchplug_optimizer_state] produce; ``optimizer=False`` lets a
    reader skip the (slower) optimizer state. ``torchplug convert`` calls it on every installed
    plugin and writes the answer as a portable checkpoint or as safetensors. The user chose to
    convert this directory, so the reader may use its library's own loaders; import nothing heavy
    unless the directory is yours.

    Args:
        source: The directory ``torchplug convert`` was given.
        optimizer: Whether the optimizer state is wanted too.
    """


@deprecated_hookspec("torchplug_read_checkpoint", removed_in="2.0", firstresult=True)
@contract(
    kind="installed plugins",
    called=(
        "By `torchplug convert`, in one process, on every installed plugin until one answers "
        "(only when no `torchplug_read_checkpoint` answered)."
    ),
)
def torchplug_convert_checkpoint(source: Path, destination: Path) -> list[Path] | None:
    """Deprecated since API 1.0: implement
    [`torchplug_read_checkpoint`][torchplug_read_checkpoint] instead (it returns the state, and
    ``torchplug convert`` writes it in either format); this hook is removed in API 2.0, and a
    plugin implementing it gets a ``DeprecationWarning`` when it is registered.

    Convert a checkpoint that is not torchplug's (e.g. a native DeepSpeed one) to
    ``destination/model.safetensors``; return the files written, or ``None`` if it is not yours
    (import nothing heavy unless it is).

    Args:
        source: The directory ``torchplug convert`` was given.
        destination: The directory to write ``model.safetensors`` into.
    """


@hookspec
@contract(
    kind="strategy",
    answer="dict",
    answer_text="a dict of name -> object",
    called=(
        "On every rank, by the Engine, on its active set (the chosen backend, the precision "
        "plugin, extensions)."
    ),
)
def torchplug_checkpoint_state(engine: HookContext) -> dict[str, Any] | None:
    """Objects of this plugin's that every checkpoint carries: ``{name: obj}``, each with
    ``state_dict()`` and ``load_state_dict(state)`` (the AMP plugin's GradScaler: its loss scale
    and growth tracker, so an fp16 run resumes exactly where it was).

    Called on every plugin of the active set at each ``engine.save`` and ``engine.load``; the
    answers are merged. Each object is saved as the entry ``torchplug.<name>`` (a namespace user
    keys cannot take) and restored on load when the checkpoint holds it: a checkpoint saved
    without the plugin (another precision, an older torchplug) leaves the object as it is. Keep
    the state small, JSON values or tensors equal on every rank: rank 0's copy is written.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
    """


@hookspec
@contract(
    kind="strategy",
    called=(
        "On every rank, by `engine.close()` (and when setup fails), on every plugin of the active"
        " set."
    ),
)
def torchplug_teardown(engine: HookContext) -> None:
    """Release what setup acquired (e.g. destroy the process group the backend created).

    Needed because one process may create several Engines one after another (tests, notebooks,
    sweeps); every plugin in the active set is called.

    Args:
        engine: The calling Engine's [`HookContext`][torchplug.plugin.HookContext].
    """
