"""Every change the Engine makes to a user's objects, and how `Engine.close` undoes it.

`Engine.setup` runs here (`setup`: activation checkpointing and SyncBatchNorm before the
wrap, rank 0's weights on every rank or a meta model materialised, the backend's wrap, compile),
and what it patches lives here, each patch an instance attribute recorded with `remember` first,
so that ``close()`` puts the object back as it was (a model pickles again after close):

* ``optimizer.step`` routed through the ``torchplug_optimizer_step`` hook (`route_step`), with
  the two private marks torch's LR schedulers read, set through
  `torchplug.util.torchprivate` (``tests/contract/test_contract.py`` pins them for the installed
  torch);
* ``optimizer.zero_grad`` doing nothing on accumulation micro-steps (`skip_zero_grad`);
* a ``.module`` wrapper's ``state_dict``/``load_state_dict`` answering with the user's names
  (`portable_state_dict`);
* ``torch.compile`` in place (`compile_in_place`).

Plugins that patch user objects themselves (AMP's forward, XLA's, FSDP's) record each patch
with `HookContext.restore_on_close`, which lands in the same list.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from torchplug.contract.errors import ConfigurationError
from torchplug.util import torchprivate

if TYPE_CHECKING:
    from torchplug.engine._typing import Engine


def remember(undo: list[Callable[[], None]], obj: Any, name: str) -> None:
    """Append to ``undo`` a function that puts ``obj.name`` back as it is now (removed when it
    was not in the instance's ``__dict__``)."""
    had = name in getattr(obj, "__dict__", {})
    previous = obj.__dict__.get(name) if had else None

    def restore() -> None:
        if had:
            setattr(obj, name, previous)
        else:
            obj.__dict__.pop(name, None)

    undo.append(restore)


def compile_in_place(engine: Engine, model: torch.nn.Module, options: dict[str, Any]) -> None:
    """``model.compile(**options)``, undone by close."""
    engine._backend.restore_on_close(model, "_compiled_call_impl")
    model.compile(**options)


def setup(
    engine: Engine, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]
) -> Any:
    """What `Engine.setup` does, in its order: activation checkpointing and SyncBatchNorm
    before the wrap, rank 0's model on every rank (or a meta model materialised), the backend's
    wrap, compile, then the returned model's state-dict names and the optimizers' steps."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"Engine.setup expects an nn.Module first, got {type(model).__name__}. "
            f"Call engine.setup(model, optimizer)."
        )
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"Engine.setup expects optimizers after the model, got {type(opt).__name__}."
            )
    from torchplug.engine import scaling

    if engine.activation_checkpointing:  # before the wrap, as FSDP2 wants it
        scaling.checkpoint_activations(engine, model, engine.activation_checkpointing)
    if engine.sync_batchnorm and engine.data_parallel_size > 1:
        from torchplug.features import syncbn

        # before the wrap sees the layers
        engine._backend.undo += syncbn.convert(
            model, engine.device, engine._collectives.reduce, engine.world_size
        )
    meta = scaling.is_meta(model)
    if not meta:
        scaling.replicate_from_rank_zero(
            model, engine._hooks.broadcast, engine.world_size, engine._collectives.reduce
        )
    if meta and not engine.info.takes_meta_modules:
        # replicated: the whole model, on the CPU as an eager build; the wrap moves it
        materialize(engine, model, optimizers, torch.device("cpu"))
    wrapped, wrapped_optimizers = engine._hooks.wrap(model, list(optimizers))
    if meta and scaling.is_meta(wrapped):
        materialize(engine, wrapped, wrapped_optimizers, engine.device)  # sharded: its shards
    if engine.compile_options is not None:
        compiled = engine._hooks.compile(wrapped, engine.compile_options)
        if compiled is None:
            compile_in_place(engine, wrapped, engine.compile_options)
        else:
            wrapped = compiled
    engine._originals[wrapped] = engine.unwrap(model)
    portable_state_dict(engine, wrapped, engine.unwrap(model))
    for opt in wrapped_optimizers:
        if route_step(engine, opt):
            engine._backend.optimizers.append(opt)
        engine._backend.optimizer_models[id(opt)] = weakref.ref(wrapped)
    return (wrapped, *wrapped_optimizers) if optimizers else wrapped


def forward_backward(
    engine: Engine, model: Any, inputs: Any, kwargs: Any, target: Any, loss_fn: Callable
) -> torch.Tensor:
    """`Engine.forward_backward`: the backend's schedule (``torchplug_forward_backward``) with
    ``loss_fn`` divided inside ``engine.accumulate`` (the loss returned is the undivided one),
    else the forward and the loss (under the precision's autocast) and `Engine.backward`."""
    steps = engine.accumulating[0] if engine.accumulating is not None else 1
    fn = loss_fn if steps == 1 else (lambda output, t: loss_fn(output, t) / steps)
    loss = engine._hooks.forward_backward(model, inputs, kwargs, target, fn)
    if loss is not None:
        return loss.detach() * steps
    with engine.autocast():  # the loss too, as the Trainer computes it; backward outside
        loss = loss_fn(model(*inputs, **kwargs), target)
    engine.backward(loss, model)
    return loss.detach()


def materialize(
    engine: Engine,
    model: torch.nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    device: torch.device,
) -> None:
    """Allocate a meta-device model and run its initialisation; optimizers made on the
    meta parameters are pointed at the real ones."""

    names = {id(p): name for name, p in model.named_parameters()}
    broadcast = engine._hooks.broadcast if engine.world_size > 1 else None
    engine._meta.materialize(model, device, broadcast)
    params = dict(model.named_parameters())
    for optimizer in optimizers:
        rebind_optimizer(optimizer, names, params, "materialising creates the parameters")


def portable_state_dict(engine: Engine, wrapped: torch.nn.Module, model: torch.nn.Module) -> None:
    """Make a wrapper's ``state_dict()`` / ``load_state_dict()`` those of the user's model.

    DDP, FairScale and DeepSpeed hold the model as ``wrapper.module``, so their state dicts
    name every entry ``module.<name>``; a user's ``torch.save(model.state_dict())`` would
    then load under no other strategy. Like Fabric's module wrapper, the returned module
    answers with the inner model's names instead. Only these two methods are replaced, on
    the wrapper instance (no per-step cost, nothing on the forward path); torchplug's own
    checkpoints use the state hooks, which see the wrapper's native methods (inside
    `HookContext.native_state_dicts`). ``close()`` puts the originals back.
    """
    if wrapped is model or getattr(wrapped, "module", None) is not model:
        return  # not a `.module` wrapper of the user's model: its names are already plain
    engine_ref = weakref.ref(engine)
    native_state_dict = wrapped.state_dict
    native_load = wrapped.load_state_dict

    def native() -> bool:
        engine = engine_ref()
        return engine is not None and engine._backend.native_state > 0

    @functools.wraps(native_state_dict)
    def state_dict(*args: Any, **kwargs: Any) -> Any:
        if native():
            return native_state_dict(*args, **kwargs)
        return model.state_dict(*args, **kwargs)

    @functools.wraps(native_load)
    def load_state_dict(*args: Any, **kwargs: Any) -> Any:
        if native():
            return native_load(*args, **kwargs)
        return model.load_state_dict(*args, **kwargs)

    for name, function in (("state_dict", state_dict), ("load_state_dict", load_state_dict)):
        engine._backend.restore_on_close(wrapped, name)
        object.__setattr__(wrapped, name, function)


def route_step(engine: Engine, optimizer: torch.optim.Optimizer) -> bool:
    """Route ``optimizer.step()`` through the ``torchplug_optimizer_step`` hook; ``False`` when
    it is routed through ``engine`` already."""
    routed = getattr(optimizer, "_torchplug_engine", None)
    if callable(routed) and routed() is engine:
        return False
    real_step = optimizer.step
    inside = False
    engine_ref = weakref.ref(engine)

    def step(opt: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        # Re-entered from inside the hook (a backend or GradScaler calling optimizer.step()):
        # that call is the real step.
        nonlocal inside
        engine = engine_ref()
        torchprivate.mark_optimizer_called(opt)  # what torch's LR schedulers look for
        if inside and engine is not None and id(opt) in engine._backend.skipped_updates:
            return None  # a precision plugin found inf/NaN gradients: no update
        if inside or engine is None or engine._backend.raw_steps:
            return real_step(closure) if closure is not None else real_step()
        accumulating = engine._backend.accumulating
        if accumulating is not None and not accumulating[1]:
            opt.step_was_skipped = True  # an accumulation step: no update yet
            return None
        inside = True
        try:
            stepped = engine._hooks.optimizer_step(opt, closure)
        finally:
            inside = False
        if engine._profiler is not None:
            engine._profiler.step()
        opt.step_was_skipped = stepped is False
        engine._preemption.stepped()  # a SIGTERM the script never asked about ends it now
        return None

    # LR schedulers wrap optimizer.step to notice a scheduler stepped before the optimizer;
    # this step does their bookkeeping itself, for schedulers made before setup and after.
    torchprivate.mark_scheduler_wrapped(step)
    for name in ("step", "step_was_skipped", "_torchplug_engine"):
        engine._backend.restore_on_close(optimizer, name)
    # A bound method, as torch's LR schedulers expect to find on an optimizer.
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.step_was_skipped = False
    optimizer._torchplug_engine = weakref.ref(engine)  # the user's object holds no Engine
    return True


def skip_zero_grad(backend: Any, optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad()`` that does nothing on an accumulation step (``backend``: the
    Engine's `BackendState`, which knows)."""
    if getattr(optimizer, "_torchplug_zero_grad", False):
        return
    real_zero_grad = optimizer.zero_grad
    backend_ref = weakref.ref(backend)

    def zero_grad(opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        owner = backend_ref()
        if owner is not None and owner.accumulating and not owner.accumulating[1]:
            return
        real_zero_grad(set_to_none=set_to_none)

    for name in ("zero_grad", "_torchplug_zero_grad"):
        backend.restore_on_close(optimizer, name)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)  # type: ignore[method-assign]
    optimizer._torchplug_zero_grad = True


def rebind_optimizer(
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    params: dict[str, torch.nn.Parameter],
    why: str,
) -> None:
    """Point ``optimizer`` at the parameters that replaced the ones it was made with.

    ``names`` maps the old parameters' ids to their names, ``params`` the names to the new ones.
    Backends whose ``setup`` creates new parameter objects (sharding, another device type) call
    it so that an optimizer created before ``engine.setup`` keeps working.

    Args:
        optimizer: An optimizer made on the old parameters.
        names: Old parameters' ids -> their names.
        params: Names -> the new parameters.
        why: What replaced them, for the error when the optimizer already stepped.
    """
    if optimizer.state:
        raise ConfigurationError(
            f"The optimizer has already stepped; {why}, so its state would no longer match. Call "
            f"engine.setup(model, optimizer) before the first step."
        )
    for group in optimizer.param_groups:
        try:
            group["params"] = [params[names[id(p)]] for p in group["params"]]
        except KeyError:
            raise ConfigurationError(
                "The optimizer holds parameters that are not the model's. Create it from "
                "model.parameters() and pass both to engine.setup(model, optimizer)."
            ) from None


def finite_norm(norm: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``norm``, or torch's error for a non-finite one (``clip_grad_norm_(...,
    error_if_nonfinite=True)``): the total norm is agreed on every rank, so every rank raises."""
    if not torch.isfinite(norm).all():
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients is non-finite "
            f"({norm.item()}), so it cannot be clipped. To scale the gradients by it anyway, "
            f"leave error_if_nonfinite=False; to skip such steps, check the norm (or use fp16's "
            f"loss scaler, which skips them)."
        )
    return norm
