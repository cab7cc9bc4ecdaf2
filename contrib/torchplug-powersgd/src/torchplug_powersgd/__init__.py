"""torchplug strategy ``powersgd``: torch DDP whose gradients are compressed with PowerSGD."""

from torchplug.plugin import DDPStrategy, Option, StrategyInfo, hookimpl

TORCHPLUG_API = ">=1.0,<2"


class PowerSGD(DDPStrategy):
    def __init__(self, rank: int = 1, warm_up: int = 2, **ddp_options):
        super().__init__(**ddp_options)
        self.rank, self.warm_up = rank, warm_up

    @hookimpl
    def torchplug_wrap(self, engine, model, optimizers):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        model, optimizers = super().torchplug_wrap(engine, model, optimizers)
        if not hasattr(model, "register_comm_hook"):  # a frozen model comes back unwrapped
            return model, optimizers
        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=self.rank,
            start_powerSGD_iter=self.warm_up,
        )
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        return model, optimizers


@hookimpl
def torchplug_register_strategies(register):
    register(
        StrategyInfo(
            name="powersgd",
            factory=PowerSGD,
            description="DDP with PowerSGD low-rank gradient compression (lossy).",
            extends="ddp",  # DDP's options (find_unused_parameters, ...) and capabilities
            options=(
                Option("rank", int, 1, "rank of the gradient approximation"),
                Option("warm_up", int, 2, "plain all-reduce steps before compressing (>= 2)"),
            ),
            tolerance=None,  # lossy: the kit checks convergence instead of parity
            resume_exact=False,  # PowerSGD's error-feedback state is not checkpointed
            # DDP's refusal of ranks that use different parameters (unless
            # find_unused_parameters=True); refusals are not inherited through extends
            refuses=("rank_dependent",),
        )
    )
