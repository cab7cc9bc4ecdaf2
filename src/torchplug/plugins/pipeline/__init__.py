"""``pp``: pipeline parallelism (``torch.distributed.pipelining``), alone or times data
parallel over the pipelines, on one job mesh.

The mesh has dims ``("pp", "dp_replicate", "dp_shard", "tp")`` (torchtitan's order, pp
outermost, a tensor-parallel group's ranks consecutive); a pipeline's ranks see the same
batches (``engine.setup_dataloader`` shards over the data-parallel dims only), and each stage's
gradients are averaged over its replicas at the optimizer step (FSDP2's own, with ``dp_shard``).

The model becomes stages at its first step (`torchplug.plugins.pipeline.stages`: traced, cut
before each split point, each stage keeping the model's own parameters and names). The step is
``engine.forward_backward(model, x, target=y, loss_fn=f)``: the schedule runs the micro-batches'
forwards and backwards together and the last stage's loss comes back on every rank;
``model(x)`` without gradients is evaluation (a forward-only schedule, the output on every
rank). Checkpoints hold the model's own names (`torchplug.plugins.pipeline.state`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchplug.plugin import (
    DEFAULT_TIMEOUT,
    ClusterInfo,
    ConfigurationError,
    DistributedStrategy,
    HookContext,
    Option,
    Runtime,
    StrategyInfo,
    clip_largest,
    gpu_check,
    hookimpl,
    model_tp_plan,
    with_mesh,
)
from torchplug.plugins.pipeline import state as states
from torchplug.plugins.pipeline.memory import pipeline_memory
from torchplug.plugins.pipeline.parallel import StageModule, place, plan_styles
from torchplug.plugins.pipeline.stages import (
    EVERYWHERE,
    Stages,
    batch_size,
    by_name,
    checked_points,
    like,
)

#: Schedules by name: (torch's class, stages per rank by default).
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
    "looped-bfs": ("ScheduleLoopedBFS", 2),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", 2),
}


class PipelineModel(torch.nn.Module):
    """What ``engine.setup`` returns under ``pp``: the user's model (``.module``), whose
    training step is ``engine.forward_backward``; ``model(x)`` without gradients (or in eval
    mode) runs the forward-only schedule and returns the last stage's output on every rank."""

    def __init__(self, module: torch.nn.Module, strategy: PipelineStrategy) -> None:
        super().__init__()
        self.module = module
        self._strategy = [strategy]  # a list: not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            raise ConfigurationError(
                "Under pp a training step runs the whole pipeline schedule: call "
                "engine.forward_backward(model, *inputs, target=target, loss_fn=loss_fn) "
                "instead of model(x) and engine.backward(loss) (it works on every strategy). "
                "For evaluation call model.eval() or run under torch.no_grad()."
            )
        return self._strategy[0].evaluate(args, kwargs)


class PipelineStrategy(DistributedStrategy):
    def __init__(
        self,
        process_group_backend: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        pp_size: int = 0,
        split_points: list[str] | tuple[str, ...] | str | int = (),
        schedule: str = "1f1b",
        n_microbatches: int = 0,
        stages_per_rank: int = 0,
        dp_shard: int = 1,
        tp_size: int = 1,
        tp_plan: dict[str, str] | None = None,
    ) -> None:
        super().__init__(process_group_backend, timeout)
        if schedule not in SCHEDULES:
            raise ConfigurationError(
                f"pp's schedule {schedule!r} is not one of {', '.join(SCHEDULES)}. Pick one, "
                f"e.g. Engine('pp', schedule='1f1b')."
            )
        if isinstance(split_points, (str, int)):  # the command line's "layers.4,layers.8", 2
            split_points = [p.strip() for p in str(split_points).split(",") if p.strip()]
        self.pp_size, self.split_points = pp_size, [str(p) for p in split_points]
        self.schedule_name, self.n_microbatches = schedule, n_microbatches
        self.per_rank = stages_per_rank or SCHEDULES[schedule][1]
        if self.per_rank > 1 and schedule in ("gpipe", "1f1b"):
            raise ConfigurationError(
                f"schedule={schedule!r} runs one stage per rank; stages_per_rank="
                f"{self.per_rank} needs interleaved-1f1b, looped-bfs or zero-bubble."
            )
        self.dp_shard, self.tp, self.tp_plan = dp_shard, tp_size, tp_plan
        if dp_shard < 1 or tp_size < 1:
            raise ConfigurationError(
                f"pp's dp_shard={dp_shard} and tp_size={tp_size} are rank counts: give each "
                f"as 1 (not used) or more."
            )
        self.stages: Stages | None = None
        self.schedules: dict[int, Any] = {}
        self.loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
        self.dirty = False  # gradients not yet synchronized across stages and replicas

    @hookimpl
    def torchplug_setup(self, engine: HookContext, cluster: ClusterInfo) -> Runtime:
        """The process group, then the job's mesh ``("pp", "dp_replicate", "dp_shard", "tp")``
        (torchtitan's order: a tensor-parallel group is consecutive ranks, a pipeline's ranks
        the farthest apart)."""
        runtime = super().torchplug_setup(engine, cluster)
        world, inner = runtime.world_size, self.dp_shard * self.tp
        pp = self.pp_size or world // inner
        if pp < 2 or world % (pp * inner):
            raise ConfigurationError(
                f"pp_size={pp} x dp_shard={self.dp_shard} x tp_size={self.tp} does not divide "
                f"the {world} ranks into pipelines of at least 2 stages. Launch a multiple of "
                f"their product (e.g. `torchplug launch -n 4 --strategy pp --option pp_size=2 "
                f"train.py`)."
            )
        replicate = world // (pp * inner)
        self.pp, self.dp = pp, replicate * self.dp_shard
        self.pp_rank = runtime.rank // (replicate * inner)
        dp_rank = (runtime.rank // self.tp) % self.dp
        runtime = with_mesh(
            runtime, (pp, replicate, self.dp_shard, self.tp),
            ("pp", "dp_replicate", "dp_shard", "tp"),
            data_parallel_rank=dp_rank, data_parallel_size=self.dp,
        )  # fmt: skip
        self.mesh = runtime.mesh
        self.pp_group = runtime.mesh.get_group("pp")
        self.dp_group = runtime.mesh.get_group("dp_replicate")
        return runtime

    @hookimpl
    def torchplug_wrap(
        self, engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        """The model annotated with its split points; stages come at the first step."""
        from torch.distributed.pipelining import SplitPoint
        from torch.distributed.pipelining._IR import annotate_split_points

        if self.stages is not None:
            raise ConfigurationError(
                "pp splits one model per Engine into stages, and this Engine set one up "
                "already. Make another Engine for another pipelined model."
            )
        total = self.pp * self.per_rank
        why = f"{self.pp} ranks x {self.per_rank} stages per rank"
        points = checked_points(model, self.split_points, total, why)
        model = model.to(engine.device)
        annotate_split_points(model, {name: SplitPoint.BEGINNING for name in points})
        split = self.tp > 1 or self.dp_shard > 1
        if self.tp > 1:
            plan = self.tp_plan or model_tp_plan(model)
            if not isinstance(plan, dict):
                raise ConfigurationError(
                    f"pp with tp_size={self.tp} needs a tensor-parallel plan: which layers to "
                    f"split. Pass Engine('pp', tp_size={self.tp}, tp_plan={{'layers.*.fc': "
                    f"'colwise', 'layers.*.out': 'rowwise'}}), or give the model a tp_plan."
                )
            self.styles = plan_styles(model, plan)
        self.stages = Stages(
            model, self.pp_rank, self.pp, self.per_rank, self.pp_group, engine.device,
            parallel=self._parallel if split else None,
            tp_mesh=self.mesh["tp"] if self.tp > 1 else None,
        )  # fmt: skip
        self.optimizers, self.engine = list(optimizers), engine
        return PipelineModel(model, self), optimizers

    def _parallel(self, module: StageModule) -> None:
        """A stage's tensor parallel (its planned layers split over ``tp``), then FSDP2 over
        ``dp_shard`` (times ``dp_replicate``: HSDP). The gathered parameters stay gathered
        through a step's micro-batches (torch's schedules reshard after the last backward),
        as torchtitan runs FSDP under a pipeline."""
        if self.tp > 1:
            place(module, self.mesh["tp"], self.styles)
        if self.dp_shard > 1:
            from torch.distributed.fsdp import fully_shard

            replicate = self.dp // self.dp_shard
            mesh = self.mesh["dp_replicate", "dp_shard"] if replicate > 1 else self.mesh["dp_shard"]
            fully_shard(module, mesh=mesh, reshard_after_forward=False)

    # -- the step ---------------------------------------------------------------------------------

    def _run(self, inputs: tuple[Any, ...], kwargs: dict[str, Any], train: bool) -> Any:
        """This rank's stages and the schedule over them, for this batch's shapes."""
        assert self.stages is not None
        n = self.micro = self.n_microbatches or self.pp * self.per_rank
        batch = batch_size(inputs, kwargs)
        if batch is not None and batch % n:
            raise ConfigurationError(
                f"A batch of {batch} does not split into n_microbatches={n} equal micro-batches "
                f"(a pipeline's stages exchange fixed shapes). Make the batch size a multiple "
                f"of {n} (drop_last=True in the loader), or set n_microbatches."
            )
        first = not self.stages.owned
        stages = self.stages.get(inputs, kwargs, train, n)
        if first:
            for optimizer in self.optimizers:
                self.stages.prune(optimizer)
            self.stages.replaced.clear()
        self.stages.activate(stages)
        key = id(stages[0])
        if key not in self.schedules:
            from torch.distributed import pipelining

            cls = getattr(pipelining, SCHEDULES[self.schedule_name][0])
            fn = self._loss if train else None
            chosen = stages[0] if self.per_rank == 1 else stages
            # the loss divided here, not the gradients afterwards (scale_grads): torch would divide
            # gradients accumulated over earlier steps too (engine.accumulate, no_sync)
            try:
                schedule = cls(chosen, n, loss_fn=fn, scale_grads=False)
            except ValueError as exc:  # torch's own limits: micro-batches per stage count
                raise ConfigurationError(
                    f"pp's schedule {self.schedule_name!r} refuses n_microbatches={n} with "
                    f"{self.pp * self.per_rank} stages: {exc} Set n_microbatches to a multiple "
                    f"of the stage count, or schedule='gpipe', which takes any number."
                ) from exc
            self.schedules[key] = (schedule, stages)
        return self.schedules[key]

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        """A micro-batch's loss over the number of micro-batches: their sum is the batch's."""
        assert self.loss_fn is not None
        return self.loss_fn(output, target) / self.micro

    def _replicating(self) -> contextlib.AbstractContextManager[Any]:
        """Under tensor parallel, plain tensors meeting DTensors count as replicated, in the
        backward too (a position index the forward made, saved for the embedding's backward)."""
        if self.tp == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.experimental import implicit_replication

        return implicit_replication()

    def _last_pp_rank(self) -> int:
        return (self.pp * self.per_rank - 1) % self.pp

    @hookimpl
    def torchplug_forward_backward(
        self,
        engine: HookContext,
        model: torch.nn.Module,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
    ) -> torch.Tensor:
        """The schedule's step over the batch; the last stage's mean loss, on every rank."""
        schedule, stages = self._run(inputs, kwargs, train=True)
        self.loss_fn = loss_fn
        losses: list[torch.Tensor] = []
        last = any(s.is_last for s in stages)
        kwargs = by_name(self.stages.model, inputs, kwargs)  # every stage may read them
        if not any(s.is_first for s in stages):
            inputs = ()
        with engine.hooks.autocast(), self._replicating():
            schedule.step(*inputs, target=target if last else None, losses=losses, **kwargs)
        self.dirty = True
        loss = torch.zeros((), device=engine.device)
        if last:
            loss = torch.stack([x.detach().float() for x in losses]).sum()
        dist.broadcast(loss, group=self.pp_group, group_src=self._last_pp_rank())
        return loss

    def evaluate(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A forward-only schedule; the last stage's output on every rank of the pipeline."""
        schedule, stages = self._run(args, kwargs, train=False)
        assert self.stages is not None
        kwargs = by_name(self.stages.model, args, kwargs)
        if not any(s.is_first for s in stages):
            args = ()
        with torch.no_grad(), self.engine.hooks.autocast(), self._replicating():
            output = schedule.eval(*args, **kwargs)
        for stage in stages:  # no backward comes to free what the forward gathered
            if hasattr(stage.submod, "reshard"):
                stage.submod.reshard()
        held = [output if any(s.is_last for s in stages) else None]
        dist.broadcast_object_list(held, group=self.pp_group, group_src=self._last_pp_rank())
        return held[0]

    # -- gradients: synchronized once per optimizer step ------------------------------------------

    def _sync_grads(self) -> None:
        """Tied parameters' gradients summed over the stages holding them, then every gradient
        averaged over the data-parallel pipelines: once before clipping or the step, however
        many micro-steps accumulated (so ``no_sync`` needs nothing more)."""
        if not self.dirty or self.stages is None:
            return
        self.dirty = False
        from torch.distributed.tensor import DTensor

        params = dict(self.stages.model.named_parameters())
        for name in self.stages.shared():
            p = params[name]
            held = self.stages.held_here(p)
            grad = p.grad if held and p.grad is not None else None
            if isinstance(grad, DTensor):
                grad = grad.full_tensor()
            if grad is None:
                shape, dtype = self.stages.shapes[name]
                grad = torch.zeros(shape, dtype=dtype, device=self.stages.device)
            dist.all_reduce(grad, group=self.pp_group)
            if held:
                p.grad = like(grad, p)
        if self.dp > 1 and self.dp_shard == 1:  # FSDP2 reduces over dp_replicate too (HSDP)
            for p in self.stages.params():
                if p.grad is not None:
                    local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    dist.all_reduce(local, group=self.dp_group)
                    local.div_(self.dp)

    @hookimpl
    def torchplug_optimizer_step(
        self, engine: HookContext, optimizer: torch.optim.Optimizer, closure: Any
    ) -> bool:
        self._sync_grads()
        return super().torchplug_optimizer_step(engine, optimizer, closure)

    @hookimpl
    def torchplug_clip_grad_norm(
        self,
        engine: HookContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        norm_type: float,
    ) -> torch.Tensor:
        """The norm over every stage (a tied parameter counted once, by its lowest holder),
        then this rank's gradients clipped with it."""
        self._sync_grads()
        assert self.stages is not None
        mine = self.stages.params()
        names = {id(p): n for n, p in self.stages.model.named_parameters()}
        grads = [
            p.grad
            for p in mine
            if p.grad is not None and self.stages.owner(names[id(p)]) in (self.pp_rank, EVERYWHERE)
        ]
        if math.isinf(norm_type):  # the largest value, whatever its copies (every rank's max)
            return clip_largest(grads, max_norm, engine.reduce)
        from torch.distributed.tensor import DTensor

        norms = [torch.linalg.vector_norm(g.detach(), norm_type) for g in grads]
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        local = torch.zeros((), device=engine.device)
        if norms:
            local = torch.linalg.vector_norm(torch.stack(norms).float(), norm_type)
        powered = local**norm_type
        dist.all_reduce(powered, group=self.pp_group)
        total = powered ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in mine:
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
        return total

    @hookimpl
    def torchplug_no_sync(self, engine: HookContext, model: torch.nn.Module) -> Any:
        """Nothing to hold back: gradients are synchronized at the step (`_sync_grads`)."""
        return contextlib.nullcontext()

    # -- state ------------------------------------------------------------------------------------

    @hookimpl
    def torchplug_model_state(self, engine: HookContext, model: torch.nn.Module) -> dict[str, Any]:
        assert self.stages is not None
        return states.model_state(self.stages)

    @hookimpl
    def torchplug_load_model_state(
        self, engine: HookContext, model: torch.nn.Module, state: dict[str, Any], strict: bool
    ) -> bool:
        assert self.stages is not None
        states.load_model_state(self.stages, state, strict)
        return True

    @hookimpl
    def torchplug_optimizer_state(
        self, engine: HookContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        assert self.stages is not None
        with engine.real_optimizer_steps():
            local = get_optimizer_state_dict(self.stages.model, optimizer)
        return states.optimizer_state(self.stages, local)

    @hookimpl
    def torchplug_load_optimizer_state(
        self,
        engine: HookContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
    ) -> bool:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        assert self.stages is not None
        subset = states.optimizer_subset(self.stages, optimizer, state)
        with engine.real_optimizer_steps():
            set_optimizer_state_dict(self.stages.model, optimizer, subset)
        return True


@hookimpl
def torchplug_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(
        StrategyInfo(
            name="pp",
            aliases=("pipeline",),
            factory=PipelineStrategy,
            description="Pipeline parallel (torch.distributed.pipelining) x data parallel.",
            options=(
                *DistributedStrategy.strategy_options(),
                Option("pp_size", int, 0, "ranks per pipeline (0: every rank)"),
                Option(
                    "split_points",
                    (list, tuple, str, int),
                    (),
                    "module names the stages after the first begin at, e.g. 'layers.4'",
                ),
                Option("schedule", str, "1f1b", f"one of {', '.join(SCHEDULES)}"),
                Option("n_microbatches", int, 0, "micro-batches per batch (0: the stage count)"),
                Option("stages_per_rank", int, 0, "stages each rank runs (0: the schedule's)"),
                Option("dp_shard", int, 1, "ranks sharding each stage with FSDP2 (1: none)"),
                Option("tp_size", int, 1, "tensor-parallel ranks per stage (1: none)"),
                Option(
                    "tp_plan",
                    (dict, type(None)),
                    None,
                    "with tp_size: layer name pattern -> 'colwise'/'rowwise' (else the model's)",
                ),
            ),
            precisions=("32", "bf16"),
            precision_check=gpu_check,
            # a schedule runs the step: model(x) + engine.backward is refused (forward_backward);
            # a pipeline needs 2 ranks at least; a model is cut into stages once
            refuses=("backward", "single_process", "reuse"),
            deviations={
                "real_model": "BatchNorm normalises each micro-batch apart and updates its "
                "running statistics once per micro-batch (n_microbatches=1 matches exactly)",
            },
            shards_parameters=True,
            shards_optimizer=True,
            memory=pipeline_memory,
        )
    )
