"""What the Engine does to a model beyond the backend's wrap, for models that stop fitting:
activation checkpointing per block, ``torch.compile``, and building parameters on the meta device
then materialising them (only each rank's shard under sharding backends).

Activation checkpointing replaces each chosen block's ``forward`` on the instance with
``torch.utils.checkpoint.checkpoint(forward, ..., use_reentrant=False)``: no wrapper module, so
parameter names, state dicts and checkpoints stay exactly those of the plain model (``close()``
puts the original ``forward`` back).

Meta-device materialisation calls each module's ``reset_parameters()`` in module order, then the
model's own initialisation (Hugging Face's ``_init_weights`` through ``post_init``, or a model's
``init_weights()``), starting from the RNG state `Engine.init_module` saw, so a model built
empty initialises to the same numbers as one built eagerly. Under a sharding backend each module's
full tensors exist only while that module is initialised, then only this rank's shard is kept (a
model-wide ``init_weights()`` holds the whole model on the CPU while it runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

import torch

from torchplug.contract.errors import ConfigurationError
from torchplug.util import torchprivate

if TYPE_CHECKING:
    from torchplug.engine._typing import Engine


def compile_options(value: bool | dict[str, Any] | None) -> dict[str, Any] | None:
    """``Engine(compile=...)``: ``True`` (torch's defaults), a dict of ``torch.compile``
    arguments, or ``False``/``None`` (off)."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        allowed = {"mode", "backend", "fullgraph", "dynamic", "options", "disable"}
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ConfigurationError(
                f"Engine(compile=...) got unknown torch.compile arguments {unknown}; expected "
                f"some of {sorted(allowed)}, e.g. compile={{'mode': 'max-autotune'}}."
            )
        return dict(value)
    raise ConfigurationError(
        f"Engine(compile=...) must be True, False or a dict of torch.compile arguments, got "
        f"{type(value).__name__}."
    )


def block_classes(value: Iterable[type | str] | None) -> tuple[type | str, ...]:
    """``Engine(activation_checkpointing=[Block, "OtherBlock"])``: classes or class names."""
    if value is None:
        return ()
    if isinstance(value, (type, str)):
        value = [value]
    if not isinstance(value, Iterable):
        raise ConfigurationError(
            f"activation_checkpointing takes module classes or class names, got "
            f"{type(value).__name__} {value!r}. Pass e.g. "
            f"activation_checkpointing=[TransformerBlock]."
        )
    found = tuple(value)
    bad = [v for v in found if not isinstance(v, (type, str))]
    if bad:
        raise ConfigurationError(
            f"activation_checkpointing takes module classes or class names, got {bad!r}. Pass "
            f"e.g. activation_checkpointing=[TransformerBlock]."
        )
    return found


def _matches(module: torch.nn.Module, classes: Sequence[type | str]) -> bool:
    return any(
        isinstance(module, c) if isinstance(c, type) else type(module).__name__ == c
        for c in classes
    )


def checkpoint_activations(
    engine: Engine, model: torch.nn.Module, classes: Sequence[type | str]
) -> int:
    """Recompute each matching block's activations in backward instead of storing them."""
    import functools

    from torch.utils.checkpoint import checkpoint

    count = 0
    for module in model.modules():
        if module is model or not _matches(module, classes):
            continue
        forward = module.forward

        @functools.wraps(forward)
        def checkpointed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        engine._backend.restore_on_close(module, "forward")
        module.forward = checkpointed
        count += 1
    if not count:
        names = sorted({type(m).__name__ for m in model.modules() if m is not model})
        wanted = [c.__name__ if isinstance(c, type) else c for c in classes]
        raise ConfigurationError(
            f"activation_checkpointing={wanted}: no submodule of {type(model).__name__} is one "
            f"of them. Its submodule classes are {names[:12]}."
        )
    return count


# -- meta-device initialisation --------------------------------------------------------------------


#: A collective broadcast, ``(tensor, src) -> tensor`` written in place on every rank: the
#: ``torchplug_broadcast`` hook of the Engine's active set (core calls no torch.distributed).
Broadcast = Callable[[torch.Tensor, int], torch.Tensor]


def replicate_from_rank_zero(
    model: torch.nn.Module,
    broadcast: Broadcast,
    world_size: int,
    reduce: Callable[[torch.Tensor, str], torch.Tensor],
) -> None:
    """Give every rank rank 0's parameters and buffers before the backend wraps the model, as
    DDP does for itself: a script whose ranks built the model from different seeds (no seed,
    or one per rank) would otherwise shard a mix of differently initialised models under fsdp
    or tp. Each tensor goes through the backend's ``torchplug_broadcast``, which leaves alone
    what it has partitioned already (DeepSpeed's ``zero.Init``); DTensors are distributed
    already and are skipped.

    The ranks first agree that their tensors have the same shapes (one ``reduce``): a
    broadcast of tensors of different sizes aborts the process in gloo's native code. Ranks
    that built different models, or a model an earlier pipeline Engine left holding only each
    rank's stages, are refused on every rank instead."""
    if world_size <= 1:
        return
    import zlib

    from torch.distributed.tensor import DTensor

    tensors = [t for t in (*model.parameters(), *model.buffers()) if not isinstance(t, DTensor)]
    shapes = [(tuple(t.shape), str(t.dtype)) for t in dict.fromkeys(tensors)]
    signature = zlib.crc32(repr(shapes).encode())
    seen = reduce(torch.tensor([signature, -signature], dtype=torch.int64), "max")
    if int(seen[0]) != -int(seen[1]):
        raise ConfigurationError(
            f"Engine.setup: the ranks' models differ in their tensors' shapes or dtypes "
            f"({len(shapes)} tensors here), so rank 0's cannot be given to every rank. Expected "
            f"the same model on every rank. Build it from the same code and configuration on "
            f"each; a model an earlier Engine split into pipeline stages holds only each rank's "
            f"stages: build it anew and load what that Engine saved."
        )
    with torch.no_grad():
        for tensor in dict.fromkeys(tensors):  # a tied tensor once
            broadcast(tensor, 0)


def is_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _own_tensors(module: torch.nn.Module) -> list[str]:
    return [
        n
        for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if t is not None
    ]


def own_init(model: torch.nn.Module) -> str | None:
    """How the model initialises itself beyond its layers' ``reset_parameters()``:
    ``"hf"`` (Hugging Face's ``post_init``: ``_init_weights`` applied to every submodule),
    ``"init_weights"`` (a model-wide ``init_weights()`` method, as torchtitan's models have), or
    ``None``. An eager build runs it after the layers' own initialisation; so does
    materialisation, from the same RNG state, so both give the same numbers."""
    if callable(getattr(model, "_initialize_weights", None)) and callable(
        getattr(model, "_init_weights", None)
    ):
        return "hf"
    if callable(getattr(model, "init_weights", None)):
        return "init_weights"
    return None


def check_initialisable(model: torch.nn.Module) -> None:
    """Every module holding tensors of its own must be able to initialise them again (by its
    ``reset_parameters()``, or through the model's own initialisation)."""
    if own_init(model) is not None:
        return
    unable = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if _own_tensors(m) and not callable(getattr(m, "reset_parameters", None))
        }
    )
    if unable:
        raise ConfigurationError(
            f"Modules built with engine.init_module(empty=True) are initialised by their "
            f"reset_parameters(), which {unable} lack (they initialise in __init__). Give them a "
            f"reset_parameters() method (or the model an init_weights() method that initialises "
            f"every tensor), or build the model without empty=True."
        )


@contextlib.contextmanager
def _on_cpu(modules: Sequence[torch.nn.Module], full: bool) -> Iterator[None]:
    """The modules' own tensors as full-size CPU stand-ins while the body initialises them (the
    CPU RNG an eager build draws from), then copied back into place (only this rank's shard of a
    DTensor). ``full``: start from the current values (gathered from the shards: every rank
    takes part), for an initialisation that leaves some tensors as they are."""
    from torch.distributed.tensor import DTensor

    swapped: list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]] = []
    for module in modules:
        slots = {**module._parameters, **module._buffers}  # noqa: SLF001
        for name in _own_tensors(module):
            tensor = slots[name]
            if isinstance(tensor, DTensor):
                stand_in = (
                    tensor.full_tensor().detach().cpu().clone()
                    if full
                    else torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
                )
            elif tensor.device.type != "cpu":
                stand_in = (
                    tensor.detach().cpu().clone()
                    if full
                    else torch.empty_like(tensor, device="cpu")
                )
            else:
                continue  # on the CPU already: initialised in place
            _put(module, name, stand_in, like=tensor)
            swapped.append((module, name, tensor, stand_in))
    try:
        with torch.no_grad():
            yield
    finally:
        with torch.no_grad():
            for module, name, tensor, _ in swapped:
                value = {**module._parameters, **module._buffers}[name]  # noqa: SLF001
                if isinstance(tensor, DTensor):
                    tensor.to_local().copy_(_local_part(value, tensor).to(tensor.device))
                else:
                    tensor.copy_(value.to(tensor.device))
                _put(module, name, tensor, like=tensor)


def _hf_order(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """Each submodule with the ``_initialize_weights`` that Hugging Face's ``initialize_weights``
    applies to it, in its order: children before parents, and a sub-model (a module with its own
    ``_initialize_weights``) initialises its own subtree."""
    order: list[tuple[torch.nn.Module, Any]] = []

    def visit(module: torch.nn.Module, fn: Any) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if _is_hf_model(child) else fn)  # noqa: SLF001
        order.append((module, fn))

    visit(model, model._initialize_weights)  # noqa: SLF001
    return order


#: Slots ``(id(module), name)`` holding a tied tensor another module created.
Borrowed = AbstractSet[tuple[int, str]]


def _reset(module: torch.nn.Module, borrowed_slots: Borrowed = frozenset()) -> None:
    """``module.reset_parameters()`` as an eager build ran it. A slot holding a tensor that
    another module created (``head.weight = embed.weight``) gets a scratch tensor meanwhile: in
    an eager build this module initialised its own tensor, drawing the same random numbers,
    and the tie then threw those values away, so the creator's values are the ones kept."""
    if not (_own_tensors(module) and callable(getattr(module, "reset_parameters", None))):
        return
    slots = {**module._parameters, **module._buffers}  # noqa: SLF001
    borrowed = {n: slots[n] for n in _own_tensors(module) if (id(module), n) in borrowed_slots}
    for name, tensor in borrowed.items():
        _put(module, name, torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu"), tensor)
    try:
        with _on_cpu([module], full=False):
            module.reset_parameters()
    finally:
        for name, tensor in borrowed.items():
            _put(module, name, tensor, like=tensor)


@contextlib.contextmanager
def recording_creators(into: dict[int, Any]) -> Iterator[None]:
    """While a model is built: which module each parameter and buffer was first registered
    on (its creator; a tie registers it again on another module), kept in ``into`` by the
    tensor's id (the tensor itself held too, so the id stays its own)."""
    from torch.nn.modules import module as module_mod

    def record(module: torch.nn.Module, name: str, tensor: Any) -> None:
        if tensor is not None and id(tensor) not in into:
            into[id(tensor)] = (tensor, module, name)

    handles = [
        module_mod.register_module_parameter_registration_hook(record),
        module_mod.register_module_buffer_registration_hook(record),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _is_hf_model(module: torch.nn.Module) -> bool:
    return callable(getattr(module, "_initialize_weights", None)) and callable(
        getattr(module, "_init_weights", None)
    )


def _replay_hugging_face(model: torch.nn.Module, borrowed: Borrowed) -> None:
    """A Hugging Face model's eager initialisation, in its order: each layer's
    ``reset_parameters()`` as it is built, and at the end of each (sub-)model's ``__init__`` its
    ``post_init``, which applies ``_init_weights`` to every module of it not initialised yet
    (``LlamaModel`` initialises its layers before ``LlamaForCausalLM`` builds ``lm_head``)."""
    custom = model.is_custom_code() if callable(getattr(model, "is_custom_code", None)) else False

    def visit(module: torch.nn.Module) -> None:
        _reset(module, borrowed)
        for child in module.children():
            visit(child)
        if _is_hf_model(module):
            for each, fn in _hf_order(module):
                if getattr(each, "_is_hf_initialized", False):
                    continue  # as post_init skips it (an inner post_init did it)
                with _on_cpu([each], full=True):
                    fn(each, custom)

    visit(model)


def materialize(
    model: torch.nn.Module,
    device: torch.device,
    rng_state: torch.Tensor | None,
    creators: dict[int, Any] | None = None,
    broadcast: Broadcast | None = None,
) -> None:
    """Allocate a meta-device model on ``device`` and initialise it in place (sharded
    parameters: only this rank's shard is kept; each module's full tensors live, on the CPU,
    only while it initialises): each module's ``reset_parameters()`` in module order, then the
    model's own initialisation (`own_init`), as an eager build runs them."""
    check_initialisable(model)
    how = own_init(model)
    ties = record_ties(model, creators)
    model.to_empty(device=device)
    restore_ties(ties)
    borrowed = {(id(module), name) for module, name, _, _ in ties}
    saved = torch.get_rng_state()
    if rng_state is not None:
        if broadcast is not None:  # every rank materialises rank 0's model, whatever it seeded
            rng_state = broadcast(rng_state.clone(), 0).cpu()
        torch.set_rng_state(rng_state)
    try:
        if how == "hf":
            _replay_hugging_face(model, borrowed)
        else:
            for module in model.modules():
                _reset(module, borrowed)
            if how == "init_weights":  # model-wide: the whole model on the CPU while it runs
                with _on_cpu(list(model.modules()), full=True):
                    model.init_weights()
    finally:
        if rng_state is not None:
            torch.set_rng_state(saved)


def record_ties(
    model: torch.nn.Module, creators: dict[int, Any] | None = None
) -> list[tuple[torch.nn.Module, str, torch.nn.Module, str]]:
    """Every slot holding a tensor another slot holds too (a tied embedding and head), with
    the slot it is tied to: the tensor's creator (``creators``, from
    `recording_creators`) where known, else the first slot in module order.
    ``to_empty``, and ``.to()`` onto a device whose tensors are of another kind (XLA), make each
    slot's tensor on its own and would untie them silently; `restore_ties` after.

    Args:
        model: The model whose slots are read.
        creators: Which slot created each tensor (by the tensor's id), where known.
    """
    slots_of: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for slots in (module._parameters, module._buffers):  # noqa: SLF001
            for name, tensor in slots.items():
                if tensor is not None:
                    slots_of.setdefault(id(tensor), []).append((module, name))
    ties = []
    for key, slots in slots_of.items():
        if len(slots) < 2:
            continue
        made = (creators or {}).get(key)
        owner = next(
            (s for s in slots if made is not None and s[0] is made[1] and s[1] == made[2]),
            slots[0],
        )
        ties += [(module, name, *owner) for module, name in slots if (module, name) != owner]
    return ties


def restore_ties(ties: list[tuple[torch.nn.Module, str, torch.nn.Module, str]]) -> None:
    """Tie again what `record_ties` recorded: each slot holds its owner's tensor once more.

    Args:
        ties: What `record_ties` returned.
    """
    for module, name, owner, owner_name in ties:
        slots = module._parameters if name in module._parameters else module._buffers  # noqa: SLF001
        held = owner._parameters if owner_name in owner._parameters else owner._buffers  # noqa: SLF001
        slots[name] = held[owner_name]


def _local_part(full: torch.Tensor, like: Any) -> torch.Tensor:
    """This rank's piece of ``full`` as ``like`` (a DTensor) places it: a view where torch
    says where it lies (no copy: the full tensor is the largest thing alive), else cut by
    ``distribute_tensor``."""
    try:
        shape, offset = torchprivate.local_block(like)
    except ImportError:  # a torch without it: a copy of the piece
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(
            full, like.device_mesh, like.placements, src_data_rank=None
        ).to_local()
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def _put(module: torch.nn.Module, name: str, value: torch.Tensor, like: torch.Tensor) -> None:
    if name in module._parameters:  # noqa: SLF001
        if not isinstance(value, torch.nn.Parameter):
            value = torch.nn.Parameter(value, requires_grad=like.requires_grad)
        module._parameters[name] = value  # noqa: SLF001
    else:
        module._buffers[name] = value  # noqa: SLF001


class MetaBuild:
    """What ``engine.init_module(empty=True)`` recorded, for ``setup`` to materialise: the RNG
    state when the build began and which module made each meta tensor."""

    def __init__(self) -> None:
        self.rng: torch.Tensor | None = None
        self.creators: dict[int, Any] = {}

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Build on the meta device, recording what `materialize` needs."""
        self.rng = torch.get_rng_state()
        with torch.device("meta"), recording_creators(self.creators):
            yield

    def materialize(
        self, model: torch.nn.Module, device: torch.device, broadcast: Broadcast | None
    ) -> None:
        """`materialize` ``model`` on ``device`` with what the build recorded."""
        materialize(model, device, self.rng, self.creators, broadcast)
