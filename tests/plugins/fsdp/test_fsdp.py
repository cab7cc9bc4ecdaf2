"""fsdp (torch FSDP2) against the single-process reference; sharded memory; clipping."""

from __future__ import annotations

import pytest
import torch

import torchplug as tp
from support.reference import assert_close_dicts, make_model, train
from torchplug.plugins.fsdp import shard_units


@pytest.fixture(scope="module")
def reference() -> dict:
    return train("single", clip=1.0)


@pytest.fixture(scope="module")
def unclipped() -> dict:
    return train("single")


def test_fsdp_matches_single_process_reference(ranks, reference):
    results = ranks.run(train, "fsdp", clip=1.0, min_params=1)
    for result in results:
        assert result["strategy"] == "fsdp" and result["world_size"] == 2
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert_close_dicts(result["params"], reference["params"], atol=1e-5)
        assert_close_dicts(result["optimizer"], reference["optimizer"], atol=1e-5)
        # the gradient norm across shards equals the unsharded one, step by step
        assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5)


def test_fsdp_bf16_is_fsdp_mixed_precision_within_tolerance(ranks, unclipped):
    for result in ranks.run(train, "fsdp", "bf16"):
        assert result["losses"] == pytest.approx(unclipped["losses"], abs=3e-2)
        assert result["losses"] != unclipped["losses"]


def test_fsdp_gradient_accumulation_with_no_sync(ranks, unclipped):
    for result in ranks.run(train, "fsdp", accumulate=2):
        assert result["losses"] == pytest.approx(unclipped["losses"], abs=1e-5)


def local_bytes(strategy: str) -> int:
    """Bytes of parameter and optimizer-state storage this rank holds after one step."""
    from torch.distributed.tensor import DTensor

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    with tp.Engine(strategy, timeout=60.0) as engine:
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        optimizer = torch.optim.AdamW(model.parameters())
        model, optimizer = engine.setup(model, optimizer)
        engine.backward(model(torch.randn(4, 64)).sum())
        optimizer.step()
        total = sum(nbytes(p) for p in model.parameters())
        total += sum(nbytes(v) for s in optimizer.state.values() for v in s.values())
        return total


def test_fsdp_holds_about_half_the_bytes_of_ddp_per_rank(ranks):
    ddp = ranks.run(local_bytes, "ddp")
    fsdp = ranks.run(local_bytes, "fsdp")
    for d, f in zip(ddp, fsdp, strict=True):
        assert f <= 0.55 * d, (f, d)


def test_shard_units_by_class_name_and_by_size():
    model = torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.ReLU()),  # 110 params
        torch.nn.Linear(10, 2),  # 22 params
    )
    assert shard_units(model, ("Linear",), 0) == [model[0][0], model[1]]
    assert shard_units(model, (), 100) == [model[0][0]]  # innermost first; its parent is then empty
    assert shard_units(model, (), 0) == []


def test_fsdp_rejects_fp16_naming_what_it_supports():
    with pytest.raises(tp.ConfigurationError, match="'fsdp' cannot run precision 'fp16'.*32, bf16"):
        tp.Engine("fsdp", precision="fp16")


def test_fsdp_in_one_process_runs_and_matches(reference):
    before = make_model().state_dict()
    result = train("fsdp", clip=1.0)
    assert result["world_size"] == 1
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-6)
    # the reference model is unchanged by sharding another copy: same class, same values
    after = make_model()
    assert type(after) is torch.nn.Sequential
    assert_close_dicts(after.state_dict(), before, atol=0.0)


def transposed_weight_steps(strategy: str) -> list[float]:
    """Three SGD steps of a model whose first weight is a transposed (non-contiguous) view."""
    with tp.Engine(strategy) as engine:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        model[0].weight = torch.nn.Parameter(torch.randn(8, 16).t())
        assert not model[0].weight.is_contiguous()
        model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        torch.manual_seed(1)
        x, y = torch.randn(4, 8), torch.randn(4, 2)
        losses = []
        for _ in range(3):
            loss = torch.nn.functional.mse_loss(model(x), y)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses


def test_fsdp_takes_non_contiguous_parameters_as_every_other_strategy(ranks):
    """FSDP2 refuses non-contiguous parameters; the fsdp strategy lays them out contiguously
    (same values), so a script with a transposed weight runs under fsdp as under ddp."""
    expected = transposed_weight_steps("single")
    for strategy in ("fsdp", "ddp"):
        for losses in ranks.run(transposed_weight_steps, strategy):
            assert losses == pytest.approx(expected, rel=1e-5), strategy


def mesh_facts(strategy: str) -> dict:
    """What one job's mesh looks like, and whether two models set up in it share it."""
    from torch.distributed.device_mesh import DeviceMesh

    with tp.Engine(strategy, timeout=60.0) as engine:
        built = engine.mesh  # before any setup: the strategy's setup built it
        first = engine.setup(torch.nn.Linear(4, 4))
        second = engine.setup(torch.nn.Sequential(torch.nn.Linear(4, 2)))
        return {
            "is_mesh": isinstance(built, DeviceMesh),
            "shape": tuple(built.shape),
            "names": built.mesh_dim_names,
            "on_runtime": engine.runtime.mesh is built,
            "shared": first.weight.device_mesh is second[0].weight.device_mesh is built,
        }


def test_fsdp_builds_one_mesh_per_job_that_every_setup_shards_over(ranks):
    """The mesh is made once, when the Engine starts (not at every setup): two models of one job
    hold DTensors on the very same mesh object, ``engine.mesh``."""
    for facts in ranks.run(mesh_facts, "fsdp"):
        assert facts == {
            "is_mesh": True,
            "shape": (2,),
            "names": ("dp",),
            "on_runtime": True,
            "shared": True,
        }


def test_strategies_without_a_mesh_say_none():
    with tp.Engine("single") as engine:
        assert engine.mesh is None and engine.runtime.mesh is None
