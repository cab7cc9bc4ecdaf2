"""``local-sgd`` (issue 34 item 5): against a plain torch.distributed local SGD loop written here
(each rank steps on its share; every ``sync_every`` steps, and at the end, the parameters are
averaged), the kit with its declared deviations, and checkpoints holding rank 0's replica."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchplug as tp
from torchplug.testing.conformance import classes

globals().update(classes("local-sgd", ("32", "bf16")))

STEPS, SYNC_EVERY, BATCH = 7, 3, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 6, generator=g)
    y = x.sum(1, keepdim=True).sin()
    share = BATCH // world
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def plain_local_sgd() -> dict:
    """The reference: torch.distributed alone (the rank pool's process group)."""
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = _model()
        opt = _optimizer(model)
        losses = []
        for step in range(STEPS):
            x, y = _batch(step, rank, world)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if (step + 1) % SYNC_EVERY == 0 or step + 1 == STEPS:  # and once at the end
                with torch.no_grad():
                    for p in model.parameters():
                        dist.all_reduce(p)
                        p /= world
        return {"losses": losses, "params": {k: v.clone() for k, v in model.state_dict().items()}}
    finally:
        dist.destroy_process_group()


def torchplug_local_sgd(path: str) -> dict:
    model = _model()
    with tp.Engine("local-sgd", sync_every=SYNC_EVERY, timeout=120.0) as engine:
        wrapped, opt = engine.setup(model, _optimizer(model))
        losses = []
        for step in range(STEPS):
            x, y = _batch(step, engine.rank, engine.world_size)
            loss = nn.functional.mse_loss(wrapped(x), y)
            engine.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        mine = {k: v.clone() for k, v in model.state_dict().items()}  # between two averages
        engine.save(path, {"model": wrapped, "optimizer": opt})
        ranks_zero = engine.broadcast_object({k: v.tolist() for k, v in mine.items()}, 0)
    fresh = _model()
    with tp.Engine("local-sgd", timeout=120.0) as engine:
        reloaded, opt2 = engine.setup(fresh, _optimizer(fresh))
        engine.load(path, {"model": reloaded, "optimizer": opt2})
        loaded = {k: v.clone() for k, v in fresh.state_dict().items()}
    return {
        "losses": losses,
        "params": {k: v.clone() for k, v in model.state_dict().items()},  # after close()
        "differs_before_close": any(
            not torch.equal(mine[k], torch.tensor(v)) for k, v in ranks_zero.items()
        ),
        "loaded": loaded,
        "ranks_zero": {k: torch.tensor(v) for k, v in ranks_zero.items()},
    }


def test_local_sgd_equals_a_plain_torch_distributed_loop(ranks, tmp_path):
    expected = ranks.run(plain_local_sgd)
    got = ranks.run(torchplug_local_sgd, str(tmp_path / "ckpt"), timeout=300)
    for rank, (mine, want) in enumerate(zip(got, expected, strict=True)):
        assert mine["losses"] == pytest.approx(want["losses"], abs=1e-6), rank
        for name, value in want["params"].items():  # averaged once more at close()
            torch.testing.assert_close(mine["params"][name], value, atol=1e-6, rtol=0)
    # the ranks' losses differ (no gradient exchange), and between averages so do the replicas
    assert got[0]["losses"] != pytest.approx(got[1]["losses"], abs=1e-4)
    assert got[1]["differs_before_close"]
    for mine in got:  # every rank loads rank 0's replica: one copy, never a mix
        for name, value in mine["ranks_zero"].items():
            assert torch.equal(mine["loaded"][name], value.to(mine["loaded"][name].dtype)), name


def test_sync_every_must_be_a_positive_number_of_steps():
    with pytest.raises(tp.ConfigurationError, match="sync_every.*1 or more"):
        tp.Engine("local-sgd", sync_every=0)


def test_close_destroys_the_process_group_it_made():
    """Its teardown averages, then releases the group as every DistributedStrategy does (a
    group left behind broke later tests in the same process)."""
    model = _model()
    with tp.Engine("local-sgd") as engine:
        engine.setup(model, _optimizer(model))
        assert dist.is_initialized()
    assert not dist.is_initialized()
