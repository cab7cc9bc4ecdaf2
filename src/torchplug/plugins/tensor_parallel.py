"""``tp`` and ``fsdp-tp``: tensor parallelism (torch's ``parallelize_module``) on a DeviceMesh,
alone or with FSDP2 over the data-parallel dimension (2-D parallelism).

The mesh has named dims ``("dp", "tp")``; rank ``r`` sits at ``(r // tp, r % tp)``, so a
tensor-parallel group is ``tp`` consecutive ranks (one node's GPUs, where TP's frequent
collectives are cheapest). It is built once, when the Engine starts (``engine.mesh``); every
``engine.setup`` of the job splits and shards over it. Ranks of one ``tp`` group see the same
batches: ``engine.setup_dataloader`` shards over ``dp`` only. ``engine.reduce``/``gather`` cover
every rank (the ``tp`` ranks of a group hold equal losses, so a mean is unchanged).

The plan says which submodules are split, by name pattern (``parallelize_module``'s syntax,
``*`` matches one name): ``{"layers.*.attn.q": "colwise", "layers.*.attn.o": "rowwise"}``, with
torch ``ParallelStyle`` objects allowed as values, or a callable ``plan(model, tp_mesh)`` that
parallelises the model itself and returns it. It comes from the ``tp_plan`` option, else from the
model's own ``tp_plan`` (or ``_tp_plan``) attribute, so a script can run unchanged under every
strategy.

``TensorParallelStrategy`` is a ``DistributedStrategy`` of its own; what it shares with ``fsdp``
(applying FSDP2 over ``dp``, finishing a sharded wrap) is in `torchplug.plugins.sharding`.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torchplug.plugin import (
    DEFAULT_TIMEOUT,
    ClusterInfo,
    ConfigurationError,
    DistributedStrategy,
    HookContext,
    MemoryEstimate,
    MemoryQuery,
    NotEstimable,
    Option,
    Runtime,
    StrategyInfo,
    UnusedParameters,
    clip_largest,
    compile_units,
    finish_wrap,
    fully_shard_kwargs,
    gpu_check,
    hookimpl,
    job_mesh,
    model_tp_plan,
    not_estimable,
    plan_matches,
    plan_split,
    refuse_sharded_twice,
    shard,
    with_mesh,
    without_gradient_sync,
)

STYLES = ("colwise", "rowwise", "sequence")
#: Why ``torchplug estimate-memory`` gives no numbers for ``fsdp-tp``.
TWO_D_NOT_MODELLED = (
    "2-D sharding (FSDP2 over the tensor-parallel shards) is not modelled; estimate 'tp' with "
    "-n TP_SIZE and 'fsdp' with -n DP_SIZE, or measure with torchplug.features.memory.count_live"
)

#: Hugging Face's plan strings (``model._tp_plan``, ``config.base_model_tp_plan``) that map onto
#: torch's own styles, with the layouts transformers gives them; "replicate" leaves a module whole.
HF_STYLES = (
    "colwise_gather_output",
    "colwise_rep",
    "rowwise_split_input",
    "rowwise_rep",
    "embedding_rowwise",
    "embedding_colwise",
    "sequence_parallel",
    "replicate",
)

#: Styles torch applies to these layer types only (``ColwiseParallel currently only support
#: nn.Linear and nn.Embedding``): checked before torch, so the error names the layer.
_LINEAR_STYLES = {"colwise", "rowwise", *(s for s in HF_STYLES if s.startswith(("col", "row")))}


def _style(name: str, value: Any) -> Any:
    """The torch ParallelStyle for one plan entry (``None``: leave the module whole)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
    )

    if isinstance(value, ParallelStyle):
        return value
    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "sequence": SequenceParallel,
        "sequence_parallel": SequenceParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
        "replicate": lambda: None,
    }
    if isinstance(value, str) and value in styles:
        return styles[value]()
    raise ConfigurationError(
        f"tp_plan[{name!r}] is {value!r}; expected one of {', '.join(STYLES)}, one of Hugging "
        f"Face's {', '.join(HF_STYLES)}, or a torch ParallelStyle (e.g. "
        f"ColwiseParallel(use_local_output=False))."
    )


def _unsplittable(model: torch.nn.Module, given: dict[str, Any], hits: dict[str, list[str]]) -> str:
    """What is wrong when a colwise/rowwise entry matches a layer torch cannot split that way
    (GPT-2's ``Conv1D``, a custom projection), or ``""``."""
    modules = dict(model.named_modules())
    for pattern, names in hits.items():
        if not (isinstance(given[pattern], str) and given[pattern] in _LINEAR_STYLES):
            continue
        for name in names:
            layer = modules[name]
            if not isinstance(layer, (torch.nn.Linear, torch.nn.Embedding)):
                return (
                    f"tp_plan[{pattern!r}] = {given[pattern]!r} matches {name}, a "
                    f"{type(layer).__name__} ({type(layer).__module__}); torch's colwise/"
                    f"rowwise styles split nn.Linear and nn.Embedding only. Replace those layers "
                    f"with nn.Linear (Hugging Face's Conv1D holds the transposed weight: "
                    f"nn.Linear(nx, nf) with weight = conv1d.weight.t()), or pass a callable "
                    f"plan(model, tp_mesh) that splits them, or use 'fsdp' for this model."
                )
    return ""


class TensorParallelStrategy(DistributedStrategy):
    """Tensor parallel over ``tp``; with ``fsdp=True`` also FSDP2 over ``dp``."""

    def __init__(
        self,
        process_group_backend: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        tp_plan: dict[str, Any] | Callable[..., Any] | None = None,
        tp_size: int | None = None,
        dp_size: int | None = None,
        shard_classes: list[str] | tuple[str, ...] = (),
        reshard_after_forward: bool = True,
        fsdp: bool = True,
        reduce_scatter_unused_params: bool = False,
        dp_replicate: int = 1,
    ) -> None:
        super().__init__(process_group_backend, timeout)
        self.dp_replicate = dp_replicate
        self.unused = UnusedParameters(reduce_scatter_unused_params)
        self.shard_classes = tuple(shard_classes)
        self.reshard_after_forward = reshard_after_forward
        self.tp_plan = tp_plan
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.fsdp = fsdp
        self.name = "fsdp-tp" if fsdp else "tp"
        self.units: list[torch.nn.Module] | None = None
        self.dp_dims: tuple[str, ...] = ("dp",)

    def _sizes(self, world: int, local_world: int) -> tuple[int, int]:
        tp, dp = self.tp_size, self.dp_size
        if world == 1 and (tp or 1) * (dp or 1) != 1:
            # python train.py on a script written for many ranks: run it, as every strategy does
            warnings.warn(
                f"{self.name} with dp_size={dp}, tp_size={tp} runs in a single process here: "
                f"using dp_size=1, tp_size=1. Start it with torchplug launch -n "
                f"{(tp or 1) * (dp or 1)} for the sizes you asked for.",
                stacklevel=4,
            )
            return 1, 1
        if not self.fsdp:
            if dp not in (None, 1) or tp not in (None, world):
                raise ConfigurationError(
                    f"'tp' uses every rank for tensor parallelism (tp_size={world}); got "
                    f"tp_size={tp}, dp_size={dp}. Use strategy 'fsdp-tp' to combine it with "
                    f"data parallelism."
                )
            return 1, world
        if tp is None and dp is None:
            tp = max(1, min(local_world, world))  # TP within a node, FSDP across nodes
        if tp is None:
            tp = world // dp if dp and world % dp == 0 else 0
        if dp is None:
            dp = world // tp if tp and world % tp == 0 else 0
        if not tp or not dp or tp * dp != world:
            raise ConfigurationError(
                f"fsdp-tp needs dp_size × tp_size = the world size ({world}); got dp_size="
                f"{self.dp_size}, tp_size={self.tp_size}. Pass sizes that multiply to {world}, "
                f"e.g. Engine('fsdp-tp', dp_size={world // _divisor(world)}, "
                f"tp_size={_divisor(world)}) or torchplug launch --option "
                f"tp_size={_divisor(world)}."
            )
        return dp, tp

    @hookimpl
    def torchplug_setup(self, engine: HookContext, cluster: ClusterInfo) -> Runtime:
        """The process group, then the job's 2-D mesh ``("dp", "tp")`` (1 × 1 in one process),
        or with ``dp_replicate=R`` (HSDP × tp) the 3-D ``("dp_replicate", "dp_shard", "tp")``;
        loaders shard over the data-parallel dims only."""
        if self.tp_plan is not None:
            _check_plan_type(self.tp_plan)
        self.dp, self.tp = self._sizes(cluster.world_size, cluster.local_world_size)
        r = self.dp_replicate if self.dp > 1 else 1
        if r < 1 or self.dp % r:
            raise ConfigurationError(
                f"fsdp-tp's dp_replicate={self.dp_replicate} does not divide the {self.dp} "
                f"data-parallel ranks (dp_size) into equal shard groups. Give a divisor of "
                f"dp_size (e.g. dp_replicate=2 with dp_size=4: 2 replicas of 2 shards)."
            )
        runtime = super().torchplug_setup(engine, cluster)
        shape, names = ((self.dp, self.tp), ("dp", "tp"))
        if r > 1:
            shape, names = (r, self.dp // r, self.tp), ("dp_replicate", "dp_shard", "tp")
        self.dp_dims = names[:-1]  # fully_shard's mesh: 1-D (FSDP) or 2-D (HSDP)
        return with_mesh(
            runtime,
            shape,
            names,
            data_parallel_rank=runtime.rank // self.tp,
            data_parallel_size=self.dp,
        )

    @hookimpl
    def torchplug_wrap(
        self, engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        from torch.distributed.tensor.parallel import parallelize_module

        refuse_sharded_twice(model, engine.strategy)
        names = {id(p): name for name, p in model.named_parameters()}
        if not any(p.is_meta for p in model.parameters()):
            model = model.to(engine.device)
        mesh = job_mesh(engine)
        given = self.tp_plan
        if given is None:  # the model's own plan, as Hugging Face models carry one
            given = model_tp_plan(model)
        if given is None:
            raise ConfigurationError(
                f"'{self.name}' needs a tensor-parallel plan: which submodules to split. Pass "
                f"Engine('{self.name}', tp_plan={{'layers.*.up': 'colwise', 'layers.*.down': "
                f"'rowwise'}}) (or a callable plan(model, tp_mesh)), or give the model a "
                f"tp_plan attribute, so the script runs unchanged under every strategy."
            )
        _check_plan_type(given)
        if not callable(given) and not given:
            where = "tp_plan={}" if self.tp_plan is not None else "its own tp plan (_tp_plan)"
            raise ConfigurationError(
                f"'{self.name}' was given an empty tensor-parallel plan for "
                f"{type(model).__name__} ({where}): nothing would be split, and every rank would "
                f"hold and compute the whole model. Pass Engine('{self.name}', tp_plan={{...}}) "
                f"naming the layers to split (e.g. {{'h.*.mlp.up': 'colwise', 'h.*.mlp.down': "
                f"'rowwise'}}), or use 'fsdp' / 'ddp' for this model."
            )
        if callable(given):
            model = given(model, mesh["tp"]) or model
        else:
            plan = {name: _style(name, value) for name, value in given.items()}
            hits = _check_plan(model, plan)
            problem = _unsplittable(model, given, hits)
            if problem:
                raise ConfigurationError(problem)
            plan = {name: style for name, style in plan.items() if style is not None}
            if not plan:
                raise ConfigurationError(
                    f"Every entry of the tensor-parallel plan for {type(model).__name__} is "
                    f"'replicate': nothing would be split. Name at least one layer to split "
                    f"('colwise'/'rowwise'), or use 'fsdp' / 'ddp' for this model."
                )
            unmatched = [k for k, found in hits.items() if not found]
            if unmatched:
                raise ConfigurationError(
                    f"tp_plan entries {unmatched} match no submodule of "
                    f"{type(model).__name__} (of {sorted(hits)}). Submodule names look like "
                    f"{[n for n, _ in model.named_modules() if n][:6]}; '*' stands for one "
                    f"name, e.g. 'layers.*.up'."
                )
            parallelize_module(model, mesh["tp"], plan)
        if self.fsdp:
            kwargs = fully_shard_kwargs(engine, mesh[self.dp_dims], self.reshard_after_forward)
            self.units = shard(model, kwargs, self.shard_classes, 0)
            self.unused.watch(model)
        return finish_wrap(engine, model, optimizers, names, self.name)

    @hookimpl(wrapper=True)
    def torchplug_backward(
        self, engine: HookContext, loss: torch.Tensor, model: torch.nn.Module | None
    ) -> Any:
        """Ranks that used different parameters: refused before the step (`UnusedParameters`;
        ``fsdp-tp`` only: the ranks of one ``tp`` group see the same data)."""
        result = yield
        self.unused.check(engine)
        return result

    @hookimpl
    def torchplug_compile(
        self, engine: HookContext, model: torch.nn.Module, options: dict[str, Any]
    ) -> torch.nn.Module:
        """Each FSDP unit compiled on its own (``fsdp-tp``), else the model."""
        return compile_units(engine, model, self.units, options)

    @hookimpl
    def torchplug_clip_grad_norm(
        self,
        engine: HookContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        norm_type: float,
    ) -> torch.Tensor:
        """The norm over every parameter's full gradient: sharded (DTensor) gradients reduce
        their norms across both mesh dims, replicated ones count once."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if math.isinf(norm_type):  # torch's inf-norm refuses a rank whose shards are empty
            return clip_largest(grads, max_norm, engine.reduce)
        norms = []
        for grad in grads:
            norm = torch.linalg.vector_norm(grad.detach(), norm_type)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if not norms:
            return torch.zeros(())
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.detach().mul_(coef.to(grad.device))
        return total

    @hookimpl
    def torchplug_no_sync(
        self, engine: HookContext, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[None]:
        if not self.fsdp:
            return contextlib.nullcontext()  # one data-parallel replica: nothing to synchronise
        return self.unused.not_syncing(without_gradient_sync(model))


def _check_plan_type(plan: Any) -> None:
    if not (callable(plan) or isinstance(plan, dict)):
        raise ConfigurationError(
            f"tp_plan must be a dict of name pattern -> style or a callable, got "
            f"{type(plan).__name__}."
        )
    if isinstance(plan, dict):
        for name, value in plan.items():
            _style(name, value)  # a bad style fails before any process group exists


def _divisor(world: int) -> int:
    """A tensor-parallel size to suggest: the largest power of two up to sqrt(world)."""
    size = 1
    while world % (size * 2) == 0 and (size * 2) ** 2 <= world:
        size *= 2
    return size


def _check_plan(model: torch.nn.Module, plan: dict[str, Any]) -> dict[str, list[str]]:
    """The submodule names each pattern of the plan matches (`plan_matches`)."""
    names = [n for n, _ in model.named_modules() if n]
    return {pattern: [n for n in names if plan_matches(n, pattern)] for pattern in plan}


def tp_memory(query: MemoryQuery) -> MemoryEstimate:
    """``tp``'s per-rank bytes from the plan (``tp_plan`` option, else the model's own): torch's
    colwise splits a Linear's weight and bias on dim 0 (an Embedding's weight on dim 1), rowwise
    a Linear's weight on dim 1 (an Embedding's on dim 0) and leaves its bias whole; rank 0 holds
    ``ceil(size / ranks)`` of a split dim. Everything else stays whole on every rank."""
    plan = query.options.get("tp_plan") or query.model_tp_plan
    if plan is None:
        raise NotEstimable(
            'no tensor-parallel plan: pass --strategy tp --option \'tp_plan={"layers.*.up": '
            '"colwise", ...}\', or give the model a tp_plan attribute'
        )
    if not isinstance(plan, dict):
        raise NotEstimable("a callable tp_plan: which weights it splits is its own")
    w = query.world_size
    params = state = 0
    for p in query.params:
        owner, _, leaf = p.name.rpartition(".")
        style = next((v for pattern, v in plan.items() if plan_matches(owner, pattern)), None)
        split = plan_split(style)
        dim = None
        if split is not None and p.module == "Embedding" and leaf == "weight":
            dim = 1 if split == "col" else 0
        elif split == "col":
            dim = 0
        elif split == "row" and leaf == "weight":
            dim = 1
        numel = p.numel
        if dim is not None and dim < len(p.shape) and p.shape[dim]:
            numel = numel // p.shape[dim] * -(-p.shape[dim] // w)
        params += numel * p.itemsize
        state += query.states * numel * p.itemsize
    steps = query.step_bytes * len(query.params) if query.states else 0
    return MemoryEstimate(params, params, state + steps)


def _factory(fsdp: bool) -> Callable[..., TensorParallelStrategy]:
    def factory(**options: Any) -> TensorParallelStrategy:
        return TensorParallelStrategy(fsdp=fsdp, **options)

    return factory


@hookimpl
def torchplug_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    plan = Option(
        "tp_plan",
        (dict, type(None), Callable),
        None,
        "submodule name pattern -> 'colwise'/'rowwise'/'sequence' (or a ParallelStyle), "
        "or a callable plan(model, tp_mesh)",
    )
    register(
        StrategyInfo(
            name="tp",
            aliases=("tensor-parallel",),
            factory=_factory(False),
            description="Tensor parallelism over every rank (torch parallelize_module).",
            memory=tp_memory,
            options=(*DistributedStrategy.strategy_options(), plan),
            precisions=("32",),
            owns_precision=False,
            refuses=("reuse",),  # a model is sharded once (refuse_sharded_twice)
            shards_parameters=True,
            shards_optimizer=True,
            takes_meta_modules=True,
        )
    )
    register(
        StrategyInfo(
            name="fsdp-tp",
            aliases=("2d",),
            factory=_factory(True),
            description="2-D parallelism: FSDP2 over 'dp' × tensor parallelism over 'tp'.",
            memory=not_estimable(TWO_D_NOT_MODELLED),
            options=(
                *DistributedStrategy.strategy_options(),
                plan,
                Option("tp_size", (int, type(None)), None, "ranks per tensor-parallel group"),
                Option("dp_size", (int, type(None)), None, "data-parallel (FSDP) replicas"),
                Option("dp_replicate", int, 1, "HSDP: replicas of the sharded model (1: none)"),
                Option(
                    "shard_classes",
                    (list, tuple),
                    (),
                    "class names of submodules to shard as FSDP units",
                ),
                Option("reshard_after_forward", bool, True, "free gathered params after forward"),
                UnusedParameters.OPTION,
            ),
            precisions=("32", "bf16"),
            owns_precision=True,
            precision_check=gpu_check,
            # a model is sharded once (refuse_sharded_twice); ranks that use different
            # parameters: right with reduce_scatter_unused_params=True, else refused
            refuses=("reuse", "rank_dependent"),
            shards_parameters=True,
            shards_optimizer=True,
            takes_meta_modules=True,
        )
    )
