"""A model cut into pipeline stages: traced once per input shape, each trace pointed at the
user's own parameters, and the rank's share of the model kept (the rest freed).

Why tracing (torch's ``pipeline()`` tracer, torch.export) and not a model-specific split: it
cuts any exportable forward at module names (``layers.4``) with the code between modules (an
embedding sum, a rotary table, a mask) on the stage that runs it, and it keeps each parameter's
original name, so a stage's state is the model's own and a checkpoint moves to any strategy.
A traced graph is specialised to its input shapes, so a batch of another shape (an epoch's short
last batch, evaluation) is traced again; the other stages' parameters are materialised empty for
that trace only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from torchplug.plugin import ConfigurationError
from torchplug.plugins.pipeline.parallel import StageModule

#: ``Stages.owner``'s answer for a name no rank holds (not traced yet: every rank has it all).
EVERYWHERE = -1


def stage_indices(pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs, looping: ``r, r + pp, ...``."""
    return [pp_rank + k * pp for k in range(per_rank)]


def even_split_points(model: torch.nn.Module, stages: int) -> list[str]:
    """Split points cutting the longest ``ModuleList``/``Sequential`` of blocks into ``stages``
    runs of (nearly) equal length, e.g. ``["layers.4"]`` for 8 layers and 2 stages."""
    best, blocks = "", 0
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and len(module) > blocks:
            best, blocks = name, len(module)
    if blocks < stages:
        raise ConfigurationError(
            f"pp needs {stages} stages, but the model's longest ModuleList/Sequential has "
            f"{blocks} blocks. Give split_points (module names to cut before, e.g. "
            f"split_points=['layers.4']) or fewer stages (pp_size, stages_per_rank)."
        )
    prefix = f"{best}." if best else ""
    return [f"{prefix}{(i * blocks) // stages}" for i in range(1, stages)]


def checked_points(model: torch.nn.Module, points: list[str], stages: int, why: str) -> list[str]:
    """``points`` (or an even split when empty), each a submodule of ``model``, one fewer than
    ``stages``; else an error naming the fix."""
    points = points or even_split_points(model, stages)
    if len(points) != stages - 1:
        raise ConfigurationError(
            f"pp with {why} needs {stages - 1} split points; split_points gives "
            f"{len(points)}: {points}. Give {stages - 1} module names, or leave split_points "
            f"out for an even split of the model's blocks."
        )
    for name in points:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ConfigurationError(
                f"split point {name!r} is not a submodule of {type(model).__name__}. Give "
                f"module names as model.named_modules() lists them, e.g. 'layers.4'."
            ) from None
    return points


def shapes(value: Any) -> Any:
    """A hashable description of the tensors' shapes and dtypes in nested inputs."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(shapes(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, shapes(v)) for k, v in sorted(value.items()))
    return repr(value)


def batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The first dimension of the first tensor input (what torch splits into micro-batches)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None


def without_metadata_asserts(graph: torch.nn.Module) -> None:
    """Drop the dtype/shape checks torch.export puts after ``.to()`` calls
    (``aten._assert_tensor_metadata``) from a traced stage: they check the trace's own
    metadata, and DTensor has no sharding rule for them, so a tensor-parallel stage would
    fail on the first one (an RMSNorm's ``.to(float32)``)."""
    target = torch.ops.aten._assert_tensor_metadata.default  # noqa: SLF001
    for module in graph.modules():  # GraphModules, and export's InterpreterModules
        fx_graph = getattr(module, "graph", None)
        if not isinstance(fx_graph, torch.fx.Graph):
            continue
        asserts = [node for node in fx_graph.nodes if node.target is target]
        for node in asserts:
            fx_graph.erase_node(node)
        if asserts and isinstance(module, torch.fx.GraphModule):
            module.recompile()


def keep_traced_dtypes(stage: Any) -> None:
    """Send each of ``stage``'s outputs in the dtype the trace recorded. The trace runs outside
    autocast, the steps under it: a stage ending in a Linear would otherwise send bf16 into the
    next stage's fp32 receive buffer, which gloo fills with half the bytes it expects (garbage,
    then inf). The cast is part of the graph, so gradients come back in the traced dtype too."""
    run = stage.forward_maybe_with_nosync

    def forward(*args: Any, **kwargs: Any) -> Any:
        output = run(*args, **kwargs)
        metas = None if stage.is_last else stage._stage_meta.outputs  # noqa: SLF001
        if not metas:
            return output
        outputs = output if isinstance(output, tuple) else (output,)
        cast = tuple(
            out.to(meta.dtype)
            if isinstance(out, torch.Tensor) and meta is not None and out.dtype != meta.dtype
            else out
            for out, meta in zip(outputs, metas, strict=False)
        )
        return cast if isinstance(output, tuple) else cast[0]

    stage.forward_maybe_with_nosync = forward


def allow_skips(stage: Any) -> None:
    """Let ``stage`` hand values to stages further on than the next, or take them from stages
    further back, when those values need no gradient (a rotary table, a mask: what the code
    before the first block computes once for every block). torch's traced stages assume every
    floating value needs one and refuse such skips ("Backward of skip connections not supported
    yet"); here they are marked gradient-free on both sides, and a skipped value that does need
    a gradient is refused when it is produced, never dropped silently."""
    index, skipped = stage.stage_index, []
    receive, send = stage._create_act_recv_info, stage._create_act_send_info  # noqa: SLF001

    def users(node: Any) -> set[int]:
        calls = [user for user in node.users if user.op == "call_module"]
        return {stage.submod_to_stage_index[user.name] for user in calls}

    def act_recv_info() -> Any:
        infos = receive()
        for info, node in zip(infos, stage.node.args, strict=True):  # 1:1, as torch makes them
            skip = not info.is_root_arg and users(node) != {info.source + 1}
            if skip and info.tensor_meta is not None:
                info.tensor_meta = dataclasses.replace(info.tensor_meta, requires_grad=False)
        if not stage.is_first:  # the model's own inputs come by name (`take_own_inputs`)
            infos = tuple(info for info in infos if not info.is_root_arg)
        return infos

    def act_send_info() -> Any:
        sends = send()
        metas = list(stage._stage_meta.outputs)  # noqa: SLF001
        for out, destinations in sends.items():
            if any(d != index + 1 for d in destinations) and metas[out] is not None:
                metas[out] = dataclasses.replace(metas[out], requires_grad=False)
                skipped.append(out)
        stage._stage_meta.outputs = tuple(metas)  # noqa: SLF001
        return sends

    def check(module: torch.nn.Module, args: Any, output: Any) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for out in skipped:
            if torch.is_grad_enabled() and getattr(outputs[out], "requires_grad", False):
                raise ConfigurationError(
                    f"pp: stage {index} hands output {out}, which needs a gradient, to a stage "
                    f"other than the next; torch's pipelining sends gradients between adjacent "
                    f"stages only. Move the split points so that the value is used within one "
                    f"stage or the next (split_points), or use fewer stages."
                )

    stage._create_act_recv_info, stage._create_act_send_info = act_recv_info, act_send_info  # noqa: SLF001
    stage.submod.register_forward_hook(check)


def take_own_inputs(stage: Any) -> None:
    """Let every stage take the model's inputs it reads, by name: the schedule hands every
    stage the batch's inputs by name (each rank of a pipeline has the batch), while torch gives
    only the first stage the model's inputs (a mask the last block applies would never reach the
    last stage) and a stage's code takes only what it reads; a non-tensor input
    (``temperature=2.0``) is a constant of the trace. The stage is then called positionally:
    each of its inputs by name when the model's, else the next activation received."""
    names = [n.target for n in stage.submod.graph.nodes if n.op == "placeholder"]

    def own(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        received = iter(args)
        return tuple(kwargs[n] if n in kwargs else next(received) for n in names), {}

    stage.submod.register_forward_pre_hook(own, with_kwargs=True)


def by_name(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The model's inputs by its forward's parameter names (what the trace names them), for the
    stages after the first; ``kwargs`` alone when the forward takes ``*args``."""
    import inspect

    signature = inspect.signature(model.forward)
    if any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values()):
        return dict(kwargs)
    bound = signature.bind_partial(*args, **kwargs).arguments
    extra = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    if extra is not None and extra in bound:
        bound = {**{k: v for k, v in bound.items() if k != extra}, **bound[extra]}
    return dict(bound)


class Stages:
    """One model's stages on this rank, and which pipeline rank holds each state name.

    Args:
        model: The user's model (split points annotated).
        pp_rank: This rank's place in its pipeline.
        pp: The pipeline's length (ranks).
        per_rank: Stages each rank runs.
        group: The pipeline's process group.
        device: Where this rank computes.
        parallel: Applied to each of this rank's stages as a `StageModule` (tensor parallel,
            FSDP2) after the first trace; ``None``: the stages run the user's tensors as they are.
        tp_mesh: The tensor-parallel mesh a `StageModule` computes over, if any.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pp_rank: int,
        pp: int,
        per_rank: int,
        group: Any,
        device: torch.device,
        parallel: Callable[[StageModule], None] | None = None,
        tp_mesh: Any = None,
    ) -> None:
        self.model, self.pp_rank, self.pp, self.per_rank = model, pp_rank, pp, per_rank
        self.group, self.device = group, device
        self.parallel, self.tp_mesh = parallel, tp_mesh
        self.modules: dict[int, StageModule] = {}  # stage index -> its parameters' holder
        self.module_ids: dict[int, set[int]] = {}  # stage index -> ids of the trace's tensors
        self.replaced: dict[int, tuple[torch.Tensor, torch.nn.Parameter]] = {}  # id -> old, new
        self.layout = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
        # every tensor's, non-persistent buffers too (a rotary table): what a trace rebuilds
        self.shapes = {n: (t.shape, t.dtype) for n, t in self.tensors()}
        self.owned: dict[int, torch.Tensor] = {}  # id -> a parameter or buffer this rank keeps
        self.holders: dict[str, list[int]] = {}  # state name -> pipeline ranks holding it
        self.traced: dict[Any, list[Any]] = {}

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every (name, tensor) of the user's model, tied names included."""
        return [
            *self.model.named_parameters(remove_duplicate=False),
            *self.model.named_buffers(remove_duplicate=False),
        ]

    def owner(self, name: str) -> int:
        """The lowest pipeline rank holding ``name`` (`EVERYWHERE` before the first trace)."""
        held = self.holders.get(name)
        return held[0] if held else EVERYWHERE

    def held_here(self, tensor: torch.Tensor) -> bool:
        """Whether this rank keeps ``tensor`` (every tensor, before the first trace)."""
        return not self.owned or id(tensor) in self.owned

    def params(self) -> list[torch.nn.Parameter]:
        """This rank's parameters, one per tensor."""
        return [p for p in self.model.parameters() if self.held_here(p)]

    def shared(self) -> list[str]:
        """Parameters (one name each) held on several pipeline ranks: tied across stages."""
        ranks: dict[int, set[int]] = {}
        for name, tensor in self.tensors():
            ranks.setdefault(id(tensor), set()).update(self.holders.get(name, ()))
        return [n for n, p in self.model.named_parameters() if len(ranks.get(id(p), ())) > 1]

    def get(self, args: tuple[Any, ...], kwargs: dict[str, Any], train: bool, n: int) -> list[Any]:
        """This rank's stages for batches shaped like ``args``/``kwargs`` in ``n`` micro-batches
        (traced once per shape and mode)."""
        key = (train, self.model.training, shapes(args), shapes(kwargs), n)
        if key not in self.traced:
            self.traced[key] = self._trace(args, kwargs, n)
        return self.traced[key]

    def _trace(self, args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Any]:
        from torch.distributed.pipelining import microbatch
        from torch.distributed.pipelining._IR import Pipe

        chunks_args, chunks_kwargs = microbatch.split_args_kwargs_into_chunks(args, kwargs, n)
        first = not self.owned
        with self._everything_present():
            try:
                pipe = Pipe.from_tracing(self.model, tuple(chunks_args[0]), chunks_kwargs[0])
            except Exception as exc:
                raise ConfigurationError(
                    f"pp could not trace {type(self.model).__name__} into stages with "
                    f"torch.export: {str(exc).splitlines()[0]} A Hugging Face model traces "
                    f"with config.use_cache=False; otherwise make the forward exportable "
                    f"(no data-dependent control flow), or use another strategy."
                ) from exc
            indices = stage_indices(self.pp_rank, self.pp, self.per_rank)
            stages = [pipe.build_stage(i, self.device, self.group) for i in indices]
            del pipe
        for stage in stages:
            self._adopt(stage.submod)
            allow_skips(stage)
            keep_traced_dtypes(stage)
            take_own_inputs(stage)
        if first:
            self._own(stages)
        if self.parallel is not None:
            self._hold(stages, first)
        return stages

    def activate(self, stages: list[Any]) -> None:
        """Make ``stages`` (one trace) the ones their `StageModule` runs."""
        for stage in stages:
            if isinstance(stage.submod, StageModule):
                stage.submod.use(stage.torchplug_trace)

    def _hold(self, stages: list[Any], first: bool) -> None:
        """Each stage's tensors in a `StageModule` (made at the first trace, ``parallel``
        applied to it, its new parameters put in the user's model under their names), which
        the stage then calls with the trace's graph."""
        for stage in stages:
            graph = stage.submod
            if first:
                self._make_module(stage.stage_index, graph)
            module = self.modules[stage.stage_index]
            names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
            for name in names:  # the trace's own references to parameters, freed
                prefix, _, leaf = name.rpartition(".")
                owner = graph.get_submodule(prefix) if prefix else graph
                if leaf in dict(owner.named_parameters(recurse=False, remove_duplicate=False)):
                    owner.register_parameter(leaf, torch.nn.Parameter(torch.empty(0), False))
            if self.tp_mesh is not None:
                without_metadata_asserts(graph)
            stage.torchplug_trace, stage.submod = graph, module
            module.use(graph)

    def _make_module(self, index: int, graph: torch.nn.Module) -> None:
        named = [
            *graph.named_parameters(remove_duplicate=False),
            *graph.named_buffers(remove_duplicate=False),
        ]
        ids = {id(t) for _, t in named}
        names = {n for n, _ in named}
        mine = [(n, t) for n, t in self.tensors() if n in names and id(t) in ids]
        twice = [n for n, t in mine if any(id(t) in m for m in self.module_ids.values())]
        if twice:
            raise ConfigurationError(
                f"pp: {twice[0]} is used by two stages this rank runs, and sharding a stage "
                f"(dp_shard, tp_size) holds each stage's parameters apart. Choose split points "
                f"that keep tied parameters within one stage or on different ranks, or use "
                f"stages_per_rank=1."
            )
        module = StageModule(mine, self.tp_mesh)
        self.module_ids[index] = ids
        olds = {n: t for n, t in mine if isinstance(t, torch.nn.Parameter)}
        assert self.parallel is not None
        self.parallel(module)
        for name, new in module.named_parameters(remove_duplicate=False):
            old = olds[name]
            self.replaced[id(old)] = (old, new)
            self.owned.pop(id(old), None)
            self.owned[id(new)] = new
        for name, param in list(self.model.named_parameters(remove_duplicate=False)):
            if id(param) in self.replaced:  # every name of it (a tie the stage names once)
                prefix, _, leaf = name.rpartition(".")
                self.model.get_submodule(prefix).register_parameter(
                    leaf, self.replaced[id(param)][1]
                )
        self.modules[index] = module

    @contextlib.contextmanager
    def _everything_present(self) -> Iterator[None]:
        """Stand-ins of their shapes for the tensors the trace cannot use as they are (other
        stages' freed tensors, this rank's sharded DTensors), for a trace only."""
        from torch.distributed.tensor import DTensor

        stand_ins: dict[int, torch.Tensor] = {}
        swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        for prefix, module in self.model.named_modules(remove_duplicate=False):
            for slots in (getattr(module, kind) for kind in ("_parameters", "_buffers")):
                for leaf, tensor in list(slots.items()):
                    if tensor is None or (
                        self.held_here(tensor) and not isinstance(tensor, DTensor)
                    ):
                        continue
                    if id(tensor) not in stand_ins:
                        shape, dtype = self.shapes[f"{prefix}.{leaf}" if prefix else leaf]
                        empty = torch.empty(shape, dtype=dtype, device=self.device)
                        if isinstance(tensor, torch.nn.Parameter):
                            empty = torch.nn.Parameter(empty, tensor.requires_grad)
                        stand_ins[id(tensor)] = empty
                    swapped.append((slots, leaf, tensor))
                    slots[leaf] = stand_ins[id(tensor)]
        try:
            yield
        finally:
            for slots, leaf, tensor in reversed(swapped):
                slots[leaf] = tensor

    def _adopt(self, stage_module: torch.nn.Module) -> None:
        """Point a traced stage at the user's own parameters and buffers by name (the tracer
        copies tied ones), so there is one tensor per name whatever the trace."""
        for kind, getter in (("_parameters", "get_parameter"), ("_buffers", "get_buffer")):
            for module_name, module in stage_module.named_modules():
                slots = getattr(module, kind)
                for leaf in list(slots):
                    name = f"{module_name}.{leaf}" if module_name else leaf
                    with contextlib.suppress(AttributeError):  # a constant the tracer made
                        slots[leaf] = getattr(self.model, getter)(name)

    def _own(self, stages: list[Any]) -> None:
        """After the first trace: what this rank keeps and who holds each name; every other
        tensor of the user's model freed (emptied in place, so its slot stays). A tensor the
        trace did not use (an expert no input was routed to) is in no stage: the first
        pipeline rank keeps it, so that checkpoints still hold it."""
        ids = {id(t) for _, t in self.tensors()}
        for stage in stages:
            for tensor in (*stage.submod.parameters(), *stage.submod.buffers()):
                if id(tensor) in ids:
                    self.owned[id(tensor)] = tensor
        kept = sorted({n for n, t in self.tensors() if id(t) in self.owned})
        everyone: list[Any] = [None] * self.pp
        dist.all_gather_object(everyone, kept, group=self.group)
        for pp_rank, held in enumerate(everyone):
            for name in held:
                self.holders.setdefault(name, []).append(pp_rank)
        for name, tensor in self.tensors():
            if name not in self.holders:
                self.holders[name] = [0]
                if self.pp_rank == 0:
                    self.owned[id(tensor)] = tensor
        for _, tensor in self.tensors():
            if id(tensor) not in self.owned:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)

    def prune(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` (made on the whole model) left with this rank's parameters, those a
        `StageModule` replaced swapped for their replacements (state sharded alike)."""
        for group in optimizer.param_groups:
            group["params"] = [
                self.replaced[id(p)][1] if id(p) in self.replaced else p
                for p in group["params"]
                if id(p) in self.replaced or self.held_here(p)
            ]
        for p in list(optimizer.state):
            state = optimizer.state.pop(p)
            if id(p) in self.replaced:
                new = self.replaced[id(p)][1]
                optimizer.state[new] = {k: like(v, new) for k, v in state.items()}
            elif self.held_here(p):
                optimizer.state[p] = state


def like(value: Any, param: torch.Tensor) -> Any:
    """``value`` (optimizer state of a whole parameter) cut as ``param`` is sharded, if it is
    a DTensor and ``value`` has its whole shape; else ``value``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if (
        isinstance(param, DTensor)
        and isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.shape == param.shape
    ):
        return distribute_tensor(
            value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        )
    return value
