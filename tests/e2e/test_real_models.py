"""Real model shapes under every strategy: buffers that differ between ranks are saved as rank
0's copy (DDP's rule), never a mix of ranks; loading gives every rank exactly rank 0's model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchplug as tp
from support.models import images, make_resnet
from support.real_models import load_into, sgd_step, train_bn_and_save
from torchplug.checkpoint.tensors import assign


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_batchnorm_statistics_are_rank_zeros_in_the_checkpoint(ranks, tmp_path, strategy):
    path = str(tmp_path / "ckpt")
    saved = ranks.run(train_bn_and_save, strategy, path, timeout=600)
    rank0 = saved[0]
    assert len(rank0["buffers"]) == 15  # 5 BatchNorms x (mean, var, num_batches_tracked)
    differ = [
        k for k in rank0["buffers"] if not torch.equal(rank0["buffers"][k], saved[1]["buffers"][k])
    ]
    assert len(differ) >= 10, differ  # the ranks really hold different statistics
    loaded = load_into("single", path)
    for name, value in rank0["buffers"].items():
        assert torch.equal(loaded["buffers"][name], value), name
    assert loaded["buffers"]["stem.1.num_batches_tracked"].dtype == torch.int64
    torch.testing.assert_close(loaded["logits"], rank0["logits"], rtol=0, atol=1e-5)
    # and back into the same strategy on 2 ranks: both ranks get rank 0's statistics
    for again in ranks.run(load_into, strategy, path, timeout=600):
        for name, value in rank0["buffers"].items():
            assert torch.equal(again["buffers"][name], value), name
        torch.testing.assert_close(again["logits"], rank0["logits"], rtol=0, atol=1e-5)


def test_only_tensors_replicated_by_construction_are_spread_over_the_ranks():
    sizes = [{"p": 8, "q": 8, "buf": 4, "mine": 2}, {"p": 8, "q": 8, "buf": 4, "yours": 2}]
    spread = [{"p", "q", "mine"}, {"p", "q", "yours"}]
    owners = assign(sizes, spread)
    assert sorted([owners["p"], owners["q"]]) == [0, 1]  # balanced
    assert owners["buf"] == 0  # held by both, declared by neither: rank 0's copy
    assert owners["mine"] == 0 and owners["yours"] == 1  # one holder each
    # a name only some holders vouch for is not replicated
    assert assign([{"t": 8, "u": 16}, {"t": 8, "u": 16}], [{"t", "u"}, {"u"}])["t"] == 0


def train_norms(strategy: str, precision: str | None, steps: int = 4) -> dict[str, Any]:
    """The BN ResNet with a LayerNorm before its head, each rank on its own images."""
    with tp.Engine(strategy, precision=precision) as engine:
        model = make_resnet()
        model.head = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = engine.setup(model, optimizer)
        losses = []
        for step in range(steps):
            x, y = images(seed=100 * engine.rank + step)
            loss = sgd_step(engine, model, optimizer, x, y)
            losses.append(engine.reduce(loss, "mean").item())
        state = engine.full_state(model)["model"]
        return {"losses": losses, "dtypes": {k: v.dtype for k, v in state.items()}}


def test_fsdp_bf16_trains_batchnorm_and_layernorm_like_fp32(ranks):
    """bf16 FSDP2 runs norm layers in fp32 (their statistics are fp32 buffers); the losses
    follow the fp32 run within bf16's tolerance."""
    low = ranks.run(train_norms, "fsdp", "bf16", timeout=600)[0]
    full = ranks.run(train_norms, "ddp", None, timeout=600)[0]
    assert all(abs(a - b) < 5e-2 for a, b in zip(low["losses"], full["losses"], strict=True)), (
        low["losses"],
        full["losses"],
    )
    assert low["dtypes"]["stem.1.running_mean"] == torch.float32
    assert low["dtypes"]["head.0.weight"] == torch.float32


def built_empty_self_initialising(strategy: str) -> dict[str, torch.Tensor]:
    from support.models import SelfInitialising

    with tp.Engine(strategy) as engine:
        torch.manual_seed(0)
        with engine.init_module(empty=True):
            model = SelfInitialising()
        model = engine.setup(model)
        return {k: v.clone() for k, v in engine.full_state(model)["model"].items()}


def test_meta_init_runs_a_models_own_init_weights(ranks):
    from support.models import self_initialising_eager

    eager = self_initialising_eager()
    assert eager["up.bias"].abs().sum() == 0  # init_weights ran (reset_parameters' bias isn't 0)
    for built in [
        built_empty_self_initialising("single"),
        *ranks.run(built_empty_self_initialising, "fsdp", timeout=600),
    ]:
        assert [k for k in eager if not torch.equal(built[k], eager[k])] == []


def train_resnet(strategy: str, steps: int = 3, **engine_args: Any) -> dict[str, Any]:
    """Global batch 8 split over the ranks (rank r takes samples r::world of each batch)."""
    with tp.Engine(strategy, **engine_args) as engine:
        model = make_resnet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = engine.setup(model, optimizer)
        losses = []
        for step in range(steps):
            x, y = images(seed=step, batch=8)
            mine = slice(
                engine.rank * 8 // engine.world_size, (engine.rank + 1) * 8 // engine.world_size
            )
            loss = sgd_step(engine, model, optimizer, x[mine], y[mine])
            losses.append(engine.reduce(loss, "mean").item())
        kinds = sorted({type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__})
        state = {k: v.clone() for k, v in engine.full_state(model)["model"].items()}
    after_close = sorted({type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__})
    return {"losses": losses, "state": state, "kinds": kinds, "after_close": after_close}


def test_sync_batchnorm_on_two_cpu_ranks_trains_like_one_process_on_the_global_batch(ranks):
    reference = train_resnet("single")  # plain BatchNorm over all 8 samples
    for result in ranks.run(train_resnet, "ddp", sync_batchnorm=True, timeout=600):
        assert result["kinds"] == ["GlobalBatchNorm"]
        assert result["after_close"] == ["BatchNorm2d"]  # close() puts the user's layers back
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        for name, value in reference["state"].items():
            torch.testing.assert_close(result["state"][name], value, atol=1e-5, rtol=0, msg=name)
    # without it each rank's statistics are its own half's: not the global batch's
    plain = ranks.run(train_resnet, "ddp", timeout=600)[0]
    off = (plain["state"]["stem.1.running_mean"] - reference["state"]["stem.1.running_mean"]).abs()
    assert off.max() > 1e-3


def test_sync_batchnorm_setting_comes_from_the_launcher_environment(monkeypatch):
    from torchplug.features import syncbn

    monkeypatch.setenv(syncbn.SYNC_BATCHNORM_ENV, "1")
    with tp.Engine("single") as engine:
        assert engine.sync_batchnorm is True
    with tp.Engine("single", sync_batchnorm=False) as engine:
        assert engine.sync_batchnorm is False
    monkeypatch.setenv(syncbn.SYNC_BATCHNORM_ENV, "maybe")
    with pytest.raises(
        tp.ConfigurationError, match="TORCHPLUG_SYNC_BATCHNORM='maybe' is not a boolean"
    ):
        tp.Engine("single")
    monkeypatch.delenv(syncbn.SYNC_BATCHNORM_ENV)
    with pytest.raises(tp.ConfigurationError, match="sync_batchnorm must be True or False"):
        tp.Engine("single", sync_batchnorm="yes")


GROWING = {"init_scale": 256.0, "growth_interval": 1}  # the scale doubles every clean step


def test_fp16_resume_carries_the_loss_scale_and_repeats_the_uninterrupted_run(ranks, tmp_path):
    from torchplug.testing import bodies

    args = {"precision": "fp16", "precision_options": GROWING, "optimizer": "SGD", "lr": 0.1}
    whole = ranks.run(bodies.train, "ddp", steps=10, **args, timeout=600)[0]
    assert len(set(whole["scales"])) > 3  # the scale really moves
    path = str(tmp_path / "half")
    ranks.run(bodies.train, "ddp", steps=5, save_to=path, **args, timeout=600)
    resumed = ranks.run(
        bodies.train, "ddp", steps=5, first_step=5, load_from=path, **args, timeout=600
    )
    for result in resumed:
        assert result["scales"] == whole["scales"][5:]
        assert result["skipped"] == whole["skipped"][5:]
        assert result["losses"] == pytest.approx(whole["losses"][5:], abs=1e-6)
        for name, value in whole["params"].items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-6, rtol=0)


def test_user_keys_in_torchplugs_namespace_are_refused(tmp_path):
    with tp.Engine("single") as engine, pytest.raises(tp.CheckpointError, match="namespace"):
        engine.save(str(tmp_path / "c"), {"torchplug.mine": 1})
