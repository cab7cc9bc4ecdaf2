"""Issue 33 item 5: the Engine never calls torch.distributed's collectives itself.

Init replication (rank 0's parameters and buffers before the wrap), the reductions and gathers a
user asks for, clipping and checkpoints go through the hooks, so a backend whose collectives are
its own is never bypassed. The proof: `OwnChannel`, a backend whose every collective runs on a
gloo group of its own, trains on two ranks while torch.distributed's collectives on the default
group raise; its ranks start from different initialisations, and the run matches plain PyTorch
(one process, rank 0's model, the combined batch) and saves and loads exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import torchplug as tp
import torchplug.plugin as tpp
from torchplug.testing import bodies

#: torch.distributed's collectives, made to raise on the default group while the Engine runs.
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "all_to_all_single",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
)


class DefaultGroupUsed(RuntimeError):
    pass


@contextlib.contextmanager
def default_group_collectives_raise() -> Iterator[list[str]]:
    """Every collective above raises when called on the default group (``group=None`` or
    WORLD), in both of torch's namespaces; called on another group it runs as it is."""
    used: list[str] = []
    saved = {(m, n): getattr(m, n) for m in (dist, c10d) for n in COLLECTIVES if hasattr(m, n)}

    def tripwire(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if group is None or group is c10d.GroupMember.WORLD:
                used.append(name)
                raise DefaultGroupUsed(f"torch.distributed.{name} on the default group")
            return original(*args, **kwargs)

        return call

    for (module, name), original in saved.items():
        setattr(module, name, tripwire(name, original))
    try:
        yield used
    finally:
        for (module, name), original in saved.items():
            setattr(module, name, original)


class OwnChannel(tpp.DistributedStrategy):
    """Full replicas whose every collective runs on a gloo group of the backend's own: gradients
    are averaged over it after each synchronised backward, and the Engine's reduce, gather,
    barrier and broadcast are answered on it."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.group: Any = None
        self.models: list[torch.nn.Module] = []
        self.syncing = True

    @tpp.hookimpl
    def torchplug_setup(self, engine: tpp.HookContext, cluster: tpp.ClusterInfo) -> tpp.Runtime:
        runtime = super().torchplug_setup(engine, cluster)
        self.group = dist.new_group(backend="gloo")
        return runtime

    @tpp.hookimpl
    def torchplug_wrap(self, engine: tpp.HookContext, model: torch.nn.Module, optimizers: list):
        self.models.append(model)
        return model, optimizers

    @tpp.hookimpl
    def torchplug_backward(self, engine: tpp.HookContext, loss: torch.Tensor, model: Any) -> bool:
        loss.backward()
        if self.syncing:
            for module in self.models:
                for p in module.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=self.group)
                        p.grad.div_(engine.world_size)
        return True

    @tpp.hookimpl
    def torchplug_no_sync(self, engine: tpp.HookContext, model: torch.nn.Module) -> Any:
        @contextlib.contextmanager
        def paused() -> Iterator[None]:
            self.syncing = False
            try:
                yield
            finally:
                self.syncing = True

        return paused()

    @tpp.hookimpl
    def torchplug_reduce(self, engine: tpp.HookContext, tensor: torch.Tensor, op: str):
        result = tensor.detach().clone().float() if op == "mean" else tensor.detach().clone()
        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        dist.all_reduce(result, op=ops.get(op, dist.ReduceOp.MIN), group=self.group)
        return result.div_(engine.world_size) if op == "mean" else result

    @tpp.hookimpl
    def torchplug_gather(self, engine: tpp.HookContext, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(engine.world_size)]
        dist.all_gather(parts, tensor.detach().contiguous(), group=self.group)
        return torch.stack(parts)

    @tpp.hookimpl
    def torchplug_barrier(self, engine: tpp.HookContext) -> bool:
        dist.barrier(group=self.group)
        return True

    @tpp.hookimpl
    def torchplug_broadcast(self, engine: tpp.HookContext, tensor: torch.Tensor, src: int):
        dist.broadcast(tensor.detach(), src, group=self.group)
        return tensor

    @tpp.hookimpl
    def torchplug_teardown(self, engine: tpp.HookContext) -> None:
        if self.group is not None and not engine.failing:
            dist.barrier(group=self.group)  # every rank is done: no default-group barrier
        self._release(failing=True)


@tpp.hookimpl
def torchplug_register_strategies(register: Callable[[tpp.StrategyInfo], None]) -> None:
    register(
        tpp.StrategyInfo(
            name="own-channel",
            factory=OwnChannel,
            description="Full replicas; collectives on a gloo group of its own.",
            extends=tpp.DistributedStrategy,
        )
    )


STEPS, ACCUMULATE, CLIP = 4, 2, 0.05


def train_on_own_channel(path: str) -> dict[str, Any]:
    """A user's loop (accumulation through no_sync, clipping, AdamW) on `OwnChannel`, each rank
    starting from a model of its own seed; then a save and a load into a fresh model."""
    import sys

    tpp.register(sys.modules[__name__], name="own-channel-test")
    try:
        with default_group_collectives_raise() as used:
            result = _train(path)
        result["default_group_used"] = used
        return result
    finally:
        tpp.unregister("own-channel-test")


def _train(path: str) -> dict[str, Any]:
    with tp.Engine("own-channel") as engine:
        model = bodies.make_model(seed=engine.rank)  # each rank its own initialisation
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
        model, opt = engine.setup(model, opt)
        losses, norms = [], []
        loader = engine.setup_dataloader(bodies._batches(engine.world_size))
        for step, (x, y) in enumerate(loader):
            if step >= STEPS:
                break
            parts = []
            micro = list(zip(x.chunk(ACCUMULATE), y.chunk(ACCUMULATE), strict=True))
            for i, (xs, ys) in enumerate(micro):
                with engine.no_sync(model, enabled=i < len(micro) - 1):
                    part = torch.nn.functional.mse_loss(model(xs), ys) / len(micro)
                    engine.backward(part)
                parts.append(part.detach())
            norms.append(engine.clip_grad_norm_(model, CLIP).item())
            opt.step()
            opt.zero_grad()
            losses.append(engine.reduce(torch.stack(parts).sum(), "mean").item())
        gathered = engine.gather(torch.tensor([float(engine.rank)]))
        engine.barrier()
        trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
        engine.save(path, {"model": model, "optimizer": opt, "step": STEPS})
        fresh = bodies.make_model(seed=7)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-2)
        fresh, fresh_opt = engine.setup(fresh, fresh_opt)
        state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
        engine.load(path, state)
        return {
            "rank": engine.rank,
            "started_elsewhere": any(
                not torch.equal(b, p)
                for b, p in zip(before, bodies.make_model(0).parameters(), strict=True)
            ),
            "losses": losses,
            "norms": norms,
            "gathered": gathered.flatten().tolist(),
            "params": trained,
            "loaded": {k: v.detach().clone() for k, v in fresh.state_dict().items()},
            "loaded_state": {
                k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in fresh_opt.state_dict()["state"][0].items()
            },
            "state": {
                k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in opt.state_dict()["state"][0].items()
            },
            "step": state["step"],
        }


def test_the_tripwire_catches_a_default_group_collective(ranks):
    """The check itself: with the tripwire on, a plain `dist.broadcast` raises."""
    assert ranks.run(_broadcast_on_default_group) == [True, True]


def _broadcast_on_default_group() -> bool:
    with tp.Engine("ddp"):  # a default process group, as every run here has
        with default_group_collectives_raise() as used, pytest.raises(DefaultGroupUsed):
            dist.broadcast(torch.zeros(1), 0)
        return used == ["broadcast"]


def test_a_backend_with_its_own_collectives_is_never_bypassed(ranks, tmp_path):
    expected = bodies.reference("AdamW", steps=STEPS, lr=3e-2, clip=CLIP, accumulate=ACCUMULATE)
    results = ranks.run(train_on_own_channel, str(tmp_path / "ckpt"), timeout=300)
    for result in results:
        assert result["default_group_used"] == [], result["default_group_used"]
        assert result["started_elsewhere"] == (result["rank"] != 0)
        assert result["gathered"] == [0.0, 1.0]
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert result["norms"] == pytest.approx(expected["norms"], rel=1e-5)
        assert result["norms"][0] > CLIP  # clipping did clip
        for name, value in expected["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6)
            assert torch.equal(result["loaded"][name], result["params"][name]), name
        for key, value in result["state"].items():
            assert torch.equal(torch.as_tensor(result["loaded_state"][key]), torch.as_tensor(value))
        assert result["step"] == STEPS
    for name in expected["params"]:  # the ranks agree exactly: one model, replicated
        assert torch.equal(results[0]["params"][name], results[1]["params"][name])


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 1)
    )


def _bn_steps(engine: Any, model: Any, opt: Any, rank: int, world: int) -> None:
    data = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=data), torch.randn(8, 1, generator=data)
        mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        engine.backward(loss) if engine is not None else loss.backward()
        opt.step()
        opt.zero_grad()


def sync_batchnorm_on_own_channel() -> dict[str, Any]:
    import sys

    tpp.register(sys.modules[__name__], name="own-channel-test")
    try:
        with (
            default_group_collectives_raise() as used,
            tp.Engine("own-channel", sync_batchnorm=True) as engine,
        ):
            model = _bn_model()
            model, opt = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            _bn_steps(engine, model, opt, engine.rank, engine.world_size)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return {"used": used, "state": state}
    finally:
        tpp.unregister("own-channel-test")


def test_sync_batchnorm_sums_its_statistics_through_the_backends_own_channel(ranks):
    """Issue 33 item 5: the CPU synchronised BatchNorm (a feature) sums its statistics, and
    their gradients, through the active set's reduce hook: on a backend whose collectives are
    its own, two ranks of four samples train as one process on the eight."""
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _bn_steps(None, model, opt, 0, 1)
    for result in ranks.run(sync_batchnorm_on_own_channel, timeout=300):
        assert result["used"] == []
        for name, value in model.state_dict().items():
            torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-6)
