"""torchplug strategy ``powersgd``: torch DDP whose gradients are compressed with PowerSGD."""

import torchplug as tp

TORCHPLUG_API = ">=1.0,<2"


class PowerSGD(tp.DDPStrategy):
    def __init__(self, rank: int = 1, warm_up: int = 2, **ddp_options):
        super().__init__(**ddp_options)
        self.rank, self.warm_up = rank, warm_up

    @tp.hookimpl
    def torchplug_wrap(self, engine, model, optimizers):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        model, optimizers = super().torchplug_wrap(engine, model, optimizers)
        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=self.rank,
            start_powerSGD_iter=self.warm_up,
        )
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        return model, optimizers


@tp.hookimpl
def torchplug_register_strategies(register):
    register(
        tp.StrategyInfo(
            name="powersgd",
            factory=PowerSGD,
            description="DDP with PowerSGD low-rank gradient compression (lossy).",
            extends="ddp",  # DDP's options (find_unused_parameters, ...) and capabilities
            options=(
                tp.Option("rank", int, 1, "rank of the gradient approximation"),
                tp.Option("warm_up", int, 2, "plain all-reduce steps before compressing (>= 2)"),
            ),
            tolerance=None,  # lossy: the kit checks convergence instead of parity
            resume_exact=False,  # PowerSGD's error-feedback state is not checkpointed
        )
    )
