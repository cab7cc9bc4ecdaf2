"""DDP with bf16-compressed gradient all-reduce: a third-party torchplug backend."""

import torch

from torchplug.plugin import DDPStrategy, StrategyInfo, hookimpl

TORCHPLUG_API = ">=1.0,<2"  # the plugin API versions this module is written for


def bf16_allreduce(group, bucket):
    # a DDP communication hook: average the bucket as bf16 (half the bytes, a little rounding)
    grads = bucket.buffer()
    half = grads.to(torch.bfloat16).div_(torch.distributed.get_world_size())
    done = torch.distributed.all_reduce(half, group=group, async_op=True).get_future()
    return done.then(lambda fut: grads.copy_(fut.value()[0]))


class BF16CommDDP(DDPStrategy):
    @hookimpl
    def torchplug_wrap(self, engine, model, optimizers):
        model, optimizers = super().torchplug_wrap(engine, model, optimizers)
        if hasattr(model, "register_comm_hook"):  # a frozen model comes back unwrapped
            model.register_comm_hook(None, bf16_allreduce)
        return model, optimizers


@hookimpl
def torchplug_register_strategies(register):
    about = "DDP, gradients all-reduced in bf16"
    info = dict(name="ddp-bf16comm", factory=BF16CommDDP, extends="ddp", description=about)
    # DDP refuses ranks that use different parameters unless find_unused_parameters=True;
    # a refusal is declared by each strategy (extends does not pass it on)
    register(StrategyInfo(**info, tolerance=1e-2, refuses=("rank_dependent",)))
