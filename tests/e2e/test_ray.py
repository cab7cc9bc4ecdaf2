"""Ray Train as a route: ``ray.train.torch.TorchTrainer`` starts the workers and their process
group; ``Engine()`` ("auto") in the training function reads the torchrun-style variables Ray sets,
joins Ray's process group (and leaves it to Ray at close) and trains like any ddp run.

Runs where Ray is installed (``tox -e cluster`` installs it); skips elsewhere, saying why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.paths import TESTS

pytest.importorskip("ray.train.torch", reason="Ray Train is not installed (tox -e cluster has it)")

from support.real_cluster import GLOBAL_BATCH, STEPS, assert_matches_reference  # noqa: E402

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


def train_loop(config: dict) -> None:
    """What a Ray user writes: their loop in a function, torchplug's Engine inside."""
    import torch
    import torch.distributed as dist

    import torchplug as tp

    joined = dist.is_initialized()  # Ray made the process group before calling us
    with tp.Engine() as engine:
        torch.manual_seed(engine.rank)
        net = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
        )
        net, opt = engine.setup(net, torch.optim.AdamW(net.parameters(), lr=0.05))
        share = GLOBAL_BATCH // engine.world_size
        losses = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 + step)
            x = torch.randn(GLOBAL_BATCH, 6, generator=g)
            y = torch.randn(GLOBAL_BATCH, 2, generator=g)
            rows = slice(engine.rank * share, (engine.rank + 1) * share)
            loss = torch.nn.functional.mse_loss(net(x[rows]), y[rows])
            engine.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(engine.reduce(loss.detach(), "mean").item())
        state = {k: v.detach().clone() for k, v in engine.unwrap(net).state_dict().items()}
        if engine.rank == 0:
            torch.save(
                {"state": state, "losses": losses, "world": engine.world_size,
                 "strategy": str(engine.strategy), "joined": joined},
                config["out"],
            )  # fmt: skip
    assert dist.is_initialized()  # Ray's group: not torchplug's to destroy


def test_ray_train_workers_get_ddp_on_rays_process_group(tmp_path):
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = tmp_path / "result.pt"
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.pathsep.join([str(HERE), str(TESTS)]),
                "OMP_NUM_THREADS": "1",
            }
        },
    )
    try:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"out": str(out)},
            scaling_config=ScalingConfig(
                num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}
            ),
            run_config=RunConfig(storage_path=str(tmp_path / "ray")),
        )
        result = trainer.fit()
    finally:
        ray.shutdown()
    assert result.error is None, result.error
    assert_matches_reference(out)
    import torch

    assert torch.load(out, weights_only=True)["joined"] is True
