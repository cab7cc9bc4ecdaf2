"""Backends broken on purpose, each in one way users have been bitten by; the conformance kit must
catch every one by the property it breaks (tests/testing/test_conformance.py)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import torchplug as tp
import torchplug.plugin as tpp
from torchplug.plugins.base import DistributedStrategy
from torchplug.plugins.ddp import DDPStrategy


class NoAverage(DistributedStrategy):
    """Sums gradients across ranks but forgets to divide by the world size (unless given the
    option ``average=True``: how the suite sees ``torchplug check --option`` reach the ranks)."""

    def __init__(self, average: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.average = average

    @tpp.hookimpl
    def torchplug_wrap(self, engine, model, optimizers):
        self.model = model.to(engine.device)
        with torch.no_grad():
            for p in self.model.parameters():
                dist.broadcast(p, 0)
        return self.model, optimizers

    @tpp.hookimpl
    def torchplug_backward(self, engine, loss, model):
        loss.backward()
        for p in self.model.parameters():  # the model from wrap: this code really runs
            if p.grad is not None:
                dist.all_reduce(p.grad)  # SUM, and no division by the world size: the bug
                if self.average:
                    p.grad /= engine.world_size
        return True


class LocalClip(DDPStrategy):
    """Clips by the norm of this rank's share of the parameters only (a sharded backend that
    forgets to all-reduce the norm)."""

    @tpp.hookimpl
    def torchplug_clip_grad_norm(self, engine, model, optimizer, max_norm, norm_type):
        params = list(model.parameters())[engine.rank :: engine.world_size]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)


class IgnoresNoSync(DDPStrategy):
    """Synchronizes gradients inside engine.no_sync() anyway."""

    @tpp.hookimpl
    def torchplug_no_sync(self, engine, model):
        return contextlib.nullcontext()


class IgnoresSkip(DDPStrategy):
    """Steps the optimizer's class directly, around what torchplug asked (a skipped step)."""

    @tpp.hookimpl
    def torchplug_optimizer_step(self, engine, optimizer, closure):
        type(optimizer).step(optimizer)
        return True


class DropsScheduler(DDPStrategy):
    """Re-creates the optimizer in setup: a scheduler made before setup drives the old one."""

    @tpp.hookimpl
    def torchplug_wrap(self, engine, model, optimizers):
        wrapped, _ = super().torchplug_wrap(engine, model, optimizers)
        fresh = [type(o)([dict(g) for g in o.param_groups]) for o in optimizers]
        return wrapped, fresh


class ReinitialisesPerRank(DDPStrategy):
    """Re-initialises the model in wrap from a per-rank seed (a backend that builds its own copy
    of the model on each rank without taking rank 0's)."""

    @tpp.hookimpl
    def torchplug_wrap(self, engine, model, optimizers):
        wrapped, optimizers = super().torchplug_wrap(engine, model, optimizers)
        torch.manual_seed(1000 + engine.rank)  # after DDP's own broadcast: the bug
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        return wrapped, optimizers


class KeepsItsLr(DDPStrategy):
    """Loads the optimizer's state but keeps the learning rates it had (a backend that rebuilds
    its param groups from the setup-time optimizer)."""

    @tpp.hookimpl
    def torchplug_load_optimizer_state(self, engine, model, optimizer, state):
        kept = [group["lr"] for group in optimizer.param_groups]
        super().torchplug_load_optimizer_state(engine, model, optimizer, state)
        for group, lr in zip(optimizer.param_groups, kept, strict=True):
            group["lr"] = lr
        return True


class NoBarrier(DDPStrategy):
    """Answers engine.barrier() without waiting for the other ranks."""

    @tpp.hookimpl
    def torchplug_barrier(self, engine):
        return True


class ClaimsSharding(DDPStrategy):
    """Plain DDP that declares it shards the optimizer state (its registration below): users
    size their jobs by that claim."""


class RefusesClipping(DDPStrategy):
    """Refuses clip_grad_norm_ with a clear ConfigurationError but never declares it: a backend
    must not pass the kit by refusing what it does not implement."""

    @tpp.hookimpl
    def torchplug_clip_grad_norm(self, engine, model, optimizer, max_norm, norm_type):
        raise tp.ConfigurationError("refuses-clipping cannot clip gradients.")


class AveragesBuffers(DDPStrategy):
    """Averages the floating-point buffers (BatchNorm's running statistics) over the ranks
    after every step: statistics no rank computed, neither DDP's rule nor SyncBatchNorm's."""

    @tpp.hookimpl
    def torchplug_wrap(self, engine, model, optimizers):
        self.model = model
        return super().torchplug_wrap(engine, model, optimizers)

    @tpp.hookimpl
    def torchplug_optimizer_step(self, engine, optimizer, closure):
        stepped = super().torchplug_optimizer_step(engine, optimizer, closure)
        with torch.no_grad():
            for buffer in self.model.buffers():
                if buffer.is_floating_point():
                    torch.distributed.all_reduce(buffer)
                    buffer.div_(engine.world_size)
        return stepped


class PerRankBuffers(DDPStrategy):
    """Re-creates the buffers of parameter-free modules from each rank's own RNG in wrap (a
    backend that rebuilds buffers when it moves the model), after rank 0's were broadcast."""

    @tpp.hookimpl
    def torchplug_wrap(self, engine, model, optimizers):
        wrapped, optimizers = super().torchplug_wrap(engine, model, optimizers)
        torch.manual_seed(2000 + engine.rank)
        for module in model.modules():
            own = dict(module.named_buffers(recurse=False))
            params = dict(module.named_parameters(recurse=False))
            if own and not params and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        return wrapped, optimizers


class FloorsIntegerMeans(DDPStrategy):
    """Averages integers in their own dtype: reduce(int_tensor, "mean") floors (2, not 2.5)."""

    @tpp.hookimpl
    def torchplug_reduce(self, engine, tensor, op):
        result = tensor.detach().clone()
        dist.all_reduce(result, op=dist.ReduceOp.MAX if op == "max" else
                        dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.SUM)  # fmt: skip
        if op == "mean":
            result = result // engine.world_size if not result.is_floating_point() else (
                result / engine.world_size
            )  # fmt: skip
        return result


class ReducesInFloat32(DDPStrategy):
    """Reduces every tensor in one float32 buffer (a shortcut for coalescing) and hands that
    back: an int64 counter comes back float32, a float64 sum rounded to float32."""

    @tpp.hookimpl
    def torchplug_reduce(self, engine, tensor, op):
        result = tensor.detach().to(torch.float32, copy=True)
        dist.all_reduce(result, op=dist.ReduceOp.MAX if op == "max" else
                        dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.SUM)  # fmt: skip
        return result / engine.world_size if op == "mean" else result


class ReducesPresentGradients(DistributedStrategy):
    """Averages the gradients each rank has (``p.grad is not None``), one all-reduce each:
    ranks that used different parameters pair up different gradients of the same shape."""

    @tpp.hookimpl
    def torchplug_wrap(self, engine, model, optimizers):
        self.model = model.to(engine.device)
        return self.model, optimizers

    @tpp.hookimpl
    def torchplug_backward(self, engine, loss, model):
        loss.backward()
        for p in self.model.parameters():
            if p.grad is not None:  # the bug: which parameters have one differs by rank
                dist.all_reduce(p.grad)
                p.grad /= engine.world_size
        return True


class IgnoresNormType(DDPStrategy):
    """Clips by the L2 norm whatever ``norm_type`` asks (an inf-norm reported as the L2 one)."""

    @tpp.hookimpl
    def torchplug_clip_grad_norm(self, engine, model, optimizer, max_norm, norm_type):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


class LeavesHooks(DistributedStrategy):
    """Averages gradients with hooks on the parameters and never removes them: under a second
    Engine on the same model both Engines' hooks run (the gradient is averaged twice)."""

    @tpp.hookimpl
    def torchplug_wrap(self, engine, model, optimizers):
        model = model.to(engine.device)
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p, 0)
        world = engine.world_size

        def average(grad):
            grad = grad.clone()
            dist.all_reduce(grad)
            return grad / world

        for p in model.parameters():
            p.register_hook(average)  # the handle is dropped: nothing can take it off
        return model, optimizers


class Unfreezes(DDPStrategy):
    """Makes every parameter trainable before wrapping (a frozen base then moves)."""

    @tpp.hookimpl
    def torchplug_wrap(self, engine, model, optimizers):
        for p in model.parameters():
            p.requires_grad_(True)
        return super().torchplug_wrap(engine, model, optimizers)


class OnlyL2OrInf(DDPStrategy):
    """Knows the inf norm as a special case and takes every other ``norm_type`` for 2 (a 1-norm
    reported as the L2 one)."""

    @tpp.hookimpl
    def torchplug_clip_grad_norm(self, engine, model, optimizer, max_norm, norm_type):
        norm_type = norm_type if norm_type == float("inf") else 2.0
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)


class OwnStepMetadata(DDPStrategy):
    """Answers ``torchplug_checkpoint_metadata`` with its own step counter (the optimizer steps
    this Engine took) instead of the step the checkpoint was saved at."""

    steps = 0

    @tpp.hookimpl
    def torchplug_optimizer_step(self, engine, optimizer, closure):
        self.steps += 1

    @tpp.hookimpl
    def torchplug_checkpoint_metadata(self, engine, path):
        return {"step": self.steps}


class HidesNonFiniteNorms(DDPStrategy):
    """Clips with the non-finite gradients left out of the norm (a finite total reported for
    gradients that hold inf)."""

    @tpp.hookimpl
    def torchplug_clip_grad_norm(self, engine, model, optimizer, max_norm, norm_type):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = [g.nan_to_num(0.0, 0.0, 0.0) for g in grads]
        norms = torch.stack([g.norm(norm_type) for g in finite])
        total = torch.linalg.vector_norm(norms, norm_type)
        for g in grads:
            g.mul_(min(1.0, max_norm / (float(total) + 1e-6)))
        return total


class RoundsGradients(DDPStrategy):
    """Not broken: rounds the averaged gradients through bfloat16 when ``round_to_bf16=True`` (a
    compressed exchange, lossy by choice), and declares a wider tolerance for that value only."""

    def __init__(self, round_to_bf16: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.round_to_bf16 = round_to_bf16

    @tpp.hookimpl
    def torchplug_wrap(self, engine, model, optimizers):
        self.model, optimizers = super().torchplug_wrap(engine, model, optimizers)
        return self.model, optimizers

    @tpp.hookimpl
    def torchplug_backward(self, engine, loss, model):
        answered = super().torchplug_backward(engine, loss, model)
        if self.round_to_bf16:
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.copy_(p.grad.bfloat16())
        return answered


BROKEN = {
    "no-average": (NoAverage, "sgd"),
    "local-clip": (LocalClip, "clipping"),
    "ignores-no-sync": (IgnoresNoSync, "accumulation"),
    "ignores-skip": (IgnoresSkip, "fp16_skip"),
    "drops-scheduler": (DropsScheduler, "schedulers"),
    "reinitialises-per-rank": (ReinitialisesPerRank, "replicas"),
    "keeps-its-lr": (KeepsItsLr, "hyperparameters"),
    "no-barrier": (NoBarrier, "barrier"),
    "claims-sharding": (ClaimsSharding, "sharding"),
    "refuses-clipping": (RefusesClipping, "clipping"),
    "averages-buffers": (AveragesBuffers, "real_model"),
    "per-rank-buffers": (PerRankBuffers, "replicas"),
    "floors-integer-means": (FloorsIntegerMeans, "collectives"),
    "reduces-in-float32": (ReducesInFloat32, "collectives"),
    "reduces-present-gradients": (ReducesPresentGradients, "rank_dependent"),
    "ignores-norm-type": (IgnoresNormType, "clipping"),
    "leaves-hooks": (LeavesHooks, "reuse"),
    "unfreezes": (Unfreezes, "frozen"),
    "only-l2-or-inf": (OnlyL2OrInf, "clipping"),
    "own-step-metadata": (OwnStepMetadata, "resume"),
    "hides-non-finite-norms": (HidesNonFiniteNorms, "clipping"),
}
#: What a broken strategy's registration declares beyond the defaults.
DECLARED = {
    "claims-sharding": {"shards_optimizer": True},
    "no-average": {
        "options": (
            *DistributedStrategy.strategy_options(),
            tpp.Option("average", bool, False, "divide by the world size after all"),
        )
    },
}

#: Not broken: the same refusal, declared (the kit passes it as "refused as declared").
DECLARES_REFUSAL = "declares-no-clipping"
#: Not broken: local-clip's per-rank clipping, declared as a deviation by design (local SGD).
DECLARES_DEVIATION = "declares-local-clipping"
#: A deviation declared under a name that is no kit property: the kit says so.
MISNAMED_DEVIATION = "misnamed-deviation"
#: Not broken: lossy for one option value, with a tolerance declared per option value; and the
#: same strategy declaring the exact tolerance whatever the option says (lossy: caught).
PER_OPTION_TOLERANCE = "rounds-gradients"
ONE_TOLERANCE = "rounds-gradients-one-tolerance"
_ROUNDING = (
    *DDPStrategy.strategy_options(),
    tpp.Option("round_to_bf16", bool, False, "round the averaged gradients through bfloat16"),
)


@tpp.hookimpl
def torchplug_register_strategies(register):
    for name, (factory, _) in BROKEN.items():
        register(
            tpp.StrategyInfo(
                name=name,
                factory=factory,
                description="broken on purpose",
                precisions=("32", "bf16", "fp16"),
                **DECLARED.get(name, {}),
            )
        )
    register(
        tpp.StrategyInfo(
            name=DECLARES_REFUSAL,
            factory=RefusesClipping,
            description="refuses clipping, as its registration says",
            refuses=("clipping",),
        )
    )
    register(
        tpp.StrategyInfo(
            name=DECLARES_DEVIATION,
            factory=LocalClip,
            description="clips each rank's gradients, by design",
            deviations={"clipping": "each rank clips its own gradients, by design"},
        )
    )
    register(
        tpp.StrategyInfo(
            name=PER_OPTION_TOLERANCE,
            factory=RoundsGradients,
            description="rounds gradients through bf16 when asked, declared per option value",
            options=_ROUNDING,
            tolerance=lambda options: 1e-2 if options["round_to_bf16"] else 1e-5,
        )
    )
    register(
        tpp.StrategyInfo(
            name=ONE_TOLERANCE,
            factory=RoundsGradients,
            description="rounds gradients through bf16 when asked, declared exact",
            options=_ROUNDING,
        )
    )
    register(
        tpp.StrategyInfo(
            name=MISNAMED_DEVIATION,
            factory=LocalClip,
            description="declares a deviation for a property that does not exist",
            deviations={"cliping": "misspelt"},
        )
    )
